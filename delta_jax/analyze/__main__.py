"""What the routing learned: `python -m delta_jax.analyze --model PATH [...] --data ...`."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

from delta_jax.analyze import format_table, plot_heatmap, plot_max_weight, routing_statistics
from delta_jax.cli import (
    add_parallel_arguments,
    enable_compilation_cache,
    mesh_from_args,
    setup_logging,
    start_processes,
)
from delta_jax.config import DTYPES
from delta_jax.eval import read_stream
from delta_jax.loading import load_model, load_tokenizer


def _labels(paths: Sequence[str], given: Sequence[str] | None,
            residuals: Sequence[str]) -> list[str]:
    if given:
        if len(given) != len(paths):
            raise ValueError(f"{len(given)} --label for {len(paths)} --model: give one per model")
        return list(given)
    if len(set(residuals)) == len(residuals):
        return list(residuals)
    return [Path(p).name for p in paths]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m delta_jax.analyze", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, action="append",
                        help="checkpoint dir, run folder or Hugging Face folder (repeatable)")
    parser.add_argument("--label", action="append", help="name per --model (default: residual)")
    parser.add_argument("--data", required=True, nargs="+",
                        help="embedded (the demo's corpus), a prepared directory, tfds:NAME?..., "
                             "or text/JSONL/Parquet files")
    parser.add_argument("--split", default="validation", help="split of a prepared dir / TFDS")
    parser.add_argument("--tokenizer", help="byte, qwen3 or a tokenizer.json (default: the "
                        "model folder's, or the prepared data's)")
    parser.add_argument("--seq-len", type=int, default=512, help="window length")
    parser.add_argument("--max-windows", type=int, default=16, help="windows to analyze")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtype", choices=DTYPES)
    add_parallel_arguments(parser)
    parser.add_argument("--out", default="analysis", help="directory for routing.json and PNGs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict]:
    setup_logging()
    enable_compilation_cache()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for name in ("seq_len", "max_windows", "batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected a "
                                 "positive integer")
        start_processes(args)
        mesh = mesh_from_args(args)
        results = []
        for path in args.model:
            tokenizer = load_tokenizer(path, args.tokenizer or None)
            model = load_model(path, mesh=mesh, **({"dtype": args.dtype} if args.dtype else {}))
            stream = read_stream(args.data, tokenizer=tokenizer, split=args.split,
                                 max_tokens=args.seq_len * args.max_windows)
            try:
                results.append({"model": path, **routing_statistics(
                    model, stream, seq_len=args.seq_len, max_windows=args.max_windows,
                    batch_size=args.batch_size)})
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
        labels = _labels(args.model, args.label, [r["residual"] for r in results])
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    for label, result in zip(labels, results):
        result["label"] = label
    if jax.process_index() != 0:  # every process computed the same statistics; one writes them
        return results
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for result in results:
        plot_heatmap(result, out / f"heatmap_{result['label']}.png")
    plot_max_weight(results, out / "max_weight.png")
    (out / "routing.json").write_text(json.dumps({"models": results}, indent=1) + "\n")
    if args.json:
        print(json.dumps({"models": results}, indent=1))
    else:
        print("\n\n".join(format_table(r) for r in results))
        print(f"\nwrote {out / 'routing.json'}, {out / 'max_weight.png'} and heatmaps",
              file=sys.stderr)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
