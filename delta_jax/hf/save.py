"""Save a delta_jax model as a Hugging Face folder, atomically and one tensor at a time.

The baseline is written as model_type qwen3 (transformers' Qwen3ForCausalLM loads it); routing
variants as the reference implementation's qwen3_attnres with its key names (keymap.py). The
folder is built beside the target under a temporary name and renamed into place once complete,
so an interrupted save leaves the previous folder (or none), never a half-written model.
From a multi-process run (a model sharded over hosts) every process takes part in gathering each
tensor and process 0 alone writes.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from delta_jax.config import ModelConfig
from delta_jax.data.tokenizers import HFTokenizer, write_byte_tokenizer
from delta_jax.hf.keymap import (
    ConversionError,
    active_rules,
    config_to_hf,
    gate_type,
    hf_names,
    hf_shape,
)
from delta_jax.hf.load import CONFIG, INDEX, TOKENIZER_FILES, WEIGHTS, dtype_name
from delta_jax.hf.safetensors_io import TensorInfo, write_file
from delta_jax.hf.state_dict import iter_hf_tensors
from delta_jax.model.causal_lm import CausalLM, abstract_model

logger = logging.getLogger(__name__)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as '5GB' or '500MiB' (transformers' convention)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", size.upper())
    if not match:
        raise ConversionError(f"max_shard_size={size!r} is not a size: expected e.g. '5GB', "
                              "'500MB' or '2GiB'")
    return int(float(match[1]) * _UNITS[match[2]])


def tensor_layout(cfg: ModelConfig, dtype: str) -> list[TensorInfo]:
    """Every HF tensor of `cfg` with its shape, in the order iter_hf_tensors yields them."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    layout = []
    for rule in active_rules(cfg):
        shape = state
        for part in rule.ours:
            shape = shape[part]
        ours = tuple(shape.shape[1:] if rule.per_layer else shape.shape)
        theirs = hf_shape(rule, cfg, ours)
        layout += [TensorInfo(name, jnp.dtype(dtype), theirs) for name in hf_names(rule, cfg)]
    return layout


