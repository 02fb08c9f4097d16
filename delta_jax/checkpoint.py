"""The Orbax checkpoint layout shared by the trainer and the converter.

A checkpoint directory is managed by an orbax CheckpointManager; each step directory holds
  params        the model's nnx.Param state as a pure nested dict (StandardSave)
  model_config  the ModelConfig fields (JsonSave)
and, for training runs, further items the trainer adds (optimizer state, data iterator, ...).
The converter writes a one-step directory (step 0) that the trainer can fine-tune from.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from delta_jax.config import ModelConfig, current_fields
from delta_jax.model.causal_lm import CausalLM, abstract_model
from delta_jax.sharding import placement, state_shardings

logger = logging.getLogger(__name__)

PARAMS = "params"
MODEL_CONFIG = "model_config"
# Tokenizer files kept beside the step directories (hf_to_orbax copies a folder's there).
TOKENIZER_DIR = "tokenizer"


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """cfg's fields, the attention kernel as "auto": an explicit kernel (cudnn, splash) is the
    saving run's platform's, and would not load on another (config_from_json)."""
    return {**dataclasses.asdict(cfg), "attention": "auto"}


def config_from_json(fields: dict[str, Any], *, source: str) -> ModelConfig:
    """The ModelConfig a checkpoint's model_config holds, in today's fields, with the attention
    kernel "auto" whatever it names (checkpoints written before config_to_json dropped it may
    name cudnn or splash); a caller that wants another passes it as an override."""
    fields = {**current_fields(fields, source), "attention": "auto"}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source}: unknown model_config field(s) {unknown}")
    return ModelConfig(**fields)


# What read_only=True implies; given explicitly, Orbax does not warn that it set them itself.
_READ_ONLY_IMPLIES = {"create": False, "save_interval_steps": 0, "cleanup_tmp_directories": False}


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's WARNING that a read-only manager's directory is read only: the reader asked
    for exactly that, and every checkpoint read printed it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only=")


def manager(directory: str | Path, **options: Any) -> ocp.CheckpointManager:
    if options.get("read_only"):
        options = {**_READ_ONLY_IMPLIES, **options}
    notice = _ReadOnlyNotice()
    orbax_log = logging.getLogger("absl")  # Orbax logs through absl
    orbax_log.addFilter(notice)
    try:
        return ocp.CheckpointManager(Path(directory).absolute(),
                                     options=ocp.CheckpointManagerOptions(**options))
    finally:
        orbax_log.removeFilter(notice)


def save_checkpoint(model: CausalLM, directory: str | Path, step: int = 0) -> Path:
    """Write a model-only checkpoint (params + model_config) at `step`; blocks until done."""
    params = nnx.state(model, nnx.Param).to_pure_dict()
    with manager(directory, enable_async_checkpointing=False) as mgr:
        mgr.save(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(params),
            MODEL_CONFIG: ocp.args.JsonSave(config_to_json(model.config))}))
        mgr.wait_until_finished()
    return Path(directory) / str(step)


def load_checkpoint_config(directory: str | Path, step: int | None = None) -> ModelConfig:
    with manager(directory, read_only=True) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{directory}: no checkpoint step found")
        fields = mgr.restore(step, args=ocp.args.Composite(
            **{MODEL_CONFIG: ocp.args.JsonRestore()}))[MODEL_CONFIG]
    return config_from_json(fields, source=f"{directory}/{step}/{MODEL_CONFIG}")


def load_checkpoint(directory: str | Path, step: int | None = None, *, mesh=None,
                    **config_overrides: Any) -> CausalLM:
    """Load params + model_config of `step` (default: the latest) into a CausalLM.

    With a mesh, every parameter is restored directly onto its sharding; without, onto this
    process's first device, whatever devices (or hosts) saved it. Overrides may change
    only runtime fields (dtype, remat, layer_driver, ...), not the architecture.
    """
    cfg = load_checkpoint_config(directory, step)
    cfg = cfg.replace(**config_overrides) if config_overrides else cfg
    graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    if mesh is not None:
        shardings = state_shardings(params, mesh)
        target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                              params.to_pure_dict(), shardings.to_pure_dict())
    else:  # one device: an explicit sharding, or Orbax insists on the devices that saved
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device),
                              params.to_pure_dict())
    with manager(directory, read_only=True) as mgr:
        step = mgr.latest_step() if step is None else step
        restored = mgr.restore(step, args=ocp.args.Composite(
            **{PARAMS: ocp.args.StandardRestore(target)}))[PARAMS]
    params.replace_by_pure_dict(restored)
    if mesh is not None:
        logger.info("%s", placement(params, mesh))
    return nnx.merge(graphdef, params, rest)
