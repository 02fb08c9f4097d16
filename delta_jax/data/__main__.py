"""`python -m delta_jax.data {prepare,verify,corpus}`: build, check and locate token shards."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from delta_jax.cli import setup_logging


def _prepare(args: argparse.Namespace) -> None:
    from delta_jax.data.prepare import prepare

    start = time.perf_counter()
    meta = prepare(args.input, args.output, tokenizer=args.tokenizer,
                   validation_fraction=args.validation_fraction, text_field=args.text_field,
                   record_tokens=args.record_tokens, shard_tokens=args.shard_tokens,
                   workers=args.workers)
    seconds = time.perf_counter() - start
    tokens = sum(s["num_tokens"] for s in meta["splits"].values())
    for name, split in meta["splits"].items():
        print(f"{name}: {split['num_documents']} documents, {split['num_tokens']} tokens, "
              f"{len(split['shards'])} shards")
    print(f"{tokens} tokens in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s) -> {args.output}")


def _verify(args: argparse.Namespace) -> None:
    from delta_jax.data.pipeline import verify

    meta = verify(args.data_dir)
    shards = sum(len(s["shards"]) for s in meta["splits"].values())
    print(f"{args.data_dir}: {shards} shards match {json.dumps(meta['tokenizer'])}")


def _corpus(args: argparse.Namespace) -> None:
    from delta_jax.data.corpus import default_prepared_data

    print(default_prepared_data(args.cache_dir))


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    parser = argparse.ArgumentParser(prog="python -m delta_jax.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("prepare",
                            help="tokenise text/JSONL/Parquet files into ArrayRecord shards",
                            description="Tokenise documents, join them with EOS, hold out a "
                            "validation split by document, and write ArrayRecord shards with "
                            "metadata.json (format: delta_jax/data/prepare.py).")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=".txt/.md (one document per file), .jsonl, .parquet files or directories")
    p.add_argument("--tokenizer", default="byte",
                   help="byte, qwen3, or a tokenizer.json path (default: byte)")
    p.add_argument("--output", required=True, metavar="DIR", help="new directory for the shards")
    p.add_argument("--text-field", default="text",
                   help="JSONL field / Parquet column (default: text)")
    p.add_argument("--validation-fraction", type=float, default=0.01,
                   help="share of documents held out for validation (default: 0.01)")
    p.add_argument("--record-tokens", type=int, default=8192,
                   help="tokens per ArrayRecord record, the unit of a random read (default: 8192)")
    p.add_argument("--shard-tokens", type=int, default=1 << 26,
                   help="tokens per shard file (default: 67108864)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenising processes; 0 tokenises in this one (default: all cores)")
    p.set_defaults(run=_prepare)

    v = commands.add_parser("verify",
                            help="check a prepared directory's shards against metadata.json")
    v.add_argument("data_dir", metavar="DIR")
    v.set_defaults(run=_verify)

    c = commands.add_parser("corpus", help="build the embedded default corpus (byte tokenizer) "
                            "if needed and print its prepared directory")
    c.add_argument("--cache-dir", default="data/cache", metavar="DIR", help="(default: data/cache)")
    c.set_defaults(run=_corpus)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
