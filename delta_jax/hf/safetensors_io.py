"""Safetensors files, read and written one tensor at a time.

The format: an 8-byte little-endian header length n, n bytes of JSON mapping each tensor name to
{dtype, shape, data_offsets: [begin, end]} (offsets counted from the end of the header) plus an
optional "__metadata__" dict, then the tensor bytes. We parse it ourselves rather than through
`safetensors.safe_open` for three reasons: bfloat16 arrives as an ml_dtypes array without a deep
learning framework; a tensor is read into a fresh buffer with one positioned read instead of
through a memory map, whose touched pages would stay resident until the whole file is unmapped;
and writing streams too (the header is computed from shapes first), so neither direction ever
holds more than one tensor of the file on the host.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from delta_jax.hf.keymap import ConversionError

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F16": np.dtype(np.float16)}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 8  # the header is padded with spaces so that tensor data starts 8-byte aligned


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a file's header against its size; nothing else is read."""
    size = path.stat().st_size

    def corrupt(why: str) -> ConversionError:
        return ConversionError(f"{path}: not a valid safetensors file: {why}")

    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise corrupt(f"header length {length} exceeds the file size {size} (truncated?)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise corrupt(f"header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    data_start = 8 + length
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(n) for n in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"entry of tensor {name} is malformed: {entry!r}") from None
        if dtype_name not in DTYPES:
            raise ConversionError(f"{path}: tensor {name} has dtype {dtype_name}, which is not "
                                  f"supported: expected one of {', '.join(DTYPES)}")
        info = TensorInfo(name, DTYPES[dtype_name], shape, data_start + begin)
        if min(shape, default=0) < 0 or begin < 0 or end - begin != info.nbytes:
            raise corrupt(f"tensor {name} spans bytes [{begin}, {end}) but dtype {dtype_name} "
                          f"and shape {list(shape)} need {info.nbytes}")
        if data_start + end > size:
            raise corrupt(f"tensor {name} ends at byte {data_start + end} but the file has "
                          f"{size} bytes (truncated?)")
        infos[name] = info
    return infos


def read_tensor(path: Path, info: TensorInfo) -> np.ndarray:
    """One tensor as a fresh numpy array of its stored dtype and shape."""
    out = np.empty(info.shape, info.dtype)
    with open(path, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(out.reshape(-1).view(np.uint8))
    if got != info.nbytes:
        raise ConversionError(f"{path}: tensor {info.name} is truncated: read {got} of "
                              f"{info.nbytes} bytes")
    return out


def write_file(path: Path, specs: Sequence[TensorInfo],
               tensors: Iterable[tuple[str, np.ndarray]], *,
               metadata: Mapping[str, str] | None = None) -> None:
    """Write (name, array) pairs, one per spec in the same order, as one safetensors file.

    `tensors` may be a generator shared by several files: each array is written and dropped
    before the next is drawn. The file is fsynced before returning.
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [position, position + spec.nbytes]}
        position += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % _ALIGN)
    tensors = iter(tensors)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for spec in specs:
            name, array = next(tensors)
            if (name, array.shape, array.dtype) != (spec.name, spec.shape, spec.dtype):
                raise ValueError(f"{path}: got tensor {name} {array.dtype}{list(array.shape)} "
                                 f"where {spec.name} {spec.dtype}{list(spec.shape)} was planned")
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        f.flush()
        os.fsync(f.fileno())
