"""The first run on new hardware: a few real train steps per residual variant, with XLA's
attention and the accelerator's kernel, measured beside the planner's prediction.

For each variant the trainer's own step (delta_jax.train.step.make_train_step, its state, its
mesh) runs `warmup` + `steps` steps on the same batches from the same initial state, once with
model.attention=xla and once with the device's kernel (splash on TPU, cudnn on GPU; CPUs have
none). Each run reports its measured step time (median of the `steps` timed steps; compiling
and the warmup steps excluded), tokens/s, MFU and the device's peak memory, beside what
delta_jax.plan.compile predicts for the same step compiled for the devices present: bytes per
device (memory_analysis's total and the compiler's live peak) and XLA's cost-model step time
(an estimate, where XLA gives one). The losses and gradient norms of a variant's two runs,
step by step, must agree within TOLERANCE of the compute dtype.

The data are the trainer's: the run's data.path through its pipeline (data.path=embedded, the
built-in corpus, needs no preparation). The runs train at the config's peak learning rate from
the first step (SMOKE_OVERRIDES: no warmup), so that a few steps move the loss off its value at
initialisation, where it barely depends on attention, and a kernel that computes something else
shows in the later steps.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import jax
import numpy as np

from delta_jax.data.pipeline import build_batch_iterator, to_global_array
from delta_jax.model.attention_kernels import splash_block
from delta_jax.plan.compile import check_batch, compile_step, mesh_sizes, with_variant
from delta_jax.plan.topology import Topology
from delta_jax.sharding import batch_sharding
from delta_jax.train.config import RunConfig
from delta_jax.train.loop import build_mesh, data_source
from delta_jax.train.metrics import device_peak_flops, train_flops_per_token
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import abstract_graph_and_params, init_state, state_specs, to_shardings
from delta_jax.train.step import make_train_step

logger = logging.getLogger(__name__)

VARIANTS = ("baseline", "delta", "delta_block")
# The accelerator's attention kernel by jax platform; CPUs have none.
KERNELS = {"tpu": "splash", "gpu": "cudnn"}
# Largest relative difference |kernel - xla| / |xla| allowed in each step's loss and gradient
# norm, by compute dtype. In float32 the kernels compute the same sums in another order (flash
# kernels rescale a running softmax block by block); in bfloat16/float16 they also round at
# other places than XLA does. The gradient norm is the sharper test: at initialisation the loss
# barely depends on attention, so a kernel that is wrong (not causal, say) shows in the
# gradients before it shows in a few steps' losses. How these were chosen, against a correct
# and a non-causal kernel: docs/first_run.md#tolerances.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
# Applied before the user's overrides (which may undo them): see the module docstring.
SMOKE_OVERRIDES = ("optimizer.warmup_steps=0",)


def default_overrides(device_count: int) -> list[str]:
    """The default run: a 4-layer, d 256 model of bfloat16 compute (cudnn's dtype) at T 512 (a
    multiple of splash's 128), 8 sequences per device, on the built-in corpus (byte tokenizer,
    vocabulary 384) with concat packing (cudnn takes no segment ids). Its point is that
    everything works, not the numbers."""
    return ["output_dir=runs/smoke", "model.vocab_size=384", "model.hidden_size=256",
            "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
            "model.head_dim=64", "model.intermediate_size=1024", "model.num_blocks=2",
            "model.dtype=bfloat16", "data.path=embedded", "data.packing=concat",
            f"train.batch_size={8 * device_count}", "train.seq_len=512", "mesh.data=-1"]


def accelerator_kernel(platform: str) -> str | None:
    """The attention kernel of jax platform `platform` ("tpu", "gpu"), None for CPUs."""
    return KERNELS.get(platform)


def local_topology() -> Topology:
    """The devices present (of every process) as the planner's Topology, e.g. "gpu:8". No chip
    table entry: compile_step needs only the devices, and the measured side reads the device's
    own memory limit."""
    devices = tuple(jax.devices())
    return Topology(f"{devices[0].platform}:{len(devices)}", devices, None)


def variant_runs(run: RunConfig, variant: str, kernel: str | None) -> dict[str, RunConfig]:
    """{"xla": run as `variant` with XLA's attention, and, with a kernel, kernel: the same with
    it}. ValueError (from ModelConfig) where the kernel cannot take the run: cudnn needs
    bfloat16 or float16 compute; splash a sequence length that its block size divides."""
    model = with_variant(run.model, variant)
    runs = {"xla": dataclasses.replace(run, model=model.replace(attention="xla"))}
    if kernel is not None:
        try:
            if kernel == "splash":
                splash_block(run.train.seq_len)
            runs[kernel] = dataclasses.replace(run, model=model.replace(attention=kernel))
        except ValueError as err:
            raise ValueError(f"{err}; or run xla attention only (--no-kernel)") from None
    return runs


def for_kernel(run: RunConfig, kernel: str | None) -> tuple[RunConfig, str | None]:
    """(the run both attentions take, a note of what changed or None): cudnn takes no segment
    ids, so documents packing becomes concat for the xla run too (the same data for both)."""
    if kernel == "cudnn" and run.data.packing == "documents":
        return (dataclasses.replace(run, data=dataclasses.replace(run.data, packing="concat")),
                "cudnn takes no segment ids: both attentions run with data.packing=concat")
    return run, None


def fixed_batches(run: RunConfig, mesh, count: int) -> list[dict[str, jax.Array]]:
    """The first `count` training batches of the run's data ({"input_ids", "labels", ...}
    int32 [B, T] global arrays), read once through the trainer's pipeline and given to every
    run, so that all runs see the same data."""
    iterator = build_batch_iterator(
        data_source(run), split="train", seq_len=run.train.seq_len,
        global_batch_size=run.train.batch_size, seed=run.seed, num_threads=run.data.num_threads,
        prefetch=run.data.prefetch, packing=run.data.packing)
    sharding = batch_sharding(mesh)
    return [to_global_array(next(iterator), sharding) for _ in range(count)]


def device_peak_bytes() -> int | None:
    """The largest peak_bytes_in_use of this process's devices (None where devices keep no
    statistics: CPUs). A high-water mark since the process started: jax cannot reset it."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def device_bytes_limit() -> int | None:
    """What the allocator of this process's first device may hold (None on CPUs)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


def _run_steps(run: RunConfig, batches: list[dict[str, jax.Array]]
               ) -> tuple[float, list[float], list[dict[str, float]]]:
    """(compile seconds, each step's wall seconds, each step's metrics) of the trainer's step
    for `run`, one step per batch from the run's initial state."""
    cfg, train = run.model, run.train
    mesh = build_mesh(run.mesh)
    tx = make_optimizer(run.optimizer, train.steps)
    shardings = to_shardings(state_specs(cfg, tx, mesh, train.trainable), mesh)
    step_fn = make_train_step(abstract_graph_and_params(cfg)[0], tx,
                              schedules(run.optimizer, train.steps), train.grad_accum,
                              shardings, mesh, loss_vocab_chunks=train.loss_vocab_chunks,
                              trainable=train.trainable)
    with jax.set_mesh(mesh):
        state = init_state(cfg, tx, shardings, run.seed, train.trainable)
        start = time.perf_counter()
        compiled = step_fn.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - start
        times, metrics = [], []
        for batch in batches:
            start = time.perf_counter()
            state, step_metrics = compiled(state, batch)
            jax.block_until_ready(step_metrics["loss"])
            times.append(time.perf_counter() - start)
            metrics.append(step_metrics)
    return compile_s, times, jax.device_get(metrics)


