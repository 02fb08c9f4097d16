"""Benchmark a full train step (forward, backward, AdamW) per residual variant and layer driver.

    python -m delta_jax.bench --config configs/bench_cpu.yaml \
        --variants baseline,block,full,delta,delta_block --drivers lean,scan --json out.json \
        [section.key=value ...]

For each (variant, driver): compile time, the compiled step's temporary memory
(compiled.memory_analysis()), FLOPs (XLA's cost_analysis and the analytic count of
delta_jax.train.metrics), median step time over --steps timed steps after --warmup, tokens/s and
MFU where the device peak is known. `--compile-only` skips running (paper-sized shapes on a
small machine: memory and FLOPs need no run). Ratios in the printed table are to the baseline
with the same driver, measured in the same process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.config import LAYER_DRIVERS, RESIDUALS
from delta_jax.train.config import RunConfig, load_config
from delta_jax.train.loop import build_mesh
from delta_jax.train.metrics import device_peak_flops, train_flops_per_token
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (abstract_model, abstract_state, init_state, state_specs,
                                   to_shardings)
from delta_jax.train.step import make_train_step
from delta_jax.sharding import batch_sharding


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
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_model(cfg)
    step_fn = make_train_step(graphdef, tx, schedules(run.optimizer, train.steps),
                              train.grad_accum, shardings, mesh)
    shape = (train.batch_size, train.seq_len)
    batch_spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh))
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = step_fn.lower(abstract_state(cfg, tx, shardings),
                                 {"input_ids": batch_spec, "labels": batch_spec}).compile()
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
        state = init_state(cfg, tx, shardings, run.seed)
        rng = np.random.default_rng(run.seed)
        ids = rng.integers(0, cfg.vocab_size, shape, dtype=np.int32)
        batch = {k: jax.device_put(v, batch_sharding(mesh))
                 for k, v in (("input_ids", ids), ("labels", np.roll(ids, -1, axis=1)))}
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
            f"{r['compile_time_s']:>6.1f}{_ratio(r['compile_time_s'], base.get('compile_time_s')):>9}"
            f" {r['analytic_flops'] / 1e9:>9.1f}")
    return "\n".join(rows)


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown or text!r}; expected some of "
                         f"{', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m delta_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a run YAML (configs/bench_cpu.yaml)")
    parser.add_argument("--variants", default=",".join(RESIDUALS))
    parser.add_argument("--drivers", default=None,
                        help="layer drivers, comma-separated (default: the config's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here (a JSON list)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        run = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    variants = _names(args.variants, RESIDUALS, "--variants")
    drivers = _names(args.drivers or run.model.layer_driver, LAYER_DRIVERS, "--drivers")
    # Baselines first, so that each later row can show its ratio as soon as it is printed.
    order = sorted(((v, d) for d in drivers for v in variants), key=lambda vd: vd[0] != "baseline")
    results = []
    for variant, driver in order:
        gated = run.model.routing_gate and variant != "baseline"
        model = run.model.replace(
            residual=variant, layer_driver=driver,
            null_source=run.model.null_source and variant.startswith("delta"),
            routing_gate=gated,
            gate_base=run.model.gate_base if gated and variant in ("block", "full") else "live")
        results.append(bench_one(dataclasses.replace(run, model=model), steps=args.steps,
                                 warmup=args.warmup, compile_only=args.compile_only))
        print(format_table(results).splitlines()[-1], flush=True)
    print()
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