def _shards(layout: list[TensorInfo], limit: int) -> list[list[TensorInfo]]:
    """Consecutive groups of at most `limit` bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in layout:
        if shards[-1] and size + info.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def _check_mapped(model: CausalLM) -> None:
    mapped = {rule.ours for rule in active_rules(model.config)}
    for path, _ in nnx.state(model, nnx.Param).flat_state():
        if tuple(path) not in mapped:
            raise ConversionError(f"parameter {'.'.join(path)} has no Hugging Face key, so this "
                                  f"model (residual={model.config.residual!r}) cannot be saved "
                                  "in the Hugging Face layout")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_replaceable(target: Path) -> None:
    if target.exists() and not (target.is_dir() and ((target / CONFIG).is_file()
                                                     or not any(target.iterdir()))):
        raise ConversionError(f"{target}: exists and is not a model folder; refusing to replace "
                              "it")


@contextlib.contextmanager
def _atomic_folder(target: Path) -> Iterator[Path]:
    """Yield a fresh folder beside `target`; on success it replaces `target` by renames."""
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = target.parent / f".{target.name}.tmp-{tag}"
    staging.mkdir()
    try:
        yield staging
        for path in staging.iterdir():
            _fsync(path)
        _fsync(staging)
        if target.exists():
            retired = target.parent / f".{target.name}.old-{tag}"
            os.rename(target, retired)
            os.rename(staging, target)
            shutil.rmtree(retired)
        else:
            os.rename(staging, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_pretrained(model: CausalLM, path: str | Path, *, dtype=None,
                    tokenizer: str | Path | None = None,
                    max_shard_size: int | str = "5GB", progress: bool = False) -> Path:
    """Write `model` as a Hugging Face folder at `path` (replacing a model folder already there).

    dtype: storage dtype of the tensors (default: the model's param dtype).
    tokenizer: written beside the weights: a folder whose tokenizer files (TOKENIZER_FILES) are
      copied, a tokenizer.json (with the tokenizer_config.json beside it), or "byte" (written
      as a tokenizer.json). config.json's bos/eos ids are Qwen3's where the vocabulary holds
      them, else the tokenizer's EOS, else null: never an id the embedding lacks.
    max_shard_size: above it the weights are split into shards with an index, as transformers.
    Returns the folder. Every process of a multi-process run calls this (the tensors are gathered
    from all of them, one at a time); process 0 writes, and all return once the folder is there.
    """
    cfg = model.config
    _check_mapped(model)
    if cfg.carries_stream:
        logger.warning("%s: gate_base='stream' is delta_jax's own gate (attnres_gate_type %r): "
                    "delta_jax.load_pretrained reads the folder; the reference code would run "
                    "it without its gates", path, gate_type(cfg))
    dtype = dtype_name(dtype or cfg.param_dtype)
    layout = tensor_layout(cfg, dtype)
    shards = _shards(layout, parse_size(max_shard_size))
    hf_config = {**config_to_hf(cfg), "dtype": dtype}
    target = Path(path)
    _check_replaceable(target)  # on every process, so that none starts gathering alone
    if jax.process_index() == 0:
        _write_folder(model, target, dtype, layout, shards, hf_config, tokenizer, progress)
    else:
        for _ in iter_hf_tensors(model, jnp.dtype(dtype)):  # take part in each gather
            pass
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"save_pretrained {target}")
    return target


def _write_folder(model: CausalLM, target: Path, dtype: str, layout: list[TensorInfo],
                  shards: list[list[TensorInfo]], hf_config: dict, tokenizer, progress: bool
                  ) -> None:
    with _atomic_folder(target) as staging, \
            tqdm(total=len(layout), desc=f"saving {target.name}", unit="tensor",
                 disable=not progress) as bar:
        def counted():
            for name, array in iter_hf_tensors(model, jnp.dtype(dtype)):
                bar.update()
                yield name, array

        tensors = counted()  # one stream, drawn across the shards in layout order
        metadata = {"format": "pt"}  # transformers expects the torch convention marker
        if len(shards) == 1:
            write_file(staging / WEIGHTS, layout, tensors, metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                write_file(staging / name, shard, tensors, metadata=metadata)
                weight_map.update({info.name: name for info in shard})
            index = {"metadata": {"total_size": sum(info.nbytes for info in layout)},
                     "weight_map": weight_map}
            (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        eos_id = _write_tokenizer(tokenizer, staging)
        hf_config = {**hf_config, **_token_ids(hf_config, model.config.vocab_size, eos_id)}
        (staging / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")


def _write_tokenizer(tokenizer: str | Path | None, folder: Path) -> int | None:
    """Write `tokenizer` (see save_pretrained) into `folder`; its EOS id, None if none written."""
    if tokenizer == "byte":
        write_byte_tokenizer(folder)
    elif tokenizer == "qwen3":
        logger.warning("no tokenizer written: the built-in qwen3 tokenizer has no "
                       "tokenizer.json; copy one from a Qwen3 model folder")
    elif tokenizer is not None:
        source = Path(tokenizer)
        if source.is_file():  # a tokenizer.json, maybe named otherwise
            shutil.copyfile(source, folder / "tokenizer.json")
            source = source.parent
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (folder / name).exists():
                shutil.copyfile(source / name, folder / name)
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        return HFTokenizer(folder).eos_id
    except ValueError:  # a tokenizer that names no EOS: the ids stay Qwen3's or null
        return None


def _token_ids(hf_config: dict, vocab_size: int, eos_id: int | None) -> dict[str, int | None]:
    """bos/eos ids that exist in the vocabulary: Qwen3's own where it holds them, else the
    tokenizer's EOS where it does, else None."""
    fallback = eos_id if eos_id is not None and eos_id < vocab_size else None
    return {key: hf_config[key] if hf_config[key] < vocab_size else fallback
            for key in ("bos_token_id", "eos_token_id")}
