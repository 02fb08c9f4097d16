"""Named device sets to compile for: a TPU slice or GPU nodes described by name (no TPU or GPU
attached), or CPUs.

    "v5p:4x4x4"   a v5p slice of 4x4x4 chips (libtpu compiles for it on any host)
    "v5e:4x4"     v5e and v6e slices are two-dimensional
    "h100:2x8"    2 nodes of 8 H100 SXM GPUs (jax's CUDA plugin compiles for them: gpus.py)
    "cpu:8"       8 CPU devices of this process (fake ones: --xla_force_host_platform_device_count)

Several slices (`num_slices` > 1) are joined over DCN, as in Multislice training; the mesh's
`data` axis then spans the slices (jax's get_topology_desc(num_slices=...) gives each device a
slice_index).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import re

import jax
import jax.numpy as jnp

from delta_jax.plan import gpus
from delta_jax.plan.chips import CHIPS, Chip
from delta_jax.plan.chips import chip as chip_named

GiB = 2**30


class PlanError(ValueError):
    """Bad input to the planner: reported as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as given: "v5p:4x4x4", "h100:2x8", "cpu:8"
    devices: tuple  # jax Devices (compile-only ones for TPU and GPU), len = D
    chip: Chip | None  # None for CPUs
    num_slices: int = 1

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def is_gpu(self) -> bool:
        return self.chip is not None and self.chip.gpu_spec is not None

    @property
    def devices_per_chip(self) -> int:
        if self.chip is None or self.is_gpu:
            return 1
        chips = {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in self.devices}
        return self.num_devices // len(chips)

    @functools.cached_property
    def compiler_hbm_per_device(self) -> int | None:
        """What the TPU compiler lets one program hold per device, by its own message
        (compiler_limit): v5e 15.75 of its 16 GiB; v5p 95.74, more than its spec's rounded 95
        (chips.py). Read when first asked, not by every process that only compiles. None for
        CPUs and GPUs (the GPU compiler accepts a program of any size), or where no message
        says it."""
        return None if self.chip is None or self.is_gpu else compiler_limit(self.devices[0])

    @property
    def chip_hbm_per_device(self) -> int | None:
        """The chip's HBM (chips.py) over its devices."""
        return None if self.chip is None else self.chip.hbm_bytes // self.devices_per_chip

    @property
    def hbm_per_device(self) -> int | None:
        """What a step is judged against: the compiler's limit where it was read, else the
        chip's HBM."""
        return self.compiler_hbm_per_device or self.chip_hbm_per_device

    @property
    def peak_flops_per_device(self) -> float | None:
        return None if self.chip is None else self.chip.peak_flops / self.devices_per_chip

    def describe(self) -> str:
        """"v5p:4x4x4 (64 x TPU v5)"-style summary."""
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.name}{slices} ({self.num_devices} x {self.devices[0].device_kind})"

    def memory(self) -> str:
        """A device's memory figures, each named for what it is: the chip's HBM by its spec
        (chips.py), and the compiler's limit for one program where libtpu named one; a GPU's
        memory as the device reports it. "" for CPUs."""
        if self.is_gpu:
            return (f"memory {self.chip_hbm_per_device / GiB:.2f} GiB as the GPU reports it "
                    "(XLA's device spec); the GPU compiler has no limit of its own. jax "
                    "preallocates 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says more")
        if self.chip is None:
            return ""
        spec = f"HBM {self.chip_hbm_per_device / GiB:g} GiB by the chip's spec"
        limit = self.compiler_hbm_per_device
        if limit is None:
            return spec
        aside = ("the runtime keeps the rest" if limit <= self.chip_hbm_per_device
                 else "more than the spec's figure, which is rounded down")
        return (f"{spec}; the compiler's limit for a program {limit / GiB:.2f} GiB (libtpu's "
                f"figure; {aside})")

    def judged_against(self) -> str:
        """Which of memory()'s figures a step's fit is judged against (hbm_per_device)."""
        if self.hbm_per_device is None:
            return "nothing: no memory figure for a CPU (--hbm-gib gives one)"
        what = ("the compiler's limit" if self.compiler_hbm_per_device
                else "the GPU's memory" if self.is_gpu else "the chip's HBM")
        return f"{what}, {self.hbm_per_device / GiB:.2f} GiB"

TPUS = [name for name, c in CHIPS.items() if c.gpu_spec is None]
GPUS = [name for name, c in CHIPS.items() if c.gpu_spec is not None]
VALID = ("cpu:N, a TPU slice <chip>:<shape> with chip one of " + ", ".join(TPUS)
         + " (e.g. v5p:2x2x1, v5p:4x4x4, v5e:4x4, v6e:2x4), or GPU nodes <gpu>:<nodes>x<gpus "
         "per node> with gpu one of " + ", ".join(GPUS) + " (e.g. h100:1x8, h200:2x8)")
_TPU_NAME = re.compile(r"^(?P<chip>[a-z0-9]+):(?P<shape>\d+(x\d+){1,2})$")
LIBTPU_HINT = ('compiling for a TPU topology needs libtpu, which is not installed here: '
               f'pip install "jax[tpu]=={jax.__version__}" (CPU hosts included; no TPU needed)')


def resolve(name: str, num_slices: int = 1) -> Topology:
    """The Topology called `name`; PlanError (one line) for a bad name or a missing libtpu."""
    if num_slices < 1:
        raise PlanError(f"--num-slices={num_slices} is invalid: expected an integer >= 1")
    if name.startswith("cpu:"):
        if num_slices != 1:
            raise PlanError(f"--num-slices={num_slices} is invalid with {name}: "
                            "multi-slice needs a TPU topology")
        return _cpu(name)
    match = _TPU_NAME.match(name)
    if match is None or match["chip"] not in CHIPS:
        raise PlanError(f"--topology {name!r} is not a known topology: expected {VALID}")
    chip = chip_named(match["chip"])
    if chip.gpu_spec is not None:
        return _gpu(name, chip, num_slices)
    return _tpu(name, chip, num_slices)


