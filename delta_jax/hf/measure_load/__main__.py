"""Measure peak host memory and time of load_pretrained on a random checkpoint of a preset size.

  python -m delta_jax.hf.measure_load --preset qwen3-0.6b --stored-dtype bfloat16

Writes a random tied checkpoint (numpy, one tensor at a time) into a temporary folder, loads it in
a fresh subprocess and prints one JSON line: peak resident memory (VmHWM) before and after the
load, the loaded model's size and the load time. The file was just written, so it is read from
the page cache: the time excludes disk speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from delta_jax.cli import setup_logging
from delta_jax.config import DTYPES, PRESETS, ModelConfig
from delta_jax.hf.measure_load import load_and_measure, measure


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    parser = argparse.ArgumentParser(prog="python -m delta_jax.hf.measure_load",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="qwen3-0.6b")
    parser.add_argument("--num-layers", type=int, help="override the preset's layer count")
    parser.add_argument("--vocab-size", type=int, help="override the preset's vocabulary")
    parser.add_argument("--stored-dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # the fresh process of measure(): one JSON line for the parent
        print(json.dumps(load_and_measure(args.child)))
        return
    overrides = {k: v for k, v in (("num_layers", args.num_layers),
                                   ("vocab_size", args.vocab_size)) if v is not None}
    cfg = ModelConfig.preset(args.preset, residual="baseline", **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(cfg, args.stored_dtype, Path(tmp) / "model")
    gib = 2 ** 30
    print(json.dumps(result))
    print(f"{args.preset}: {result['file_bytes'] / gib:.2f} GiB {args.stored_dtype} file -> "
          f"{result['model_bytes'] / gib:.2f} GiB float32 model; peak RSS "
          f"{result['peak_rss_after'] / gib:.2f} GiB ({result['peak_rss_before'] / gib:.2f} "
          f"GiB before loading), load {result['load_seconds']:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
