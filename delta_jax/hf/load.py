"""Load a Hugging Face model folder into a delta_jax model, streaming one tensor at a time.

A folder holds config.json (model_type qwen3 or the reference's qwen3_attnres) and either
model.safetensors or shards model-0000i-of-0000n.safetensors listed in
model.safetensors.index.json; tensors stored in float32, bfloat16 or float16. Every header is
validated before the first tensor is read, so a truncated or inconsistent folder fails at once.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from delta_jax.config import DTYPES
from delta_jax.hf.keymap import ConversionError
from delta_jax.hf.safetensors_io import TensorInfo, read_header, read_tensor
from delta_jax.hf.state_dict import build_model
from delta_jax.model.causal_lm import CausalLM

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Carried along with the weights by the converter: the tokenizer and generation settings.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json")


def read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ConversionError(f"{folder}: not a folder (expected a Hugging Face model folder "
                              f"with {CONFIG} and safetensors weights)")
    path = folder / CONFIG
    if not path.is_file():
        raise ConversionError(f"{folder}: no {CONFIG} (expected a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return config


class SafetensorsFolder(Mapping[str, np.ndarray]):
    """The tensors of a model folder by name; each lookup reads that tensor from disk.

    `on_read(name)` is called after each read (a progress bar).
    """

    def __init__(self, folder: Path, on_read: Callable[[str], None] | None = None):
        self.folder = folder
        self.on_read = on_read
        self._where: dict[str, tuple[Path, TensorInfo]] = {}
        if (folder / INDEX).is_file():
            self._open_shards(folder / INDEX)
        elif (folder / WEIGHTS).is_file():
            for name, info in read_header(folder / WEIGHTS).items():
                self._where[name] = (folder / WEIGHTS, info)
        else:
            pickles = sorted(p.name for p in folder.glob("*.bin"))
            if pickles:
                raise ConversionError(
                    f"{folder}: holds only PyTorch pickle weights ({', '.join(pickles)}), which "
                    "are not read because unpickling can run arbitrary code; convert them to "
                    "safetensors first, e.g. `transformers.AutoModelForCausalLM.from_pretrained("
                    "FOLDER).save_pretrained(NEW_FOLDER)` in a trusted environment")
            raise ConversionError(f"{folder}: no {WEIGHTS} or {INDEX}")

    def _open_shards(self, index_path: Path) -> None:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise ConversionError(f"{index_path}: not a safetensors index (expected JSON with a "
                                  "'weight_map' object)") from None
        for shard in sorted(set(weight_map.values())):
            path = self.folder / shard
            if not path.is_file():
                raise ConversionError(f"{index_path}: names shard {shard}, which is missing from "
                                      f"{self.folder}")
            for name, info in read_header(path).items():
                if weight_map.get(name) != shard:
                    raise ConversionError(f"{path}: holds tensor {name}, which {INDEX} maps to "
                                          f"{weight_map.get(name)!r}")
                self._where[name] = (path, info)
        absent = sorted(set(weight_map) - set(self._where))
        if absent:
            raise ConversionError(f"{index_path}: maps tensor {absent[0]} to shard "
                                  f"{weight_map[absent[0]]}, which does not hold it")

    def __getitem__(self, name: str) -> np.ndarray:
        path, info = self._where[name]
        array = read_tensor(path, info)
        if self.on_read is not None:
            self.on_read(name)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16' or 'float16' from a name or dtype; anything else is an error."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not supported: expected one of "
                              f"{', '.join(DTYPES)}")
    return name


def load_pretrained(path: str | Path, *, dtype=None, mesh: Mesh | None = None,
                    preserve_function: bool = False, progress: bool = False,
                    **overrides: Any) -> CausalLM:
    """A Hugging Face model folder -> CausalLM; `model(input_ids [B,T])` gives logits [B,T,V].

    dtype: parameter and compute dtype of the model (float32 by default, whatever the stored
      dtype; pass param_dtype= as well for float32 master weights with bfloat16 compute).
    mesh: every parameter is placed directly on its sharding of this mesh.
    overrides: ModelConfig fields. On a plain Qwen3 checkpoint, residual=... (and num_blocks,
      router_init, null_source, routing_gate, gate_base, block_sources) converts it into that
      variant; preserve_function=True picks the initialisation (and for block/full the stream
      gate) under which the converted model computes the original function bit for bit at
      step 0 (state_dict.plan_conversion explains how).
    progress: a progress bar over tensors on stderr.
    Raises ConversionError naming the file, tensor or field on any bad input.
    """
    folder = Path(path)
    hf_config = read_config(folder)
    if dtype is not None:
        name = dtype_name(dtype)
        overrides = {"param_dtype": name, **overrides, "dtype": name}
    tensors = SafetensorsFolder(folder)
    # The bar appears with the first tensor read, after the config and key checks, and clears
    # itself on close, so that an error is the last and only line printed.
    bar = None
    seen: set[str] = set()

    def tick(name: str) -> None:
        nonlocal bar
        if progress and name not in seen:
            seen.add(name)
            bar = bar or tqdm(total=len(tensors), desc=f"loading {folder.name}",
                              unit="tensor", leave=False)
            bar.update()

    tensors.on_read = tick
    try:
        return build_model(hf_config, tensors, source=str(folder), mesh=mesh,
                           preserve_function=preserve_function, **overrides)
    finally:
        if bar is not None:
            bar.close()