def _forced_cpu_devices() -> int:
    """The CPU device count XLA_FLAGS forces (--xla_force_host_platform_device_count), else 1."""
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def _cpu(name: str) -> Topology:
    count = name.removeprefix("cpu:")
    if not count.isdigit() or int(count) < 1:
        raise PlanError(f"--topology {name!r} is invalid: expected cpu:N with N >= 1")
    wanted = int(count)
    try:  # only possible before jax starts its backends; afterwards, use the devices it has
        # Never fewer than XLA_FLAGS asks for: the setting overrides that flag, and a later
        # cpu:N in this process could then not have its N.
        jax.config.update("jax_num_cpu_devices", max(wanted, _forced_cpu_devices()))
    except RuntimeError:
        pass
    devices = jax.devices("cpu")
    if len(devices) < wanted:
        raise PlanError(f"--topology {name}: this process started jax with {len(devices)} CPU "
                        f"devices; expected at least {wanted} (ask for cpu:N before anything "
                        "else starts jax, or set XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Topology(name, tuple(devices[:wanted]), None)


def _require_libtpu() -> None:
    try:
        importlib.import_module("libtpu")
    except ImportError:
        raise PlanError(LIBTPU_HINT) from None


def _tpu(name: str, chip: Chip, num_slices: int) -> Topology:
    _require_libtpu()
    # Compile-only: no TPU is claimed, so the lockfile that keeps two processes off one TPU
    # must not stop a second planner; and libtpu's start-up chatter is for TPU hosts.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
    os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    def devices(**kwargs) -> list:
        return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                            num_slices=num_slices, **kwargs).devices

    try:
        if chips_in(match_shape(name)) < 4:
            # Slices smaller than a host's default 2x2x1 chips (v5e:1x1, v6e:1x2).
            found = devices(chips_per_host_bounds=(1, 1, 1))
        else:
            found = devices()
    except jax.errors.JaxRuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise PlanError(f"--topology {name!r} is not a valid {chip.name} slice ({first}); "
                        f"expected {VALID}") from None
    if not found:
        raise PlanError(f"--topology {name!r} has no devices; expected {VALID}")
    return Topology(name, tuple(found), chip, num_slices)


def _gpu(name: str, chip: Chip, num_slices: int) -> Topology:
    """GPU nodes: "h100:2x8" is 2 nodes (hosts) of 8 GPUs; the nodes are the name's, not
    slices."""
    shape = [int(n) for n in match_shape(name).split("x")]
    if len(shape) != 2 or min(shape) < 1 or num_slices != 1:
        raise PlanError(f"--topology {name!r} with --num-slices={num_slices} is invalid: "
                        f"expected {chip.name}:<nodes>x<gpus per node> (e.g. {chip.name}:2x8) "
                        "and one slice (the nodes are in the name)")
    try:
        devices = gpus.compile_only_devices(chip, *shape)
    except gpus.MissingCompiler as missing:
        raise PlanError(str(missing)) from None
    return Topology(name, tuple(devices), chip)


# The TPU compiler refuses a program that needs more than it allows, in one of two messages:
# - "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
#   (78.33G) exceeds available HBM (15.75G)." The first figure is the program's
#   peak_memory_in_bytes, arguments included (tests/test_plan_compiler_check.py).
# - "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: ... Ran out of memory in memory space hbm.
#   Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 3.60M.", where the live peak fitted but
#   the heap assigned for it, fragmentation included, and the arguments did not (seen at 220M on
#   one v5e chip, remat full, 2 microbatches: a 13.25G heap for 10.66G of temporaries).
# G is GiB.
_REFUSALS = (
    (re.compile(r"temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM "
                r"\(([0-9.]+)([KMGT])\)"), lambda needed, available: (needed, available)),
    (re.compile(r"Used [0-9.]+[KMGT] of ([0-9.]+)([KMGT]) hbm\. Exceeded hbm capacity by "
                r"([0-9.]+)([KMGT])"), lambda available, over: (available + over, available)),
)
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refusal_bytes(message: str) -> tuple[int, int] | None:
    """(bytes the program needs, bytes the compiler allows) from a refusal, else None. The
    messages round each figure to two decimals of its unit."""
    for pattern, read in _REFUSALS:
        found = pattern.search(message)
        if found is not None:
            first, second = (float(found[i]) * _UNIT[found[i + 1]] for i in (1, 3))
            return tuple(int(n) for n in read(first, second))
    return None


def compiler_limit(device) -> int | None:
    """The bytes the TPU compiler lets one program hold on `device` (compile-only), read from
    its refusal of a program that needs 256 GiB, more than any chip has: it is what the
    compiler checks a step's bytes live at the peak against, and the runtime reserves the rest
    of the chip. None where no refusal says it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    too_big = jax.jit(lambda x: jnp.cumsum(jnp.broadcast_to(x, (2**36,))),
                      in_shardings=sharding, out_shardings=sharding)
    try:
        too_big.lower(jax.ShapeDtypeStruct((), jnp.float32)).compile()
    except jax.errors.JaxRuntimeError as refused:
        read = refusal_bytes(str(refused))
        return None if read is None else read[1]
    return None


def match_shape(name: str) -> str:
    """"v5p:4x4x4" -> "4x4x4"."""
    return name.partition(":")[2]


def chips_in(shape: str) -> int:
    """"4x4x4" -> 64."""
    return math.prod(int(n) for n in shape.split("x"))
