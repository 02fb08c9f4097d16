"""The first thing to run on a new TPU slice or GPU node (docs/first_run.md):

    python -m delta_jax.smoke [--config configs/220m.yaml] [--variants baseline,delta]
        [--steps 5] [--warmup 1] [--no-kernel] [--json OUT] [--distributed [HOST:PORT,N,I]]
        [section.key=value ...]

Runs a few train steps of each variant with XLA's attention and with the accelerator's kernel
(splash on TPU, cudnn on GPU), checks that their losses agree, and prints the measured step
time, tokens/s, MFU and device peak memory beside the planner's prediction for the same step.
Everything goes to --json (default <output_dir>/smoke.json). Without --config, a small model
(delta_jax.smoke.default_overrides) on the built-in corpus. Exit status: 0 when every kernel
agrees with xla, 1 when one does not (a FAIL line says which), 2 for bad input (an error: line).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from delta_jax import smoke
from delta_jax.cli import DISTRIBUTED_HELP, initialize_distributed, setup_logging, start_processes
from delta_jax.config import RESIDUALS
from delta_jax.train.config import RunConfig, load_config

EXIT_DISAGREE, EXIT_BAD_INPUT = 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m delta_jax.smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a run YAML (configs/*.yaml); default: a small model "
                                         "on the built-in corpus")
    parser.add_argument("--variants", default=",".join(smoke.VARIANTS),
                        help=f"comma-separated, of {', '.join(RESIDUALS)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the timed ones")
    parser.add_argument("--no-kernel", action="store_true",
                        help="xla attention only (skip the accelerator's kernel)")
    parser.add_argument("--json", type=Path, help="default: <output_dir>/smoke.json")
    parser.add_argument("--distributed", nargs="?", const="auto", metavar="HOST:PORT,N,I",
                        help=DISTRIBUTED_HELP + "; or distributed.enabled=true, as the trainer")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def _config(args: argparse.Namespace, device_count: int) -> RunConfig:
    base = [] if args.config else smoke.default_overrides(device_count)
    return load_config(args.config, [*base, *smoke.SMOKE_OVERRIDES, *args.overrides])


def _variants(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in RESIDUALS]
    if unknown or not names:
        raise ValueError(f"--variants {text!r}: unknown {', '.join(unknown) or 'empty list'}; "
                         f"expected some of {', '.join(RESIDUALS)}")
    return names


def _write_and_print(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    device = report["device"]
    memory = ("none on this platform" if report["rows"][0]["device_peak_bytes"] is None
              else "device.memory_stats()")
    print(f"{device['num_devices']} x {device['device_kind']} ({device['platform']}, "
          f"{device['num_processes']} process(es)); memory statistics: {memory}")
    print("\n".join(report["notes"] + [smoke.format_table(report)]
                    + smoke.agreement_lines(report) + [f"written to {out}"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = _parser().parse_args(argv)
    try:
        variants = _variants(args.variants)
        if args.steps < 1 or args.warmup < 0:
            raise ValueError(f"--steps {args.steps} --warmup {args.warmup}: expected steps >= 1 "
                             "and warmup >= 0")
        run = _config(args, 1)  # checks the config before any device is touched
        if args.distributed is not None:
            start_processes(args)
        elif run.distributed.enabled:
            d = run.distributed
            initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run = _config(args, jax.device_count())
        report = smoke.run_smoke(run, variants, steps=args.steps, warmup=args.warmup,
                                 use_kernel=not args.no_kernel)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if jax.process_index() == 0:
        _write_and_print(report, args.json or Path(run.output_dir) / "smoke.json")
    return 0 if report["ok"] else EXIT_DISAGREE


if __name__ == "__main__":
    sys.exit(main())
