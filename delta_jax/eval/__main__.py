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
    parser.add_argument("--seq-len", type=int, help="window length T (default: the training "
                        "run's train.seq_len; 2048 for other models)")
    parser.add_argument("--stride", type=int, help="tokens between window starts (default T)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--packing", choices=PACKINGS,
                        help="concat lets a window's documents attend to each other, documents "
                             "keeps them apart (default: the training run's data.packing, "
                             "read from its config.yaml; concat for other models)")
    parser.add_argument("--max-tokens", type=int, help="read at most this many tokens")
    parser.add_argument("--output", help="also write the JSON result to this file")
    return parser


def run_settings(model: str) -> tuple[str, int]:
    """(packing, seq_len) as `model` was trained: its run's data.packing and train.seq_len (a
    run saved before data.packing existed ran with concat); concat and 2048 for a model without
    a run. Said on stderr. With them, and the trainer's number of validation tokens, eval gives
    the trainer's validation perplexity."""
    run = run_config(model)
    if run is None:
        packing, seq_len, why = "concat", 2048, "no training run's config.yaml beside the model"
    else:
        packing = (run.get("data") or {}).get("packing", "concat")
        seq_len = (run.get("train") or {}).get("seq_len", 2048)
        why = "the run's data.packing and train.seq_len"
    logging.getLogger("delta_jax.eval").info(
        "packing: %s, seq_len: %d (%s; --packing and --seq-len override)", packing, seq_len, why)
    return packing, seq_len


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
        packing, seq_len = run_settings(args.model)
        packing, seq_len = args.packing or packing, args.seq_len or seq_len
        result = {"model": args.model, **perplexity(model, stream, seq_len=seq_len,
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
