"""Compile the trainer's own train step for a Topology and read back its memory and cost.

The one place the planner calls into delta_jax.train: the optimizer, the state's shardings, the
jitted step (donation, gradient accumulation, remat) are the trainer's, so what is compiled here
is what a run on that slice would execute. Nothing is allocated: the state and the batch are
jax.ShapeDtypeStructs.

Per-device numbers: XLA compiles one SPMD program that every device runs, and its
memory_analysis() and cost_analysis() describe that program.

XLA's cost analysis counts the body of a while loop once, whatever its trip count (checked on
v5e, v5p and v6e with jax 0.10.2: a scan of 8 matmuls reports the FLOPs and nearly the time of
one). The trainer's layers run in loops (the lean and scan drivers), so the cost numbers come
from a twin: the same run with `unroll_layers`, the same driver with its loops written out
layer by layer (for the lean driver: the same custom backward pass, recomputing each layer
over the final buffer and accumulating the buffer's cotangent in place), and its loss's
vocabulary-chunk loops written out chunk by chunk (train/loss.py unrolled_vocab_chunks; before
they were, the twin counted one chunk of the loss's matmuls in C: BENCHMARKS.md). The memory
numbers are always the real program's.

The step time is an estimate either way: on TPU XLA's cost model ("optimal_seconds"); on GPU,
whose compiled programs carry no cost analysis, a roofline over XLA's HloCostAnalysis of the
optimized module, max(flops / peak, bytes / bandwidth) (gpus.py). Neither analysis sees the work
inside an attention kernel (splash on TPU, cuDNN on GPU, what model.attention=auto picks there):
its flops are counted by formula (kernel_flops.py), and on TPU its time at the chip's peak is
added to XLA's estimate, a floor for the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from delta_jax.config import ModelConfig
from delta_jax.data.pipeline import batch_keys
from delta_jax.model.attention_kernels import SPLASH_BLOCKS, splash_block
from delta_jax.plan import gpus, kernel_flops
from delta_jax.plan.topology import PlanError, Topology, refusal_bytes, resolve
from delta_jax.sharding import batch_sharding, make_hybrid_mesh
from delta_jax.train.config import RunConfig
from delta_jax.train.loss import unrolled_vocab_chunks
from delta_jax.train.metrics import memory_total_bytes, train_flops_per_token
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (
    abstract_graph_and_params,
    abstract_state,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_train_step


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One compiled train step. Bytes are per device; flops and bytes_accessed too (XLA's cost
    model of the per-device program); analytic_flops is the model's count for the global step.

    When the TPU compiler itself refused the program for exceeding HBM (RESOURCE_EXHAUSTED),
    `oom` holds its message and the cost fields are None. The bytes the message names are the
    compiler's peak count, arguments included: they are live_peak_bytes and total_bytes, and
    temp_bytes is them less the state and batch shards.
    """
    variant: str
    remat: str
    layer_driver: str
    mesh: dict  # {"data": n, "fsdp": n, "tensor": n}, the resolved sizes
    batch_size: int
    seq_len: int
    grad_accum: int
    num_devices: int
    params_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated arguments (the state)
    temp_bytes: int
    code_bytes: int
    total_bytes: int  # arguments + temporaries + outputs not aliased + code: the peak in HBM
    # From the unrolled twin (see above), times grad_accum: its microbatch loop is counted once
    # too, so the optimizer update is counted grad_accum times (a slight overestimate).
    flops: float | None
    bytes_accessed: float | None
    estimated_step_s: float | None  # an estimate (estimate_method), not a measurement
    analytic_flops: float
    compile_s: float
    oom: str | None = None
    # memory_analysis().peak_memory_in_bytes: the compiler's count of the bytes live at once at
    # the peak, arguments included. It is the figure the TPU compiler holds against the chip's
    # HBM when it accepts or refuses a program (tests/test_plan_compiler_check.py).
    # temp_size_in_bytes counts more than the buffers live at the peak (delta's backward pass
    # most of all), so total_bytes is an upper bound over it (BENCHMARKS.md).
    live_peak_bytes: int | None = None
    # How estimated_step_s was estimated (report.describe prints it); None without an estimate.
    estimate_method: str | None = None
    # The attention the compiled program runs (splash, cudnn or xla: what model.attention=auto
    # chose for the topology); None where the compiler refused the step.
    attention: str | None = None

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def knobs(self) -> str:
        return knobs_text(self.remat, self.grad_accum, self.mesh)


