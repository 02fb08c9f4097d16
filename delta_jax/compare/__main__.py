"""`python -m delta_jax.compare --config configs/X.yaml --variants ... --seeds ... --output DIR`."""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from delta_jax.cli import enable_compilation_cache, setup_logging
from delta_jax.compare import (
    FINISHED,
    RunFailed,
    parse_seeds,
    parse_variants,
    plan_runs,
    run_status,
    train_all,
)
from delta_jax.compare import report as report_lib
from delta_jax.config import RESIDUALS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m delta_jax.compare",
        description="Train residual variants side by side (one ordinary delta_jax.train run per "
                    "variant and seed, same data order and token budget) and report which wins: "
                    "compare.json, compare.md, loss.png and routing.png under --output.",
        epilog="Re-running skips finished runs and resumes unfinished ones. On a cluster, "
               "launch the lines of --print-commands as separate jobs, then run this command "
               "with --report-only.")
    parser.add_argument("--config", required=True, help="the YAML run file every run starts from")
    parser.add_argument("--variants", default=",".join(RESIDUALS),
                        help=f"comma-separated residual variants (default: {','.join(RESIDUALS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--output", default="runs/compare",
                        help="folder of the runs (<variant>/seed<seed>) and the report")
    parser.add_argument("--reference", default="baseline",
                        help="the variant differences and step-time ratios are taken to")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the train command of every unfinished run and exit")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from the finished runs; train nothing")
    parser.add_argument("--wandb-group", metavar="NAME",
                        help="log the runs to one W&B group, each named <variant>/seed<seed> "
                             "(needs train.wandb.project)")
    parser.add_argument("--no-routing", action="store_true",
                        help="leave out routing.png (it loads every run's final checkpoint)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="applied to every run, e.g. train.steps=800")
    return parser


def main(argv: Sequence[str] | None = None) -> dict | None:
    setup_logging()
    enable_compilation_cache()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
        if args.reference not in RESIDUALS:
            raise ValueError(f"--reference {args.reference!r}: expected one of "
                             f"{', '.join(RESIDUALS)}")
        runs = plan_runs(args.config, variants, parse_seeds(args.seeds), args.output,
                         args.overrides, args.wandb_group)
        if args.print_commands:
            for run in runs:
                if run_status(run) != FINISHED:
                    print(shlex.join(run.train_command()))
            return None
        if not args.report_only:
            train_all(runs)
        report = report_lib.build_report(runs, variants, Path(args.output), args.reference,
                                         routing=not args.no_routing)
    except RunFailed as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        sys.exit(err.returncode)
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(report_lib.markdown_table(report["variants"], report["reference"]))
    written = [*report["files"].values(), str(Path(args.output) / "compare.json")]
    print("\nwrote " + ", ".join(written))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
