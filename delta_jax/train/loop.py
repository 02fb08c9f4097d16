"""The training run: data, state (fresh, fine-tuned or resumed), the step loop, evaluation,
checkpoints, metrics and the end-of-run summary.

Every process runs this same code (SPMD). Each reads its own rows of the global batch; the
global batch of step s is a pure function of (seed, s), and the step is deterministic, so a
resumed run repeats the uninterrupted one exactly.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from delta_jax.analyze import heatmap_result, plot_heatmap
from delta_jax.checkpoint import load_checkpoint, load_checkpoint_config
from delta_jax.config import RUNTIME_FIELDS
from delta_jax.data.corpus import resolve_embedded
from delta_jax.data.pipeline import (
    MixtureSchedule,
    batch_keys,
    build_batch_iterator,
    build_eval_iterator,
    build_mixture_iterator,
    data_tokenizer,
    mixture_tokenizer,
    to_global_array,
)
from delta_jax.model.causal_lm import count_params
from delta_jax.sharding import batch_sharding, make_hybrid_mesh
from delta_jax.train import metrics as metrics_lib
from delta_jax.train import plots
from delta_jax.train.checkpoints import Checkpointer
from delta_jax.train.config import MeshConfig, RunConfig, dump_config
from delta_jax.train.faults import (
    NonFiniteStop,
    Preempted,
    PreflightError,
    StopSignals,
    check_writable,
    state_bytes,
)
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (
    TrainState,
    abstract_graph_and_params,
    abstract_state,
    init_state,
    state_from_params,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_eval_step, make_routing_probe, make_train_step
from delta_jax.train.trainable import ALL, split, trainable_paths

logger = logging.getLogger(__name__)

# ModelConfig fields that only shape a fresh initialisation: a checkpoint may differ in them.
INIT_ONLY_FIELDS = ("router_init", "init_std")
# Changing these between a checkpoint and its resumption would change which batch a step reads,
# or what it holds.
DATA_ORDER_KEYS = (("seed",), ("data", "path"), ("data", "mixture"), ("data", "packing"),
                   ("train", "batch_size"), ("train", "seq_len"))
# What a saved config that predates a key ran with.
SAVED_BEFORE_THE_KEY = {("data", "packing"): "concat", ("data", "mixture"): []}


def build_mesh(cfg: MeshConfig) -> Mesh:
    """The configured mesh over all devices of all processes, of every slice or node; a
    PreflightError if its sizes do not fit them."""
    try:
        return make_hybrid_mesh(cfg.per_slice, cfg.across_slices)
    except ValueError as e:  # the sizes (make_hybrid_mesh's message names them)
        raise PreflightError(
            f"preflight: {e}; expected mesh.data x mesh.fsdp x mesh.tensor to fill each slice "
            "or node and mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_tensor the slices (one of "
            "each may be -1: the rest), e.g. mesh.data=-1 mesh.fsdp=1 mesh.tensor=1") from None


def data_source(cfg: RunConfig) -> str | Path:
    """data.path, or with data.mixture its first source (what the routing probe reads)."""
    return resolve_embedded(cfg.data.path or cfg.data.mixture[0].path, cfg.data.cache_dir,
                            cfg.train.seq_len)


def mixture_sources(cfg: RunConfig) -> dict[str, str | Path]:
    """{name: prepared directory} of data.mixture's sources, in order ({} without one)."""
    return {s.name: resolve_embedded(s.path, cfg.data.cache_dir, cfg.train.seq_len)
            for s in cfg.data.mixture}


