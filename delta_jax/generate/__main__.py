"""Sampling with a KV cache: `python -m delta_jax.generate --model PATH --prompt TEXT`."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence

import jax

from delta_jax.cli import (
    add_model_arguments,
    enable_compilation_cache,
    setup_logging,
    start_processes,
)
from delta_jax.data.tokenizers import Tokenizer
from delta_jax.generate import Sampling, decode_memory, generate
from delta_jax.loading import load_model_from_args, tokenizer_from_args


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m delta_jax.generate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompts.add_argument("--prompt-ids", action="append",
                         help="prompt token ids like 1,2,3 (repeat for a batch)")
    parser.add_argument("--tokenizer", help="byte, qwen3 or a tokenizer.json (default: the model "
                        "folder's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=2048,
                        help="context length: prompt + new tokens may not exceed it")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 keeps every token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos-id", type=int, help="stop token (default: the tokenizer's EOS)")
    parser.add_argument("--benchmark", action="store_true",
                        help="run twice and time the second (compiled) run")
    parser.add_argument("--memory", action="store_true",
                        help="report the KV cache's and one decode step's memory")
    parser.add_argument("--json", action="store_true", help="print ids and text as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    setup_logging()
    enable_compilation_cache()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        start_processes(args)
        tokenizer = tokenizer_from_args(args)
        model = load_model_from_args(args)
        prompts = _prompts(args, tokenizer)
        sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p)
        eos_id = args.eos_id
        if eos_id is None and tokenizer is not None:
            eos_id = tokenizer.eos_id
        run = functools.partial(generate, model, prompts, max_new_tokens=args.max_new_tokens,
                                sampling=sampling, seed=args.seed, eos_id=eos_id,
                                max_length=args.max_length)
        out = run()
        first_seconds = out.seconds
        if args.benchmark:
            out = run()
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    new_tokens = int(out.lengths.sum())
    result = {"model": args.model, "residual": model.config.residual,
              "sampling": dataclasses.asdict(sampling), "results": [],
              "new_tokens": new_tokens, "seconds": out.seconds, "first_call_seconds": first_seconds,
              "tokens_per_second": new_tokens / out.seconds}
    for b, prompt in enumerate(prompts):
        ids = out.row(b)
        text = ids[:-1] if ids and ids[-1] == eos_id else ids  # the text leaves out the EOS
        result["results"].append({"prompt_ids": list(prompt), "ids": ids,
                                  "text": tokenizer.decode(text) if tokenizer else None})
    if args.memory:
        result["memory"] = decode_memory(model, len(prompts),
                                         max(map(len, prompts)) + args.max_new_tokens)
    if jax.process_index() != 0:  # every process decoded the same tokens; one prints them
        return result
    if args.json:
        print(json.dumps(result))
    else:
        for b, item in enumerate(result["results"]):
            if tokenizer:  # the prompt, then its continuation
                print(f"[{b}] {tokenizer.decode(item['prompt_ids'])}{item['text']}")
            else:
                print(f"[{b}] {','.join(map(str, item['prompt_ids']))} -> "
                      f"{','.join(map(str, item['ids']))}")
        print(f"{new_tokens} tokens in {out.seconds:.2f} s ({result['tokens_per_second']:.1f} "
              f"tokens/s{'' if args.benchmark else ', compilation included'})", file=sys.stderr)
        if args.memory:
            print(json.dumps(result["memory"]), file=sys.stderr)
    return result


def _prompts(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[list[int]]:
    if args.prompt_ids:
        return [_parse_ids(text) for text in args.prompt_ids]
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer found for --prompt: pass --tokenizer, or "
                         "give token ids with --prompt-ids")
    return [tokenizer.encode(text) for text in args.prompt]


if __name__ == "__main__":
    main(sys.argv[1:])
