"""Convert checkpoints: a Hugging Face folder <-> an Orbax checkpoint the trainer fine-tunes from.

  python -m delta_jax.convert hf-to-orbax Qwen3-0.6B ckpt/qwen3-0.6b-delta-block \\
      --residual delta_block --num-blocks 4 --preserve-function
  python -m delta_jax.convert orbax-to-hf ckpt/run out/qwen3-0.6b-delta-block [--step 20000]

hf-to-orbax writes step 0 in the layout of delta_jax.checkpoint and copies the folder's tokenizer
files into <orbax dir>/tokenizer; orbax-to-hf copies them back from there (or --tokenizer-from),
or writes the tokenizer of a trainer run's data (byte for the demo).
--mesh DATA,FSDP,TENSOR shards the model over the devices while it passes through; orbax-to-hf
also runs as several processes (launch/local.sh N --module delta_jax.convert orbax-to-hf ...,
or --distributed), gathering one tensor at a time for process 0 to write. Bad input is reported
as one line on stderr with exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from delta_jax.checkpoint import TOKENIZER_DIR
from delta_jax.cli import (
    add_parallel_arguments,
    enable_compilation_cache,
    mesh_from_args,
    setup_logging,
    start_processes,
)
from delta_jax.config import BLOCK_SOURCES, DTYPES, GATE_BASES, RESIDUALS, ROUTER_INITS
from delta_jax.convert import hf_to_orbax, orbax_to_hf
from delta_jax.hf.keymap import ConversionError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m delta_jax.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    to_orbax = commands.add_parser("hf-to-orbax", help="Hugging Face folder -> Orbax checkpoint")
    to_orbax.add_argument("source", type=Path, help="Hugging Face model folder")
    to_orbax.add_argument("target", type=Path, help="new Orbax checkpoint directory")
    to_orbax.add_argument("--residual", choices=RESIDUALS,
                          help="convert a plain Qwen3 into this variant")
    to_orbax.add_argument("--num-blocks", type=int, help="blocks of the block variants")
    to_orbax.add_argument("--block-sources", choices=BLOCK_SOURCES)
    to_orbax.add_argument("--router-init", choices=ROUTER_INITS)
    to_orbax.add_argument("--null-source", action="store_true", default=None,
                          help="add the learned null source (delta modes)")
    to_orbax.add_argument("--routing-gate", action="store_true", default=None,
                          help="add the zero-initialised gate on the routed term")
    to_orbax.add_argument("--gate-base", choices=GATE_BASES,
                          help="what block/full gates blend with: the live state (reference) "
                               "or the residual stream")
    to_orbax.add_argument("--preserve-function", action="store_true",
                          help="initialise routing so that step 0 computes the original model")
    to_orbax.add_argument("--param-dtype", choices=DTYPES, default="float32",
                          help="stored parameter dtype (default float32, master weights)")
    add_parallel_arguments(to_orbax, distributed=False)

    to_hf = commands.add_parser("orbax-to-hf", help="Orbax checkpoint -> Hugging Face folder")
    to_hf.add_argument("source", type=Path, help="Orbax checkpoint directory")
    to_hf.add_argument("target", type=Path, help="Hugging Face folder to write (replaced)")
    to_hf.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    to_hf.add_argument("--dtype", choices=DTYPES, help="stored dtype (default: param dtype)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    to_hf.add_argument("--tokenizer-from",
                       help=f"folder with tokenizer files, a tokenizer.json or 'byte' (default: "
                            f"<source>/{TOKENIZER_DIR}, else the tokenizer of the run's data)")
    add_parallel_arguments(to_hf)
    return parser


def _hf_to_orbax(args: argparse.Namespace) -> None:
    overrides = {field: getattr(args, field) for field in (
        "residual", "num_blocks", "block_sources", "router_init", "null_source", "routing_gate",
        "gate_base") if getattr(args, field) is not None}
    model = hf_to_orbax(args.source, args.target, param_dtype=args.param_dtype, progress=True,
                        preserve_function=args.preserve_function, mesh=mesh_from_args(args),
                        **overrides)
    tokenizer = args.target / TOKENIZER_DIR
    copied = len(list(tokenizer.iterdir())) if tokenizer.is_dir() else 0
    print(f"wrote {args.target} (step 0, residual={model.config.residual}, "
          f"{copied} tokenizer files)")


def _orbax_to_hf(args: argparse.Namespace) -> None:
    start_processes(args)
    main_process = jax.process_index() == 0
    model = orbax_to_hf(args.source, args.target, step=args.step, dtype=args.dtype,
                        max_shard_size=args.max_shard_size, tokenizer_from=args.tokenizer_from,
                        progress=main_process, mesh=mesh_from_args(args))
    if main_process:
        print(f"wrote {args.target} (model_type "
              f"{'qwen3' if model.config.residual == 'baseline' else 'qwen3_attnres'})")


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    enable_compilation_cache()
    args = _parser().parse_args(argv)
    try:
        {"hf-to-orbax": _hf_to_orbax, "orbax-to-hf": _orbax_to_hf}[args.command](args)
    except (ConversionError, OSError, ValueError) as err:
        message = " ".join(str(err).split())  # one line, whatever the exception's layout
        print(f"delta_jax.convert: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