def knobs_text(remat: str, grad_accum: int, mesh: dict[str, int]) -> str:
    """"remat=none grad_accum=1 mesh=data1/fsdp4/tensor1": a step's knobs, in one line."""
    return (f"remat={remat} grad_accum={grad_accum} "
            f"mesh=data{mesh['data']}/fsdp{mesh['fsdp']}/tensor{mesh['tensor']}")


def with_variant(model: ModelConfig, variant: str) -> ModelConfig:
    """`model` as residual `variant`, dropping the options that variant does not have (as
    delta_jax.bench does: null sources only in the delta modes, no gate on the baseline)."""
    gated = model.routing_gate and variant != "baseline"
    return model.replace(
        residual=variant, routing_gate=gated,
        null_source=model.null_source and variant.startswith("delta"),
        gate_base=model.gate_base if gated and variant in ("block", "full") else "live")


def build_mesh(run: RunConfig, topology: Topology) -> Mesh:
    """run.mesh over the topology's devices, through the builder every entry point uses: its
    sizes within each slice, the slices on the axes it says (by default data)."""
    try:
        return make_hybrid_mesh(run.mesh.per_slice, run.mesh.across_slices, topology.devices)
    except ValueError as e:
        slices = f" x {topology.num_slices} slices" if topology.num_slices > 1 else ""
        raise PlanError(f"{e} (topology {topology.name}{slices})") from None


def mesh_sizes(run: RunConfig, topology: Topology) -> dict[str, int]:
    """run.mesh's axis sizes on the topology, -1 resolved; PlanError if they do not fit it."""
    return dict(build_mesh(run, topology).shape)


def check_batch(run: RunConfig, sizes: dict[str, int]) -> None:
    shards = sizes["data"] * sizes["fsdp"]
    rows = run.train.batch_size // run.train.grad_accum
    if rows % shards:
        raise PlanError(
            f"train.batch_size={run.train.batch_size} with train.grad_accum="
            f"{run.train.grad_accum} gives microbatches of {rows} rows, which do not split over "
            f"mesh data x fsdp = {shards} devices: expected a multiple of {shards}")


