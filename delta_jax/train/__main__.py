"""`python -m delta_jax.train --config configs/NAME.yaml [section.key=value ...]`."""
from __future__ import annotations

import argparse
import sys

from delta_jax.cli import (
    enable_compilation_cache,
    exit_with_error,
    initialize_distributed,
    setup_logging,
)
from delta_jax.train.config import load_config


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    parser = argparse.ArgumentParser(
        prog="python -m delta_jax.train",
        description="Pretrain or fine-tune a Delta Attention Residuals model on a device mesh.",
        epilog="Overrides name any config field, e.g. model.residual=delta train.steps=100 "
               "mesh.fsdp=8 optimizer.lr=3e-4 train.init_from=ckpt/qwen3-0.6b.")
    parser.add_argument("--config", help="a YAML run file (configs/*.yaml); defaults otherwise")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (OSError, ValueError) as e:
        exit_with_error(str(e))
    if args.print_config:
        from delta_jax.train.config import dump_config

        print(dump_config(cfg), end="")
        return
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    if cfg.distributed.enabled:
        initialize_distributed(cfg.distributed.coordinator_address,
                               cfg.distributed.num_processes, cfg.distributed.process_id)
    import jax

    from delta_jax.train import faults
    from delta_jax.train.loop import run, summary_table

    # Exit codes: docs/recovery.md and delta_jax/train/faults.py.
    try:
        summary = run(cfg)
    except faults.PreflightError as e:
        exit_with_error(str(e))
    except faults.Preempted as e:
        print(e, flush=True)
        sys.exit(faults.EXIT_PREEMPTED)
    except faults.NonFiniteStop as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(faults.EXIT_NONFINITE)
    if jax.process_index() == 0:
        print(summary_table(summary), flush=True)


if __name__ == "__main__":
    main()
