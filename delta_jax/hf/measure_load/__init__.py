"""Measure peak host memory and time of load_pretrained on a random checkpoint: measure().

measure writes a random tied checkpoint (numpy, one tensor at a time), loads it in a fresh
subprocess (`python -m delta_jax.hf.measure_load --child FOLDER`, which prints load_and_measure's
JSON line) and returns peak resident memory (VmHWM) before and after the load, the loaded model's
size and the load time. The file was just written, so it is read from the page cache: the time
excludes disk speed. The command line is in __main__.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from delta_jax.config import ModelConfig
from delta_jax.hf.keymap import config_to_hf
from delta_jax.hf.load import CONFIG, WEIGHTS
from delta_jax.hf.safetensors_io import write_file
from delta_jax.hf.save import tensor_layout


def write_random_checkpoint(cfg: ModelConfig, folder: Path, dtype: str, seed: int = 0) -> None:
    """A Hugging Face folder with N(0, 0.02) kernels and unit norms, stored in `dtype`."""
    rng = np.random.default_rng(seed)
    layout = tensor_layout(cfg, dtype)

    def tensors():
        for info in layout:
            if info.name.endswith("norm.weight"):
                array = np.ones(info.shape, np.float32)
            else:
                array = rng.standard_normal(info.shape, np.float32) * np.float32(0.02)
            yield info.name, array.astype(info.dtype)

    folder.mkdir(parents=True, exist_ok=True)
    write_file(folder / WEIGHTS, layout, tensors(), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps({**config_to_hf(cfg), "dtype": dtype}))


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux VmHWM). Not ru_maxrss: after fork + exec it
    still reports the parent's peak, here the checkpoint generator's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line (Linux only)")


def load_and_measure(folder: Path) -> dict:
    """Load `folder` in this process: its peak memory before and after, model size and time."""
    import jax

    from delta_jax import count_params
    from delta_jax.hf.load import load_pretrained

    jax.devices()  # the runtime starts outside the measured load
    before = _peak_rss_bytes()
    start = time.perf_counter()
    model = load_pretrained(folder)
    jax.block_until_ready(jax.tree.leaves(model))
    seconds = time.perf_counter() - start
    model_bytes = count_params(model.config) * jnp.dtype(model.config.param_dtype).itemsize
    return {"peak_rss_before": before, "peak_rss_after": _peak_rss_bytes(),
            "model_bytes": model_bytes, "load_seconds": round(seconds, 2)}


def measure(cfg: ModelConfig, stored_dtype: str, folder: Path) -> dict:
    """load_and_measure of a random `cfg` checkpoint stored in `stored_dtype` at `folder`, in a
    fresh process, plus the file's size."""
    write_random_checkpoint(cfg, folder, stored_dtype)
    file_bytes = (folder / WEIGHTS).stat().st_size
    done = subprocess.run([sys.executable, "-m", "delta_jax.hf.measure_load", "--child",
                           str(folder)], check=True, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(file_bytes=file_bytes, stored_dtype=stored_dtype)
    return result