def _check_batch(cfg: RunConfig, mesh: Mesh) -> None:
    """Each microbatch's rows split evenly over the batch's devices (data x fsdp) and every
    process reads the same number of rows."""
    t, shards = cfg.train, mesh.shape["data"] * mesh.shape["fsdp"]
    rows = t.batch_size // t.grad_accum
    if rows % shards or t.batch_size % jax.process_count():
        multiple = math.lcm(shards * t.grad_accum, jax.process_count())
        fits = sorted({max(multiple, t.batch_size // multiple * multiple),
                       -(-t.batch_size // multiple) * multiple})
        raise PreflightError(
            f"preflight: train.batch_size={t.batch_size} with train.grad_accum={t.grad_accum} "
            f"gives microbatches of {rows} rows, which must split over mesh data x fsdp = "
            f"{shards} devices and {jax.process_count()} process(es): expected a multiple of "
            f"{multiple}, e.g. " + " or ".join(f"train.batch_size={b}" for b in fits))


def _check_resumable(saved: dict, cfg: RunConfig, where: Path) -> None:
    current = json.loads(json.dumps(cfg.to_dict()))  # as saved: tuples are lists
    for keys in DATA_ORDER_KEYS:
        old, new = saved, current
        for k in keys:
            old, new = old.get(k, SAVED_BEFORE_THE_KEY.get(keys)), new[k]
        if old != new:
            name = ".".join(keys)
            raise PreflightError(f"{where}: saved with {name}={old!r}, resuming with {new!r} "
                                 f"would change the training data; set {name}={old!r} or use a "
                                 "new output_dir")


def _check_same_trainable(saved: dict, trainable: tuple[str, ...], where: Path) -> None:
    """A checkpoint's optimizer state holds the parameters its run trained: resuming trains
    the same ones (a new subset starts a new run from these weights, with train.init_from)."""
    old = ",".join(saved["train"].get("trainable", [ALL]))
    new = ",".join(trainable)
    if old != new:
        raise PreflightError(
            f"{where}: saved with train.trainable={old!r}, resuming with {new!r}: its optimizer "
            f"state holds only the parameters {old!r} trains; set train.trainable={old!r}, or "
            f"train {new!r} in a new output_dir with train.init_from={str(where.parent)!r}")


def _check_architecture(saved, cfg, where: Path) -> None:
    diff = {k: (v, getattr(cfg, k)) for k, v in saved.architecture().items()
            if k not in INIT_ONLY_FIELDS and getattr(cfg, k) != v}
    if diff:
        raise PreflightError(f"{where}: model_config differs from the run's model in "
                             + ", ".join(f"{k} (checkpoint {a!r}, run {b!r})"
                                         for k, (a, b) in sorted(diff.items())))


def _check_init_from(init_from: str, model_cfg) -> None:
    """train.init_from names a model checkpoint of the run's architecture."""
    where = Path(init_from)
    try:
        saved = load_checkpoint_config(where)
    except (OSError, ValueError) as e:
        raise PreflightError(f"preflight: train.init_from={init_from!r} is not a model "
                             f"checkpoint ({type(e).__name__}: {e})") from e
    _check_architecture(saved, model_cfg, where)


def _read_everywhere(error: Exception | None) -> bool:
    """Whether every process read what it was reading (`error` is this process's failure)."""
    ok = error is None
    if jax.process_count() > 1:
        ok = bool(multihost_utils.process_allgather(np.int32(ok)).all())
    return ok


def _global_batches(iterator: Iterator, sharding) -> Iterator[dict[str, jax.Array]]:
    for local in iterator:
        yield to_global_array(local, sharding)


class _EventCount:
    """How many times JAX has recorded `event` (jax.monitoring) in this process."""

    def __init__(self, event: str):
        self.event, self.count = event, 0
        jax.monitoring.register_event_listener(self._listen)

    def _listen(self, event: str, **_) -> None:
        if event == self.event:
            self.count += 1


_cache_hits = _EventCount("/jax/compilation_cache/cache_hits")


class ProfileWindow:
    """A jax.profiler trace of the steps FIRST..LAST of train.profile_steps (every process
    traces its own devices) in `directory`/plugins/profile, where TensorBoard's Profile tab
    finds it. A run resumed inside the window traces the rest of it."""

    def __init__(self, steps: tuple[int, ...], directory: Path):
        self.first, self.last = steps or (0, -1)
        self.directory, self.tracing = directory, False

    def before(self, step: int) -> None:
        if not self.tracing and self.first <= step <= self.last:
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after(self, step: int, state: TrainState) -> float:
        """Seconds spent ending the trace after LAST (waiting for the step, writing the file):
        not training time."""
        if not (self.tracing and step == self.last):
            return 0.0
        began = time.perf_counter()
        jax.block_until_ready(state)
        self.stop()
        if jax.process_index() == 0:
            logger.info("profiled steps %d..%d: %s (tensorboard --logdir %s, Profile tab)",
                        self.first, self.last, self.directory / "plugins" / "profile",
                        self.directory)
        return time.perf_counter() - began

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class Trainer:
    """One run of RunConfig. Constructing it is the preflight: every check a user's config or
    files can fail (mesh, batch, data, init_from, free space) runs there and raises
    PreflightError before any folder is created. Entering it (`with Trainer(cfg) as trainer:`)
    opens the checkpoint directory, closed again on every way out; `run()` then trains to
    train.steps and returns the summary."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.is_main = jax.process_index() == 0
        self.mesh = build_mesh(cfg.mesh)
        _check_batch(cfg, self.mesh)
        self.model_cfg = cfg.model
        self.tx = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.lrs = schedules(cfg.optimizer, cfg.train.steps)
        self.graphdef, _ = abstract_graph_and_params(self.model_cfg)
        self.trainable = cfg.train.trainable
        self.shardings = to_shardings(
            state_specs(self.model_cfg, self.tx, self.mesh, self.trainable), self.mesh)
        self.batch_sharding = batch_sharding(self.mesh)
        if cfg.train.wandb.project:
            try:
                metrics_lib.require_wandb(cfg.train.wandb.project)
            except ImportError as e:
                raise PreflightError(f"preflight: {e}") from None
        self._open_data()
        if cfg.train.init_from:
            _check_init_from(cfg.train.init_from, self.model_cfg)
        # Fail here, with the path at fault, rather than at the first save.
        self.checkpoint_dir = cfg.checkpoint.directory or str(self.out / "checkpoints")
        if self.is_main:
            check_writable(self.out, 0)
        check_writable(self.checkpoint_dir, state_bytes(
            abstract_state(self.model_cfg, self.tx, self.shardings, self.trainable)))
        self.checkpointer: Checkpointer | None = None  # while entered
        self.step_fn = make_train_step(self.graphdef, self.tx, self.lrs, cfg.train.grad_accum,
                                       self.shardings, self.mesh, cfg.train.inject_nan_steps,
                                       cfg.train.loss_vocab_chunks, self.trainable)
        self.eval_fn = make_eval_step(self.graphdef, self.shardings.params, self.mesh,
                                      cfg.train.loss_vocab_chunks)
        self.probe_fn = make_routing_probe(self.graphdef, self.shardings.params, self.mesh)
        self.flops_per_token = metrics_lib.train_flops_per_token(self.model_cfg,
                                                                 cfg.train.seq_len)
        self.peak_flops = metrics_lib.device_peak_flops(jax.devices()[0].device_kind,
                                                        cfg.train.peak_tflops)
        self.last_routing: dict[str, Any] | None = None
        self.skipped_in_a_row, self.skipped_total = 0, 0
        self.profiler = ProfileWindow(cfg.train.profile_steps, self.out / "tensorboard")
        # The step of the newest checkpoint started by this run (or resumed from), and when.
        self.last_saved, self.saved_at = 0, time.monotonic()

    def _open_data(self) -> None:
        """The training iterator and a first validation batch (the routing probe's inputs),
        or a PreflightError naming data.path (or data.mixture)."""
        cfg = self.cfg
        named = (f"data.path={cfg.data.path!r}" if cfg.data.path is not None else
                 "data.mixture=" + ",".join(s.path for s in cfg.data.mixture))
        try:
            self.data, self.sources = data_source(cfg), mixture_sources(cfg)
            self.mixture = (MixtureSchedule([s.weight for s in cfg.data.mixture], cfg.seed)
                            if self.sources else None)
            self.train_iter = self._train_iterator()
            # each source's validation split is readable; the first (self.data) feeds the probe
            first_batches = [next(self._eval_batches(data)) for data in self.sources.values()]
            probe_batch = first_batches[0] if first_batches else next(self._eval_batches())
            self.probe_inputs = {k: v for k, v in probe_batch.items() if k != "labels"}
            tokenizer = (mixture_tokenizer(list(self.sources.values())) if self.sources
                         else data_tokenizer(self.data))
        except (OSError, ValueError, StopIteration) as e:
            raise PreflightError(f"preflight: {named} is not readable "
                                 f"({type(e).__name__}: {e})") from e
        if tokenizer["vocab_size"] > cfg.model.vocab_size:
            raise PreflightError(
                f"preflight: {named} holds token ids of the "
                f"{tokenizer['name']!r} tokenizer, below {tokenizer['vocab_size']}, but "
                f"model.vocab_size={cfg.model.vocab_size}: expected model.vocab_size >= "
                f"{tokenizer['vocab_size']} (or data prepared with the model's tokenizer)")

    def _train_iterator(self):
        cfg, t = self.cfg, self.cfg.train
        common = dict(split="train", seq_len=t.seq_len, global_batch_size=t.batch_size,
                      seed=cfg.seed, num_threads=cfg.data.num_threads,
                      prefetch=cfg.data.prefetch, packing=cfg.data.packing)
        if self.mixture is not None:
            return build_mixture_iterator(list(self.sources.values()), self.mixture, **common)
        return build_batch_iterator(self.data, **common)

    def __enter__(self) -> Trainer:
        """Opens (and creates) the checkpoint directory."""
        self.checkpointer = Checkpointer(self.checkpoint_dir, self.cfg.checkpoint,
                                         self.cfg.train.steps)
        return self

    def __exit__(self, *exc) -> None:
        self.checkpointer.__exit__(*exc)

    # State ------------------------------------------------------------------------------
    def initial_state(self) -> tuple[TrainState, str]:
        """(state, how it was obtained): resumed > fine-tuned from init_from > fresh."""
        cfg = self.cfg
        latest = self.checkpointer.latest_step()
        if latest is not None and not cfg.checkpoint.resume:
            raise PreflightError(f"{self.checkpointer.directory}: holds checkpoints up to step "
                                 f"{latest} and checkpoint.resume=false; choose a new "
                                 "output_dir (or checkpoint.directory) or remove them")
        for step in self.checkpointer.steps():
            if (resumed := self._resume(step)) is not None:
                return resumed
        if cfg.train.init_from:
            where = Path(cfg.train.init_from)
            runtime = {k: getattr(self.model_cfg, k) for k in RUNTIME_FIELDS}
            model = load_checkpoint(where, mesh=self.mesh, **runtime)
            params = nnx.state(model, nnx.Param).to_pure_dict()
            return (state_from_params(params, self.tx, self.shardings, self.trainable),
                    f"initialised from {where}")
        return (init_state(self.model_cfg, self.tx, self.shardings, cfg.seed, self.trainable),
                "initialised fresh")

    def _resume(self, step: int) -> tuple[TrainState, str] | None:
        """The state saved at `step`, or None (reported and quarantined) if it is damaged.

        The configs are read and compared first, so a changed model or data order is refused
        with the differing fields rather than failing inside Orbax as a "damaged" checkpoint.
        """
        where = self.checkpointer.directory / str(step)
        # Damage shows up as whatever the reader hit (JSON, tensorstore, missing files), so any
        # exception while reading counts, once the checkpointer's retries are spent; config
        # mismatches are raised outside these `try`s. Every process must take the same
        # checkpoint: one that failed to read anywhere is damaged for all.
        error = None
        try:
            saved_model, run = self.checkpointer.restore_configs(step)
        except Exception as e:  # noqa: BLE001
            error = e
        if not _read_everywhere(error):
            return self._damaged(step, error)
        _check_architecture(saved_model, self.model_cfg, where)
        _check_resumable(run["config"], self.cfg, where)
        _check_same_trainable(run["config"], self.trainable, where)
        target = abstract_state(self.model_cfg, self.tx, self.shardings, self.trainable)
        try:
            state, _, _, data_restored = self.checkpointer.restore(step, target, self.train_iter)
        except Exception as e:  # noqa: BLE001
            error = e
        if not _read_everywhere(error):
            return self._damaged(step, error)
        if not data_restored:
            if str(self.data).startswith("tfds:"):
                raise PreflightError(f"{where}: saved by another number of processes; a TFDS "
                                     "stream resumes only with the same number")
            # Prepared data: the iterator's position is the step (data/pipeline.py).
            self.train_iter.set_state({"next_index": step})
        return state, f"resumed from {where}"

    def _damaged(self, step: int, error: Exception | None) -> None:
        """Quarantine `step`; `error` is this process's read error (None: another's)."""
        moved = self.checkpointer.quarantine(step)
        if error is None:
            error = RuntimeError("read here, but not by another process")
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        if self.is_main:
            logger.warning("damaged checkpoint %s (%s: %s); moved to %s, trying the previous one",
                           self.checkpointer.directory / str(step), type(error).__name__,
                           first_line, moved)
        return None

    # Evaluation -------------------------------------------------------------------------
    def _eval_batches(self, data: str | Path | None = None) -> Iterator[dict[str, jax.Array]]:
        """Validation batches of `data` (default: the run's data, or its first source)."""
        cfg = self.cfg
        iterator = build_eval_iterator(data or self.data, seq_len=cfg.train.seq_len,
                                       global_batch_size=cfg.train.batch_size,
                                       split=cfg.data.validation_split,
                                       packing=cfg.data.packing)
        return _global_batches(iterator, self.batch_sharding)

    def evaluate(self, params: dict) -> dict[str, float]:
        """Validation loss and perplexity (per counted token) over up to train.eval_batches
        batches. A mixture's are its sources' val/<name>/loss and val/<name>/ppl (each over
        up to train.eval_batches), and val_loss their mean weighted as in training."""
        if self.mixture is None:
            return self._validate(params, self.data)
        record, mean_loss, batches = {}, 0.0, 0
        for (name, data), share in zip(self.sources.items(), self.mixture.shares):
            result = self._validate(params, data)
            record[f"val/{name}/loss"], record[f"val/{name}/ppl"] = (result["val_loss"],
                                                                     result["val_ppl"])
            mean_loss += share * result["val_loss"]
            batches += result["val_batches"]
        return {"val_loss": mean_loss, "val_ppl": math.exp(min(mean_loss, 700.0)),
                "val_batches": batches, **record}

    def _validate(self, params: dict, data: str | Path) -> dict[str, float]:
        total, tokens, batches = 0.0, 0, 0
        for batch in self._eval_batches(data):
            nll, counted = self.eval_fn(params, batch)
            total += float(nll)
            tokens += int(counted)
            batches += 1
            if batches == self.cfg.train.eval_batches:
                break
        loss = total / tokens
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_batches": batches}

    def routing(self, params: dict) -> dict[str, Any]:
        """Sharpness per site [L][2] (NaN at unused sites) on the first validation batch."""
        stats = jax.device_get(self.probe_fn(params, self.probe_inputs))
        self.last_routing = stats
        return {k: np.asarray(v) for k, v in stats.items() if k != "mean_weights"}

    # The run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train (inside `with self`); the run's config.yaml and metrics are written only once
        the state is obtained, so a refused resumption leaves the folder as it was."""
        cfg, t = self.cfg, self.cfg.train
        with jax.set_mesh(self.mesh):
            state, origin = self.initial_state()
            start = int(jax.device_get(state.step))
            if self.is_main:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "config.yaml").write_text(dump_config(cfg))
                logger.info("config (%s):\n%s", self.out / "config.yaml", dump_config(cfg))
            tracker = (metrics_lib.WandbLogger(t.wandb, self.out, cfg.to_dict())
                       if self.is_main and t.wandb.project else None)
            writer = metrics_lib.MetricsWriter(self.out, write_files=self.is_main,
                                               tensorboard=t.tensorboard, resume_step=start,
                                               wandb=tracker)
            self._announce(origin, start)
            try:
                with StopSignals() as signals:
                    summary = self._loop(state, start, writer, signals)
            finally:
                self.profiler.stop()
                writer.close()
                self.checkpointer.wait()
        summary.update(self._finish(writer.path, summary["last_saved"]))
        if tracker is not None:
            tracker.finish(t.steps, {name: summary[f"{name}_plot"] for name in ("loss", "routing")
                                     if f"{name}_plot" in summary})
        return summary

    def _announce(self, origin: str, start: int) -> None:
        if jax.process_count() > 1:  # each says where it started: they must agree
            logger.info("process %d: %s (step %d)", jax.process_index(), origin, start)
        if not self.is_main:
            return
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.shape.items())
        logger.info("%d %s device(s) in %d process(es); mesh %s", jax.device_count(),
                    jax.devices()[0].platform, jax.process_count(), mesh)
        logger.info("model: %s, %s parameters, %.3f GFLOPs per training token; %s (step %d)",
                    self.model_cfg.residual, f"{count_params(self.model_cfg):,}",
                    self.flops_per_token / 1e9, origin, start)
        if self.trainable != (ALL,):
            params = abstract_graph_and_params(self.model_cfg)[1].to_pure_dict()
            trained = sum(x.size for x in jax.tree.leaves(split(params, self.trainable)[0]))
            logger.info("train.trainable=%s: %s parameters train (%s), the rest are frozen",
                        ",".join(self.trainable), f"{trained:,}",
                        ", ".join(trainable_paths(params, self.trainable)))

    def _loop(self, state: TrainState, start: int, writer, signals: StopSignals
              ) -> dict[str, Any]:
        t = self.cfg.train
        batches = _global_batches(self.train_iter, self.batch_sharding)
        began, hits = time.perf_counter(), _cache_hits.count
        compiled = self.step_fn.lower(state, self._abstract_batch()).compile()
        compile_s = time.perf_counter() - began
        memory = _compiled_memory(compiled)
        if self.is_main:
            logger.info("train step compiled in %.1f s%s", compile_s,
                        " (loaded from the persistent compilation cache)"
                        if _cache_hits.count > hits else "")
            if memory is not None:
                logger.info("train step memory per device: %.2f GiB by memory_analysis, %.2f "
                            "GiB live at the peak", memory[0] / 2**30, memory[1] / 2**30)
        if start == 0:
            writer.write(0, t.steps, self.evaluate(state.params))
        window, first_loss, train_s, record = [], None, 0.0, {}
        self.last_saved, self.saved_at = start, time.monotonic()
        # Step time is wall time between logs less `paused`: evaluation, checkpointing, logging.
        window_start, paused = time.perf_counter(), 0.0
        previous = None  # (step, metrics) of the step before, checked once this one is queued
        for step in range(start + 1, t.steps + 1):
            self.profiler.before(step)
            state, step_metrics = compiled(state, next(batches))
            paused += self.profiler.after(step, state)
            if previous is not None:
                self._check_finite(*previous)
            previous = (step, step_metrics)
            window.append(step_metrics)
            last = step == t.steps
            record = {}
            if step % t.log_every == 0 or last:
                fetched = jax.device_get(window)  # waits for the window's steps
                elapsed = time.perf_counter() - window_start - paused
                record = self._train_record(fetched, elapsed, step)
                if first_loss is None and self.is_main:
                    self._log_device_peak(memory, step)
                first_loss = float(fetched[0]["loss"]) if first_loss is None else first_loss
                train_s += elapsed
                window, window_start, paused = [], time.perf_counter(), 0.0
            began = time.perf_counter()
            if (t.eval_every and step % t.eval_every == 0) or last:
                record.update(self.evaluate(state.params))
            if self.model_cfg.has_routing and ((t.routing_every and step % t.routing_every == 0)
                                               or last):
                record["routing"] = self.routing(state.params)
            if record:
                writer.write(step, t.steps, record)
            self._checkpoint(state, step, signals)
            paused += time.perf_counter() - began
        if previous is not None:
            self._check_finite(*previous)
        if start >= t.steps:  # nothing left to train: report on the final state
            record = self.evaluate(state.params)
            if self.model_cfg.has_routing:
                record["routing"] = self.routing(state.params)
        return {"steps": t.steps, "start_step": start, "compile_s": compile_s,
                "train_s": train_s, "first_loss": first_loss,
                "final": {**record, "step": t.steps}, "last_saved": self.last_saved}

    @staticmethod
    def _log_device_peak(memory: tuple[int, int] | None, step: int) -> None:
        """What the device allocator saw, beside the compiler's two counts (`memory`): on a TPU
        this tells which of them the runtime needs (the planner's total is an upper bound;
        BENCHMARKS.md)."""
        text = device_peak_text(jax.local_devices()[0].memory_stats(), memory)
        if text is not None:
            logger.info("after step %d: %s", step, text)

    def _checkpoint(self, state: TrainState, step: int, signals: StopSignals) -> None:
        """Save `step` if a checkpoint is due: permanent every checkpoint.every steps and at the
        last, temporary once checkpoint.every_minutes have passed since the last save, and on a
        stop signal (then raise Preempted)."""
        every, last = self.cfg.checkpoint.every, step == self.cfg.train.steps
        if (every and step % every == 0) or last:
            self._save(state, step)
        if last:
            return
        stop, temporary = self._requests(signals)
        if (stop or temporary) and self.last_saved != step:
            if temporary and self.is_main:
                logger.info("step %d: temporary checkpoint, %.1f minutes after the last save",
                            step, (time.monotonic() - self.saved_at) / 60)
            self._save(state, step)
        if stop:
            self.checkpointer.wait()
            raise Preempted(signals.received or signal.SIGTERM, step,
                            str(self.checkpointer.directory / str(step)))

    def _save(self, state: TrainState, step: int) -> None:
        self.checkpointer.save(state, self.train_iter, self.model_cfg,
                               {"seed": self.cfg.seed, "config": self.cfg.to_dict()})
        self.last_saved, self.saved_at = step, time.monotonic()

    def _requests(self, signals: StopSignals) -> tuple[bool, bool]:
        """(whether any process got SIGTERM/SIGINT, whether a temporary checkpoint is due by
        process 0's clock). With several processes both are agreed on every step (one small
        all-gather), since the checkpoint they then write is collective."""
        minutes = self.cfg.checkpoint.every_minutes
        due = bool(minutes) and time.monotonic() - self.saved_at >= 60 * minutes
        received = signals.received is not None
        if jax.process_count() > 1:
            gathered = multihost_utils.process_allgather(np.int32([received, due]))
            received, due = bool(gathered[:, 0].any()), bool(gathered[0, 1])
        return received, due

    def _check_finite(self, step: int, step_metrics: dict) -> None:
        """Count a skipped (non-finite) step; stop after train.max_nonfinite_steps in a row."""
        if not int(jax.device_get(step_metrics["skipped"])):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        limit = self.cfg.train.max_nonfinite_steps
        if self.is_main:
            loss, norm = jax.device_get((step_metrics["loss"], step_metrics["grad_norm"]))
            logger.warning("step %d: non-finite loss %s or gradients (norm %s); update skipped "
                           "(%d in a row of at most %d, %d in all)", step, float(loss),
                           float(norm), self.skipped_in_a_row, limit, self.skipped_total)
        if self.skipped_in_a_row >= limit:
            raise NonFiniteStop(
                f"stopped at step {step}: {limit} consecutive steps had a non-finite loss or "
                f"gradients (train.max_nonfinite_steps={limit}); the last good state is "
                + (f"the checkpoint {self.checkpointer.directory / str(self.last_saved)}"
                   if self.last_saved else "the initial one (no checkpoint was saved)"))

    def _train_record(self, window: list[dict], elapsed: float, step: int) -> dict[str, Any]:
        """Scalars of the steps since the last log (losses and grad norms averaged)."""
        t = self.cfg.train
        step_time = elapsed / len(window)
        tokens_per_s = t.batch_size * t.seq_len / step_time
        mfu = (None if self.peak_flops is None else
               self.flops_per_token * tokens_per_s / (self.peak_flops * jax.device_count()))
        kept = [m for m in window if not m["skipped"]] or window  # NaN if all were skipped
        mix = {}
        if self.mixture is not None:  # the shares of the window's examples, by source
            counts = self.mixture.counts((step - len(window)) * t.batch_size, step * t.batch_size)
            mix = {f"mix/{name}": n / counts.sum() for name, n in zip(self.sources, counts)}
        return {"loss": float(np.mean([m["loss"] for m in kept])),
                "lr": float(window[-1]["lr"]), "routing_lr": float(window[-1]["routing_lr"]),
                "grad_norm": float(np.mean([m["grad_norm"] for m in kept])),
                "skipped": sum(int(m["skipped"]) for m in window),
                "tokens_per_s": tokens_per_s, "step_time_s": step_time, "mfu": mfu,
                "eta_s": (t.steps - step) * step_time,
                "tokens": step * t.batch_size * t.seq_len, **mix}

    def _abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.cfg.train.batch_size, self.cfg.train.seq_len)
        spec = jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding)
        return dict.fromkeys(batch_keys(self.cfg.data.packing), spec)

    def _finish(self, metrics_path: Path, checkpoint_step: int) -> dict[str, Any]:
        """Plots (process 0) and the paths a user looks for next."""
        paths = {"output_dir": str(self.out),
                 "checkpoint": str(self.checkpointer.directory / str(checkpoint_step)),
                 "metrics": str(metrics_path)}
        if not (self.is_main and self.cfg.train.plots):
            return paths
        plot_dir = self.out / "plots"
        plot_dir.mkdir(exist_ok=True)
        name = f"{self.model_cfg.residual} ({self.out.name})"
        paths["loss_plot"] = str(plots.plot_loss(metrics_lib.read_metrics(metrics_path),
                                                 plot_dir / "loss.png", name))
        if self.last_routing is not None:
            weights = [np.asarray(w) for w in self.last_routing["mean_weights"]]
            paths["routing_plot"] = str(plot_dir / "routing.png")
            plot_heatmap(heatmap_result(self.model_cfg, weights, self.out.name),
                         plot_dir / "routing.png")
        return paths


def summary_table(summary: dict[str, Any]) -> str:
    final = summary["final"]
    rows = [("steps", f"{summary['start_step']} -> {summary['steps']}")]
    if summary["first_loss"] is not None and final.get("loss") is not None:
        rows.append(("train loss", f"{summary['first_loss']:.4f} -> {final['loss']:.4f} "
                                   "(mean of the last logged window)"))
    if "val_loss" in final:
        rows.append(("validation", f"loss {final['val_loss']:.4f}, "
                                   f"perplexity {final['val_ppl']:.2f}"))
    if sources := metrics_lib.validated_sources(final):
        rows.append(("by source", ", ".join(f"{name} loss {final[f'val/{name}/loss']:.4f}"
                                            for name in sources)))
    if final.get("tokens_per_s") is not None:
        rows.append(("throughput", f"{final['tokens_per_s']:,.0f} tokens/s"))
    rows.append(("time", f"compile {summary['compile_s']:.1f} s, training "
                         f"{summary['train_s']:.1f} s"))
    for key in ("checkpoint", "metrics", "loss_plot", "routing_plot"):
        if key in summary:
            rows.append((key.replace("_", " "), summary[key]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["run summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run(cfg: RunConfig) -> dict[str, Any]:
    with Trainer(cfg) as trainer:
        return trainer.run()


def _compiled_memory(compiled) -> tuple[int, int] | None:
    """(memory_analysis's arguments + temporaries + outputs not aliased + code, bytes live at
    the peak) of a compiled step, per device; None where the backend reports neither."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if m is None:
        return None
    return metrics_lib.memory_total_bytes(m), getattr(m, "peak_memory_in_bytes", 0)


def device_peak_text(stats: dict | None, compiled: tuple[int, int] | None) -> str | None:
    """One log line: the device's peak bytes in use against the compiled step's two counts;
    None where the device keeps no statistics (CPUs)."""
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    text = f"device 0 peak memory in use {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
    if "bytes_limit" in stats:
        text += f" of {stats['bytes_limit'] / 2**30:.2f}"
    if compiled is not None:
        text += (f" (the compiled step: {compiled[0] / 2**30:.2f} GiB by memory_analysis, "
                 f"{compiled[1] / 2**30:.2f} live at the peak)")
    return text
