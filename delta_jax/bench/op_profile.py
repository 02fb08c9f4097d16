"""Where a compiled forward + backward spends its time, op by op (jax.profiler on this backend).

    python -m delta_jax.bench.op_profile [--config configs/bench_cpu.yaml] [--top 8]
        [--json OUT] [section.key=value ...]

Traces one call of the jitted loss-and-gradients of the config's model (after two warm-up
calls), reads the per-op events of the trace, and sums their durations by kind, using the
compiled HLO to tell the kinds apart:

- matmuls: fusions that contain a dot;
- layout changes: elementwise fusions that also transpose or copy their result into another
  layout (on XLA:CPU, the operands of the weight-gradient matmuls);
- other elementwise and reductions.

Durations are summed over the backend's threads, so their total exceeds the wall time; the
shares are what to read. Written to find why the CPU backward costs 3.5-4.4 forwards where
eager PyTorch's costs 1.5 (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from delta_jax.model.causal_lm import init_model
from delta_jax.train.config import load_config

KINDS = ("matmuls", "layout changes", "other elementwise and reductions")


def op_sources(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the JAX operation it came from (its op_name metadata, shortened)."""
    return {name: re.sub(r"jit\([^)]*\)/|while/body/|closed_call/", "", source)[-70:]
            for name, source in re.findall(
                r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text, re.M)}


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> kind, for the fusions (and bare dots) of a compiled HLO module."""
    bodies = {m.group(1): m.group(0)
              for m in re.finditer(r"^%([\w.\-]+) \(.*?\n}\n", hlo_text, re.S | re.M)}
    kinds = {}
    for name, called in re.findall(r"%([\w.\-]+) = [^\n]*? fusion\([^\n]*?calls=%([\w.\-]+)",
                                   hlo_text):
        body = bodies.get(called, "")
        if " dot(" in body:
            kinds[name] = KINDS[0]
        elif " transpose(" in body or " copy(" in body:
            kinds[name] = KINDS[1]
        else:
            kinds[name] = KINDS[2]
    for name in re.findall(r"^\s*%(dot(?:\.\d+)?) = ", hlo_text, re.M):
        kinds[name] = KINDS[0]
    return kinds


def op_seconds(trace_dir: Path, names: set[str]) -> collections.Counter:
    """Summed duration (s) of each op in `names` over the trace's complete events."""
    found = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: the profiler wrote no *.trace.json.gz")
    data = json.loads(gzip.decompress(found[-1].read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    seconds = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in names and "dur" in event:
            seconds[event["name"]] += event["dur"] * 1e-6
    return seconds


def profile(run, top: int) -> dict[str, Any]:
    cfg = run.model
    graphdef, params, rest = nnx.split(init_model(cfg, 0), nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(0), (run.train.batch_size, run.train.seq_len + 1),
                             0, cfg.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), ids[:, 1:]).mean()

    grads = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    for _ in range(2):
        jax.block_until_ready(grads(params))
    hlo_text = grads.as_text()
    kinds, sources = op_kinds(hlo_text), op_sources(hlo_text)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            jax.block_until_ready(grads(params))
            wall = time.perf_counter() - start
        seconds = op_seconds(Path(tmp), set(kinds))
    total = sum(seconds.values())
    if not total:
        raise RuntimeError("the trace holds none of the compiled program's ops: this backend's "
                           "profiler does not report them")
    by_kind = {kind: sum(s for name, s in seconds.items() if kinds[name] == kind)
               for kind in KINDS}
    return {"wall_s": wall, "op_s": total,
            "kinds": [{"kind": k, "op_s": s, "share": s / total} for k, s in by_kind.items()],
            "top": [{"op": name, "kind": kinds[name], "source": sources.get(name, "?"),
                     "op_s": s, "share": s / total} for name, s in seconds.most_common(top)]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m delta_jax.bench.op_profile",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench_cpu.yaml")
    parser.add_argument("--top", type=int, default=8, help="slowest ops to list")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    run = load_config(args.config, args.overrides)
    result = profile(run, args.top)
    print(f"{run.model.residual}, {run.model.num_layers} layers, d {run.model.hidden_size}, "
          f"{run.train.batch_size} x {run.train.seq_len} tokens, {run.model.dtype}, "
          f"{run.model.layer_driver} driver on {jax.devices()[0].device_kind}: forward + "
          f"backward {result['wall_s']:.3f} s wall, {result['op_s']:.3f} s of ops "
          "(summed over threads)")
    for row in result["kinds"]:
        print(f"  {row['share']:6.1%}  {row['op_s']:8.3f} s  {row['kind']}")
    print("slowest ops:")
    for row in result["top"]:
        print(f"  {row['share']:6.1%}  {row['op_s']:8.3f} s  {row['op']} ({row['kind']}): "
              f"{row['source']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