def measure(run: RunConfig, batches: list[dict[str, jax.Array]], warmup: int) -> dict[str, Any]:
    """Run the trainer's step for `run` once per batch: {"compile_s", "step_time_s" (median
    over the batches after the first `warmup`), "tokens_per_s", "analytic_flops" (the model's
    count for the global step), "mfu" (None without a known peak), "losses", "grad_norms" (one
    per step), "device_peak_bytes", "device_peak_exact", "measured_oom"}. A run the device has
    no memory for (RESOURCE_EXHAUSTED) is a result too: measured_oom holds the first line of
    the error and the timings and losses are None."""
    train = run.train
    tokens = train.batch_size * train.seq_len
    result = dict.fromkeys(("compile_s", "step_time_s", "tokens_per_s", "mfu", "losses",
                            "grad_norms", "measured_oom"))
    result["analytic_flops"] = train_flops_per_token(run.model, train.seq_len) * tokens
    peak_before = device_peak_bytes()
    try:
        compile_s, times, metrics = _run_steps(run, batches)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        result["measured_oom"] = str(e).strip().splitlines()[0]
    else:
        step_s = statistics.median(times[warmup:])
        peak_flops = device_peak_flops(jax.devices()[0].device_kind, train.peak_tflops)
        result.update(
            compile_s=compile_s, step_time_s=step_s, tokens_per_s=tokens / step_s,
            mfu=None if peak_flops is None else (
                result["analytic_flops"] / step_s / (peak_flops * jax.device_count())),
            losses=[float(m["loss"]) for m in metrics],
            grad_norms=[float(m["grad_norm"]) for m in metrics])
    peak_after = device_peak_bytes()
    # The high-water mark is this run's only if the run raised it.
    result.update(device_peak_bytes=peak_after, device_peak_exact=None if peak_after is None
                  else peak_before is None or peak_after > peak_before)
    return result


