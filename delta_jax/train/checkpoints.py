"""Full train-state checkpoints on top of the model layout of delta_jax/checkpoint.py.

Each step directory (under checkpoint.directory, by default <output_dir>/checkpoints; a gs://
bucket works) holds the model items of that layout
(`params`, `model_config`, so load_checkpoint and the converter read a training checkpoint as a
model) plus
  opt_state  the optax state (StandardSave)
  run        {"step", "seed", "config": the whole RunConfig} (JsonSave)
  data       the grain iterator's state, one file per process (grain.checkpoint)
Permanent checkpoints (every checkpoint.every steps, and the run's last step) are kept, the
newest checkpoint.keep of them; any other save (a temporary one, every checkpoint.every_minutes,
or one on a stop signal) is kept only while it is the newest: Orbax deletes it once a newer one
is committed, never before. Which is which follows from the step number alone, so a restarted
run treats what an earlier one saved the same way.
Saves are asynchronous: `save` returns once the arrays are copied to host memory, so the next
step may donate them. Orbax finalises a step directory atomically, so `latest_step` only ever
names a complete checkpoint (a save killed midway leaves a temporary directory, removed at the
next start). A complete but damaged one (truncated or deleted files) is only found by reading
it: a failed read is retried (checkpoint.read_retries, with a doubling wait: a remote store's
errors are often transient), and if it still fails the trainer `quarantine`s the step and falls
back to the previous one. Restoring takes a
target state whose leaves carry the shardings of the current mesh, which may differ from the
one that saved.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from delta_jax.checkpoint import MODEL_CONFIG, PARAMS, config_from_json, config_to_json
from delta_jax.config import ModelConfig
from delta_jax.train.config import CheckpointConfig
from delta_jax.train.state import TrainState

OPT_STATE = "opt_state"
RUN = "run"
DATA = "data"

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class KeepPermanentAndNewest(ocp.checkpoint_managers.PreservationPolicy):
    """Orbax's choice of the checkpoints to keep after a save commits: the newest `keep`
    permanent ones (steps that are multiples of `every` > 0, and `last_step`) and the newest
    of all."""

    every: int
    keep: int
    last_step: int | None

    def is_permanent(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step == self.last_step

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        steps = [info.step for info in checkpoints]
        permanent = sorted(s for s in steps if self.is_permanent(s))[-self.keep:]
        kept = {*permanent, max(steps, default=None)}
        return [s in kept for s in steps]


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig,
                 last_step: int | None = None):
        """`last_step`: the run's train.steps, whose checkpoint is permanent."""
        path = epath.Path(directory)
        self.directory = path if "://" in str(directory) else path.absolute()
        self.policy = KeepPermanentAndNewest(cfg.every, cfg.keep, last_step)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                preservation_policy=self.policy, enable_async_checkpointing=cfg.async_save,
                create=True, cleanup_tmp_directories=True))
        self.read_retries, self.retry_wait_s = cfg.read_retries, cfg.retry_wait_s

    def _read(self, step: int, what: str, read: Callable[[], T]) -> T:
        """`read()`, tried again read_retries times (waits retry_wait_s, doubling) if it raises;
        the last error propagates."""
        for attempt in range(self.read_retries + 1):
            try:
                return read()
            except Exception as e:  # noqa: BLE001 (any reader error may be transient)
                if attempt == self.read_retries:
                    raise
                wait = self.retry_wait_s * 2 ** attempt
                first_line = (str(e).strip().splitlines() or [""])[0][:200]
                logger.warning("reading the %s of checkpoint %s failed (%s: %s); retry %d of %d "
                               "in %.1f s", what, self.directory / str(step), type(e).__name__,
                               first_line, attempt + 1, self.read_retries, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """Complete checkpoints, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def restore_configs(self, step: int) -> tuple[ModelConfig, dict]:
        """(the saved ModelConfig, the run record) without reading any array."""
        restored = self._read(step, "configs", lambda: self._manager.restore(
            step, args=ocp.args.Composite(**{MODEL_CONFIG: ocp.args.JsonRestore(),
                                             RUN: ocp.args.JsonRestore()})))
        where = self.directory / str(step) / MODEL_CONFIG
        return config_from_json(restored[MODEL_CONFIG], source=str(where)), restored[RUN]

    def quarantine(self, step: int) -> epath.Path:
        """Rename a damaged step directory to `<step>.corrupt` (no longer a step, kept for
        inspection) so that the step can be saved again; returns the new path."""
        src = self.directory / str(step)
        dst = self.directory / f"{step}.corrupt"
        if jax.process_index() == 0:
            if dst.exists():
                dst.rmtree()
            src.rename(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"quarantine {step}")
        self._manager.reload()
        return dst

    def save(self, state: TrainState, data_iterator: grain.DatasetIterator,
             model_config: ModelConfig, run: dict[str, Any]) -> None:
        """Start saving `state` at its step (returns before the files are written)."""
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(state.params),
            OPT_STATE: ocp.args.StandardSave(state.opt_state),
            MODEL_CONFIG: ocp.args.JsonSave(config_to_json(model_config)),
            RUN: ocp.args.JsonSave({"step": step, **run}),
            DATA: grain.checkpoint.CheckpointSave(data_iterator),
        }))

    def restore(self, step: int, target: TrainState, data_iterator: grain.DatasetIterator
                ) -> tuple[TrainState, ModelConfig, dict, bool]:
        """(state on target's shardings, the saved ModelConfig, the run record, whether the data
        iterator was restored). The iterator is moved to where it was at `step` if the
        checkpoint was saved by as many processes as there are now (grain keeps one state per
        process); otherwise it is left alone for the caller."""
        items = {
            PARAMS: ocp.args.StandardRestore(target.params),
            OPT_STATE: ocp.args.StandardRestore(target.opt_state),
            MODEL_CONFIG: ocp.args.JsonRestore(),
            RUN: ocp.args.JsonRestore(),
        }
        process_file = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        data_restored = (self.directory / str(step) / DATA / process_file).exists()
        if data_restored:
            items[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self._read(step, "state",
                              lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
        where = self.directory / str(step)
        model_config = config_from_json(restored[MODEL_CONFIG], source=f"{where}/{MODEL_CONFIG}")
        run = restored[RUN]
        state = TrainState(step=jax.device_put(jax.numpy.int32(run["step"]), target.step.sharding),
                           params=restored[PARAMS], opt_state=restored[OPT_STATE])
        return state, model_config, run, data_restored

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        """Pending saves finish and the manager closes, however the block ends: a manager left
        open has threads that fail at interpreter exit, after the run's last message."""
        try:
            self.wait()
        finally:
            self.close()
