"""NVIDIA GPUs without a GPU: jax's CUDA plugin compiles for an H100 or H200 that XLA's target
config describes (gpu_specs/), on a CPU-only host with no driver.

The plugin, ptxas and cuDNN (requirements-gpu-compiler.txt, about 1.7 GB) are an optional
install kept out of the project's venv, in a folder of their own that only the planner puts on
its path (`make gpu-compiler`; INSTALL). DELTA_JAX_GPU_COMPILER names another folder. The
planner runs with JAX_PLATFORMS=cpu: the plugin describes the GPUs and compiles for them, and no
CUDA backend ever starts; the trainer and the other commands never see the folder. The planner
puts the folder on its path when it resolves a GPU topology, after jax started; the processes it
compiles in (plan/isolated.py) start with it on their path, which cuDNN attention needs (jax
looks for cuDNN when it is imported).

What the GPU compiler does not tell, and how the planner makes up for it:
- it accepts a program of any size: the fit is judged against the device's memory (chips.py);
- compiled.cost_analysis() is None: the flops and bytes come from XLA's HloCostAnalysis over
  the optimized module (hlo_cost);
- that analysis counts no flops for a custom call: cuDNN's fused attention (model.attention=
  cudnn) is counted by formula for each call in the program (plan/kernel_flops.py);
- nothing is autotuned without a device (XLA's default kernels and tiles are compiled).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import jax

from delta_jax.plan.chips import Chip

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".gpu-compiler"
INSTALL = ("make gpu-compiler (pip install --no-deps --target .gpu-compiler "
           "-r requirements-gpu-compiler.txt)")
SPECS = Path(__file__).with_name("gpu_specs")
# What the compile needs from the install: the plugin, ptxas to assemble its PTX, and cuDNN
# (for model.attention=cudnn).
_NEEDED = ("jax_plugins/xla_cuda12/xla_cuda_plugin.so", "nvidia/cuda_nvcc/bin/ptxas",
           "nvidia/cudnn/lib/libcudnn.so.9")


class MissingCompiler(ValueError):
    """The GPU compiler's folder lacks the plugin or ptxas."""


def compiler_dir() -> Path:
    """Where the GPU compiler is installed: $DELTA_JAX_GPU_COMPILER, else .gpu-compiler/ at the
    repository's root."""
    return Path(os.environ.get("DELTA_JAX_GPU_COMPILER") or DEFAULT_DIR)


def require_compiler() -> Path:
    """compiler_dir(), or MissingCompiler (one line) naming the command that installs it."""
    folder = compiler_dir()
    missing = [part for part in _NEEDED if not (folder / part).is_file()]
    if missing:
        raise MissingCompiler(f"compiling for a GPU topology needs jax's CUDA plugin and ptxas "
                              f"in {folder}, which lacks {missing[0]}: install them with "
                              f"{INSTALL}")
    return folder


def compile_only_devices(chip: Chip, nodes: int, gpus_per_node: int) -> list:
    """nodes x gpus_per_node compile-only devices of `chip` (a GPU), one host a node: jax's
    topology "1 x nodes x gpus_per_node" (partitions x hosts x GPUs a host)."""
    folder = str(require_compiler())
    if jax.config.jax_platforms != "cpu":
        raise ValueError(f"compiling for a GPU topology needs JAX_PLATFORMS=cpu set before jax "
                         f"starts (it is {jax.config.jax_platforms!r}): the CUDA plugin is "
                         "loaded to compile, never to run")
    if folder not in sys.path:
        sys.path.append(folder)  # after the venv's own packages: it only adds the plugin
    from jax.experimental import topologies

    def describe():
        return topologies.get_topology_desc(
            platform="cuda", target_config=(SPECS / chip.gpu_spec).read_text(),
            topology=f"1x{nodes}x{gpus_per_node}").devices

    try:
        return describe()
    except NotImplementedError:  # jax had looked for plugins before the folder was on the path
        import jax_plugins.xla_cuda12 as cuda_plugin

        cuda_plugin.initialize()
        return describe()


def hlo_cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled GPU program: XLA's HloCostAnalysis over its
    optimized module, run by the CPU client (the GPU's cost_analysis() is None)."""
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def roofline_s(flops: float, bytes_accessed: float, chip: Chip) -> float:
    """The step time if it ran at the device's peak flops or its memory bandwidth, whichever
    binds: max(flops / peak, bytes / bandwidth), per device."""
    return max(flops / chip.peak_flops, bytes_accessed / chip.memory_bandwidth)