def _bytes_per_device(tree) -> int:
    """Sum over ShapeDtypeStructs with shardings of the bytes of one device's shard."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _oom_peak_bytes(message: str) -> int | None:
    """The bytes a refused program needs, as the compiler's message names them: its live peak
    or the heap assigned for it, arguments included (topology.refusal_bytes)."""
    read = refusal_bytes(message)
    return None if read is None else read[0]


def cost_twin(run: RunConfig) -> RunConfig:
    """The run whose compiled cost analysis counts every layer (see the module docstring)."""
    return dataclasses.replace(run, model=run.model.replace(unroll_layers=True))


XLA_COST_MODEL = "XLA's cost model"


def _cost(compiled, scale: int, run: RunConfig, topology: Topology,
          mesh: dict[str, int]) -> dict[str, float | str | None]:
    """A TPU (or CPU) program's flops, bytes accessed and XLA's step estimate, with splash's
    calls added (their flops, and their time at the device's peak), times `scale`."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0]
    seconds = cost.get("optimal_seconds")
    values = {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
              # XLA reports a negative time where its model has no estimate (seen on v5e)
              "estimated_step_s": seconds if seconds is not None and seconds > 0 else None}
    splash = _kernel_flops(compiled, run, mesh, "splash")
    method = XLA_COST_MODEL
    if splash and values["flops"] is not None:
        values["flops"] += splash
        if values["estimated_step_s"] is not None and topology.peak_flops_per_device:
            values["estimated_step_s"] += splash / topology.peak_flops_per_device
            method = f"{XLA_COST_MODEL}, splash attention added at the chip's peak"
    scaled = {k: None if v is None else v * scale for k, v in values.items()}
    return {**scaled, "estimate_method": scaled["estimated_step_s"] and method}


def _kernel_flops(compiled, run: RunConfig, mesh: dict[str, int], kernel: str) -> float:
    """The flops of `kernel`'s (splash or cudnn) calls in the compiled program, per device."""
    cfg, seq_len = run.model, run.train.seq_len
    rows = run.train.batch_size // run.train.grad_accum // (mesh["data"] * mesh["fsdp"])
    heads = kernel_flops.attention_heads_per_device(cfg.num_heads, mesh["tensor"])
    if kernel == "cudnn":
        return kernel_flops.cudnn_attention_flops(compiled.as_text(), rows, seq_len, heads,
                                                  cfg.head_dim)
    if seq_len % SPLASH_BLOCKS[-1]:  # no splash call can be in the program
        return 0.0
    return kernel_flops.splash_attention_flops(compiled.as_text(), rows, seq_len, heads,
                                               cfg.head_dim, splash_block(seq_len))


def _gpu_cost(compiled, scale: int, run: RunConfig, topology: Topology,
              mesh: dict[str, int]) -> dict[str, float | str]:
    """A GPU program's flops (XLA's HloCostAnalysis, plus cuDNN attention by formula) and bytes
    accessed, times `scale`, and the roofline step they give on topology's GPU."""
    chip = topology.chip
    flops, accessed = gpus.hlo_cost(compiled)
    flops += _kernel_flops(compiled, run, mesh, "cudnn")
    flops, accessed = flops * scale, accessed * scale
    return {"flops": flops, "bytes_accessed": accessed,
            "estimated_step_s": gpus.roofline_s(flops, accessed, chip),
            "estimate_method": (f"a roofline over XLA's cost analysis, max(flops / "
                                f"{chip.peak_flops / 1e12:.0f} TFLOP/s, bytes / "
                                f"{chip.memory_bandwidth / 1e12:.2f} TB/s)")}


def compile_step(run: RunConfig, topology: Topology, estimate: bool = True) -> StepPlan:
    """Lower and compile run's train step for `topology`; nothing runs. With `estimate`, the
    cost fields come from compiling cost_twin(run) too (with_cost); without, they are None."""
    memory_plan = _compile(run, topology)
    return with_cost(run, topology, memory_plan) if estimate else memory_plan


def with_cost(run: RunConfig, topology: Topology, memory_plan: StepPlan) -> StepPlan:
    """`memory_plan` (run's compiled step) with the cost fields from compiling cost_twin(run),
    and that compile's seconds added to compile_s; unchanged where the compiler refused the step
    or the twin for exceeding HBM."""
    if memory_plan.oom is not None:
        return memory_plan
    start = time.perf_counter()
    _, compile_twin = _prepare(cost_twin(run), topology)
    try:
        with unrolled_vocab_chunks():
            compiled = compile_twin()
    except jax.errors.JaxRuntimeError as e:
        if _oom_peak_bytes(str(e)) is None:
            raise
        return memory_plan  # the twin alone exceeds HBM: no estimate
    scale = run.train.grad_accum
    cost = (_gpu_cost(compiled, scale, run, topology, memory_plan.mesh) if topology.is_gpu
            else _cost(compiled, scale, run, topology, memory_plan.mesh))
    return dataclasses.replace(memory_plan, **cost,
                               compile_s=memory_plan.compile_s + time.perf_counter() - start)


@functools.cache
def resolved(name: str, num_slices: int = 1) -> Topology:
    """resolve(name, num_slices), once per process."""
    return resolve(name, num_slices)


def compile_named(run: RunConfig, topology_name: str, num_slices: int = 1,
                  estimate: bool = True) -> StepPlan:
    """compile_step for the topology called `topology_name`: what a plan/isolated.py Worker
    runs in its child process (a Topology holds devices, which do not pickle)."""
    return compile_step(run, resolved(topology_name, num_slices), estimate)


def cost_named(run: RunConfig, topology_name: str, num_slices: int,
               memory_plan: StepPlan) -> StepPlan:
    """with_cost for the topology called `topology_name` (in a Worker's child process, as
    compile_named): the planner compiles the twin as a call of its own to report its time."""
    return with_cost(run, resolved(topology_name, num_slices), memory_plan)


def state_bytes(run: RunConfig, topology: Topology) -> int:
    """Parameters + optimizer state per device: a floor under any step's memory (no compile)."""
    fields, _ = _prepare(run, topology)
    return fields["params_bytes"] + fields["opt_state_bytes"]


def _prepare(run: RunConfig, topology: Topology):
    """(fields of StepPlan known before compiling, a function that compiles the step)."""
    cfg, train = run.model, run.train
    mesh = build_mesh(run, topology)
    sizes = dict(mesh.shape)
    check_batch(run, sizes)
    tx = make_optimizer(run.optimizer, train.steps)
    shardings = to_shardings(state_specs(cfg, tx, mesh, train.trainable), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    step = make_train_step(graphdef, tx, schedules(run.optimizer, train.steps), train.grad_accum,
                           shardings, mesh, loss_vocab_chunks=train.loss_vocab_chunks,
                           trainable=train.trainable)
    state = abstract_state(cfg, tx, shardings, train.trainable)
    ids = jax.ShapeDtypeStruct((train.batch_size, train.seq_len), jnp.int32,
                               sharding=batch_sharding(mesh))
    batch = dict.fromkeys(batch_keys(run.data.packing), ids)
    fields = dict(
        variant=cfg.residual, remat=cfg.remat, layer_driver=cfg.layer_driver, mesh=sizes,
        batch_size=train.batch_size, seq_len=train.seq_len, grad_accum=train.grad_accum,
        num_devices=topology.num_devices, params_bytes=_bytes_per_device(state.params),
        opt_state_bytes=_bytes_per_device(state.opt_state), batch_bytes=_bytes_per_device(batch),
        analytic_flops=train_flops_per_token(cfg, train.seq_len) * train.batch_size
        * train.seq_len)

    def compile_():
        with jax.set_mesh(mesh):
            return step.lower(state, batch).compile()

    return fields, compile_


def _compile(run: RunConfig, topology: Topology) -> StepPlan:
    """The real program's StepPlan, without cost fields."""
    fields, compile_ = _prepare(run, topology)
    start = time.perf_counter()
    try:
        compiled = compile_()
    except jax.errors.JaxRuntimeError as e:
        peak = _oom_peak_bytes(str(e))
        if peak is None:
            raise
        # No program, so no memory_analysis: the arguments are the state and batch shards.
        argument = fields["params_bytes"] + fields["opt_state_bytes"] + fields["batch_bytes"]
        return StepPlan(**fields, argument_bytes=argument, output_bytes=0, alias_bytes=0,
                        temp_bytes=max(peak - argument, 0), code_bytes=0, total_bytes=peak,
                        flops=None, bytes_accessed=None, estimated_step_s=None,
                        compile_s=time.perf_counter() - start,
                        oom=str(e).strip().splitlines()[0], live_peak_bytes=peak)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    argument, output = memory.argument_size_in_bytes, memory.output_size_in_bytes
    alias, temp = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    code = memory.generated_code_size_in_bytes
    return StepPlan(
        **fields, argument_bytes=argument, output_bytes=output, alias_bytes=alias,
        temp_bytes=temp, code_bytes=code, total_bytes=memory_total_bytes(memory),
        flops=None, bytes_accessed=None, estimated_step_s=None, compile_s=compile_s,
        live_peak_bytes=getattr(memory, "peak_memory_in_bytes", None) or None,
        attention=kernel_flops.attention_kernel_in(compiled.as_text()))
