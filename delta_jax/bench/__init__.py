"""Benchmark a full train step (forward, backward, AdamW) of one model: bench_one, format_table.

bench_one measures compile time, the compiled step's temporary memory
(compiled.memory_analysis()), FLOPs (XLA's cost_analysis and the analytic count of
delta_jax.train.metrics), the median step time over `steps` timed steps after `warmup`, tokens/s
and MFU where the device peak is known; compile_only skips running. The command line
`python -m delta_jax.bench`, over residual variants and layer drivers, is in __main__.py.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.data.pipeline import batch_keys
from delta_jax.sharding import batch_sharding
from delta_jax.train.config import RunConfig
from delta_jax.train.loop import build_mesh
from delta_jax.train.metrics import device_peak_flops, train_flops_per_token
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (
    abstract_graph_and_params,
    abstract_state,
    init_state,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_train_step


def _xla_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per device program
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def bench_one(run: RunConfig, *, steps: int, warmup: int, compile_only: bool) -> dict[str, Any]:
    """Compile (and unless compile_only, time) one train step of `run`'s model."""
    cfg, train = run.model, run.train
    mesh = build_mesh(run.mesh)
    tx = make_optimizer(run.optimizer, train.steps)
    shardings = to_shardings(state_specs(cfg, tx, mesh, train.trainable), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    step_fn = make_train_step(graphdef, tx, schedules(run.optimizer, train.steps),
                              train.grad_accum, shardings, mesh,
                              loss_vocab_chunks=train.loss_vocab_chunks,
                              trainable=train.trainable)
    shape = (train.batch_size, train.seq_len)
    batch_spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh))
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = step_fn.lower(abstract_state(cfg, tx, shardings, train.trainable),
                                 dict.fromkeys(batch_keys(run.data.packing), batch_spec)
                                 ).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        tokens = train.batch_size * train.seq_len
        result = {
            "variant": cfg.residual, "driver": cfg.layer_driver, "remat": cfg.remat,
            "dtype": cfg.dtype, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "batch_size": train.batch_size, "seq_len": train.seq_len,
            "compile_time_s": compile_s,
            "temp_bytes": int(memory.temp_size_in_bytes),
            "argument_bytes": int(memory.argument_size_in_bytes),
            "flops": _xla_flops(compiled),
            "analytic_flops": train_flops_per_token(cfg, train.seq_len) * tokens,
            "step_time_s": None, "tokens_per_s": None, "mfu": None,
        }
        if compile_only:
            return result
        state = init_state(cfg, tx, shardings, run.seed, train.trainable)
        rng = np.random.default_rng(run.seed)
        ids = rng.integers(0, cfg.vocab_size, shape, dtype=np.int32)
        # Documents packing: one document per row; the kernels cost the same for any split.
        arrays = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1),
                  "segment_ids": np.zeros(shape, np.int32),
                  "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape)}
        batch = {k: jax.device_put(arrays[k], batch_sharding(mesh))
                 for k in batch_keys(run.data.packing)}
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = device_peak_flops(jax.devices()[0].device_kind, train.peak_tflops)
    result.update(step_time_s=step_s, tokens_per_s=tokens / step_s,
                  loss=float(metrics["loss"]))
    if peak:
        result["mfu"] = result["analytic_flops"] / step_s / (peak * jax.device_count())
    return result


def _ratio(value, base) -> str:
    return "" if value is None or not base else f" ({value / base:.2f}x)"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per result; ratios to the baseline with the same driver."""
    baseline = {r["driver"]: r for r in results if r["variant"] == "baseline"}
    header = (f"{'variant':12} {'driver':9} {'step s':>15} {'tokens/s':>10} "
              f"{'temp MiB':>17} {'compile s':>15} {'GFLOP':>9}")
    rows = [header, "-" * len(header)]
    for r in results:
        base = baseline.get(r["driver"], {})
        step = ("-" if r["step_time_s"] is None else
                f"{r['step_time_s']:.3f}{_ratio(r['step_time_s'], base.get('step_time_s'))}")
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        temp = r["temp_bytes"] / 2**20
        rows.append(
            f"{r['variant']:12} {r['driver']:9} {step:>15} {tps:>10} "
            f"{temp:>8.1f}{_ratio(r['temp_bytes'], base.get('temp_bytes')):>9} "
            f"{r['compile_time_s']:>6.1f}"
            f"{_ratio(r['compile_time_s'], base.get('compile_time_s')):>9}"
            f" {r['analytic_flops'] / 1e9:>9.1f}")
    return "\n".join(rows)
