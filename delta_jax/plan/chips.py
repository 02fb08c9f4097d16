"""TPU chips and NVIDIA GPUs: memory and peak bf16 FLOP/s per chip (and memory bandwidth for
the GPUs, whose step is estimated by a roofline: compile.py).

Public figures (cloud.google.com/tpu/docs/<version>, "key specifications"): v2 16 GiB and
45 TFLOP/s; v3 32 GiB, 123; v4 32 GiB, 275; v5e 16 GB, 197; v5p 95 GB, 459; v6e (Trillium)
32 GB, 918. Dense bf16, no sparsity. The pages write GB for the newer chips; the capacities
are GiB, which is what is used here: the compiler gives one program more than the GB reading
(v5e 15.75 GiB against 16 GB = 14.9 GiB, v6e 31.25 against 29.8). v5p's 95 is a rounded figure
in either unit: libtpu 0.0.42.1 gives one program 95.74 GiB (its refusals name "95.74G" of hbm,
and its compile log sets the rematerialization limit at "95% hbm (90.96G)"), so the chip holds
more than 95 GiB; how much more no compile-only device says.

What the TPU compiler lets one program hold is less than a chip's HBM (v5e: 15.75 of its 16
GiB; v6e 31.25 of 32; v4 15.25 of a TensorCore's 16), and more than v5p's rounded 95: the
planner reads that limit from the compiler (topology.compiler_limit), prints it beside the
spec's figure and judges by it, falling back to these figures only where the compiler names
none.

A chip may show up as several devices (v2, v3 and v4 topologies have one device per TensorCore,
two per chip; v5p and v6e one per chip): per-device figures divide by that count.

GPUs: the memory is what the device reports to programs (cudaDeviceProp.totalGlobalMem, the
device_memory_size of XLA's target specs in delta_jax/plan/gpu_specs/): 84,942,979,072 bytes
(79.11 GiB) for the H100 SXM 80GB, 151,397,597,184 (141.0 GiB) for the H200 141GB. The GPU
compiler accepts a program of any size, so the planner judges the fit against these. Peak dense
bf16 989 TFLOP/s for both, HBM 3.35 TB/s (H100 SXM) and 4.8 TB/s (H200): NVIDIA's H100 and
H200 datasheets (the SXM figures without sparsity). A GPU topology is NODESxGPUS_PER_NODE.
"""
from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # the topology name's prefix: "v5p" in "v5p:4x4x4"
    hbm_bytes: int  # per chip
    peak_flops: float  # dense bf16 FLOP/s per chip
    ndims: int  # dimensions of its slice shapes: 3 (v4, v5p: "2x2x1"), 2 (v5e, v6e: "4x4")
    memory_bandwidth: float | None = None  # bytes/s per chip, for the GPUs' roofline
    gpu_spec: str | None = None  # a GPU's XLA target config, a file in gpu_specs/; None: a TPU


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v2", 16 * GiB, 45e12, 2),
    Chip("v3", 32 * GiB, 123e12, 2),
    Chip("v4", 32 * GiB, 275e12, 3),
    Chip("v5e", 16 * GiB, 197e12, 2),
    Chip("v5p", 95 * GiB, 459e12, 3),
    Chip("v6e", 32 * GiB, 918e12, 2),
    Chip("h100", 84_942_979_072, 989e12, 2, memory_bandwidth=3.35e12, gpu_spec="h100_sxm.txtpb"),
    Chip("h200", 151_397_597_184, 989e12, 2, memory_bandwidth=4.8e12, gpu_spec="h200.txtpb"),
)}

# Single-slice shapes, smallest first (Google's tables of supported slices; v5e and v6e also
# come as 1x1, 2x2 and 2x4 hosts); GPUs by nodes of 8. Used by the "what fits where" search.
SLICES: dict[str, tuple[str, ...]] = {
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "h100": ("1x8", "2x8", "4x8", "8x8", "16x8", "32x8"),
    "h200": ("1x8", "2x8", "4x8", "8x8", "16x8", "32x8"),
}


def chip(name: str) -> Chip:
    """The Chip named `name` ("v5p"), or a ValueError listing the known ones."""
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}: expected one of {', '.join(CHIPS)}")
    return CHIPS[name]
