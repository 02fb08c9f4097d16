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
import sys
from pathlib import Path
from typing import Any

from delta_jax.bench import bench_one, format_table
from delta_jax.cli import setup_logging
from delta_jax.config import LAYER_DRIVERS, RESIDUALS
from delta_jax.train.config import load_config


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown or text!r}; expected some of "
                         f"{', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    setup_logging()
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
