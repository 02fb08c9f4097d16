"""Perplexity and bits per byte of held-out text: `python -m delta_jax.eval --model PATH --data`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

from delta_jax.cli import (
    add_model_arguments,
    enable_compilation_cache,
    setup_logging,
    start_processes,
)
from delta_jax.data.pipeline import PACKINGS
from delta_jax.eval import perplexity, read_stream
from delta_jax.loading import load_model_from_args, run_config, tokenizer_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m delta_jax.eval", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, nargs="+",
                        help="embedded (the demo's corpus), a prepared directory, "
                             "tfds:NAME?data_dir=..&tokenizer=.., or text/JSONL/Parquet files")
    parser.add_argument("--split", default="validation", help="split of a prepared dir / TFDS")
    parser.add_argument("--tokenizer", help="byte, qwen3 or a tokenizer.json (default: the "
                        "model folder's, or the prepared data's)")
    parser.add_argument("--seq-len", type=int, default=2048, help="window length T")
    parser.add_argument("--stride", type=int, help="tokens between window starts (default T)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--packing", choices=PACKINGS,
                        help="concat lets a window's documents attend to each other, documents "
                             "keeps them apart (default: the training run's data.packing, "
                             "read from its config.yaml; concat for other models)")
    parser.add_argument("--max-tokens", type=int, help="read at most this many tokens")
    parser.add_argument("--output", help="also write the JSON result to this file")
    return parser


def run_packing(model: str) -> str:
    """The packing `model` was trained with: its run's data.packing (a run saved before that key
    ran with concat), concat for a model without a run; said on stderr."""
    run = run_config(model)
    if run is None:
        packing, why = "concat", "no training run's config.yaml beside the model"
    else:
        packing, why = (run.get("data") or {}).get("packing", "concat"), "the run's data.packing"
    logging.getLogger("delta_jax.eval").info("packing: %s (%s; --packing overrides)", packing,
                                             why)
    return packing


def main(argv: Sequence[str] | None = None) -> dict:
    setup_logging()
    enable_compilation_cache()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for name in ("seq_len", "batch_size", "stride", "max_tokens"):
            if (value := getattr(args, name)) is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value}: expected a positive integer")
        start_processes(args)
        tokenizer = tokenizer_from_args(args)
        model = load_model_from_args(args)
        stream = read_stream(args.data, tokenizer=tokenizer, split=args.split,
                             max_tokens=args.max_tokens)
        packing = args.packing or run_packing(args.model)
        result = {"model": args.model, **perplexity(model, stream, seq_len=args.seq_len,
                                                    stride=args.stride,
                                                    batch_size=args.batch_size,
                                                    packing=packing)}
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if jax.process_index() == 0:  # every process computed the same result
        text = json.dumps(result, indent=1)
        print(text)
        if args.output:
            Path(args.output).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