def predict(run: RunConfig, topology: Topology) -> dict[str, Any]:
    """The planner's view of the same step on the same devices (compiled, not run)."""
    plan = compile_step(run, topology)
    return {"predicted_total_bytes": plan.total_bytes,
            "predicted_live_peak_bytes": plan.live_peak_bytes,
            "estimated_step_s": plan.estimated_step_s,
            "xla_flops_per_device": plan.flops,
            "predicted_oom": plan.oom, "plan_compile_s": plan.compile_s}


def agreement(reference: list[float], other: list[float], dtype: str) -> dict[str, Any]:
    """How far `other` (the kernel's per-step values) is from `reference` (xla's):
    {"max_rel_diff", "tolerance", "ok"}; non-finite values never agree."""
    tolerance = TOLERANCE[dtype]
    a, b = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
    diff = float(np.max(np.abs(b - a) / np.maximum(np.abs(a), 1e-30))) if finite else float("inf")
    return {"max_rel_diff": diff, "tolerance": tolerance, "ok": finite and diff <= tolerance}


def smoke_variant(run: RunConfig, variant: str, kernel: str | None, topology: Topology,
                  batches: list[dict[str, jax.Array]], warmup: int) -> dict[str, Any]:
    """{"rows": one per attention (measured and predicted fields), "agreement": the kernel's
    losses and gradient norms against xla's, or None without a kernel}."""
    rows = []
    for attention, one in variant_runs(run, variant, kernel).items():
        row = {"variant": variant, "attention": attention, "dtype": one.model.dtype,
               "layer_driver": one.model.layer_driver, "remat": one.model.remat}
        row.update(measure(one, batches, warmup))
        row.update(predict(one, topology))
        logger.info("%s, attention %s: %s (XLA's estimate %s)", variant, attention,
                    row["measured_oom"] or f"{1e3 * row['step_time_s']:.1f} ms a step, loss "
                    f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}",
                    "none" if row["estimated_step_s"] is None
                    else f"{1e3 * row['estimated_step_s']:.1f} ms")
        rows.append(row)
    if kernel is None:
        return {"rows": rows, "agreement": None}
    xla, ours = rows
    found = {"variant": variant, "kernel": kernel}
    if xla["measured_oom"] or ours["measured_oom"]:
        return {"rows": rows, "agreement": {**found, "skipped": "a run ran out of memory"}}
    dtype = run.model.dtype
    return {"rows": rows, "agreement": {
        **found, "skipped": None, "loss": agreement(xla["losses"], ours["losses"], dtype),
        "grad_norm": agreement(xla["grad_norms"], ours["grad_norms"], dtype)}}


def checked_mesh(run: RunConfig, topology: Topology) -> dict[str, int]:
    """The run's mesh sizes on the devices present; ValueError (PlanError) before anything
    compiles where they do not cover the devices or the batch does not split over data x
    fsdp."""
    sizes = mesh_sizes(run, topology)
    check_batch(run, sizes)
    return sizes


def device_summary(topology: Topology) -> dict[str, Any]:
    first = topology.devices[0]
    return {"platform": first.platform, "device_kind": first.device_kind,
            "num_devices": topology.num_devices, "num_processes": jax.process_count(),
            "bytes_limit": device_bytes_limit(), "jax": jax.__version__}


def run_smoke(run: RunConfig, variants: list[str], *, steps: int, warmup: int,
              use_kernel: bool = True) -> dict[str, Any]:
    """The whole smoke run (see the module docstring): {"device", "kernel" (None: xla only),
    "notes" (lines to show), "mesh" (resolved sizes), "config", "steps", "warmup", "rows",
    "agreement", "ok"}. ValueError for a run that cannot start (a mesh or batch that does not
    split, a kernel that cannot take it, unreadable data)."""
    topology = local_topology()
    platform = topology.devices[0].platform
    kernel = accelerator_kernel(platform) if use_kernel else None
    notes = []
    if not use_kernel:
        notes.append("kernel skipped: xla attention only")
    elif kernel is None:
        notes.append(f"no attention kernel on {platform}: xla attention only")
    run, changed = for_kernel(run, kernel)
    notes += [changed] if changed else []
    sizes = checked_mesh(run, topology)
    for variant in variants:  # every config is checked before anything compiles
        variant_runs(run, variant, kernel)
    batches = fixed_batches(run, build_mesh(run.mesh), warmup + steps)
    results = [smoke_variant(run, v, kernel, topology, batches, warmup) for v in variants]
    agreements = [r["agreement"] for r in results if r["agreement"] is not None]
    return {"device": device_summary(topology), "kernel": kernel, "notes": notes,
            "mesh": sizes, "config": run.to_dict(), "steps": steps, "warmup": warmup,
            "rows": [row for r in results for row in r["rows"]], "agreement": agreements,
            "ok": all(agrees(a) is not False for a in agreements)}


def agrees(found: dict[str, Any]) -> bool | None:
    """Whether a kernel's losses and gradient norms agreed with xla's; None if not compared."""
    return None if found["skipped"] else found["loss"]["ok"] and found["grad_norm"]["ok"]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """One row per (variant, attention): measured beside predicted. A device peak that an
    earlier run of the process set (so this run's is at most that) is marked "<="; a run the
    device had no memory for shows OOM as its loss."""
    header = (f"{'variant':12} {'attention':9} {'step ms':>9} {'est ms':>8} {'tokens/s':>11} "
              f"{'MFU':>6} {'peak MiB':>9} {'pred MiB':>9} {'live MiB':>9} {'loss':>8}")
    lines = [header, "-" * len(header)]
    for r in report["rows"]:
        estimate = "-" if r["estimated_step_s"] is None else f"{1e3 * r['estimated_step_s']:.1f}"
        step = "-" if r["step_time_s"] is None else f"{1e3 * r['step_time_s']:.1f}"
        tokens = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = _mib(r["device_peak_bytes"])
        if r["device_peak_exact"] is False:
            peak = "<=" + peak
        loss = "OOM" if r["measured_oom"] else f"{r['losses'][-1]:.4f}"
        lines.append(
            f"{r['variant']:12} {r['attention']:9} {step:>9} {estimate:>8} {tokens:>11} "
            f"{mfu:>6} {peak:>9} {_mib(r['predicted_total_bytes']):>9} "
            f"{_mib(r['predicted_live_peak_bytes']):>9} {loss:>8}")
    return "\n".join(lines)


def agreement_lines(report: dict[str, Any]) -> list[str]:
    """One "ok", "FAIL" or "skipped" line per variant run with a kernel."""
    lines = []
    for a in report["agreement"]:
        verdict = agrees(a)
        if verdict is None:
            lines.append(f"skipped: {a['variant']} {a['kernel']} vs xla not compared: "
                         f"{a['skipped']}")
            continue
        lines.append(
            f"{'ok' if verdict else 'FAIL'}: {a['variant']} {a['kernel']} vs xla: losses differ "
            f"by {a['loss']['max_rel_diff']:.2e}, gradient norms by "
            f"{a['grad_norm']['max_rel_diff']:.2e} at most (relative; tolerance "
            f"{a['loss']['tolerance']:.0e} for {report['config']['model']['dtype']})")
    return lines
