"""Compile the real train step for a TPU topology on a host without TPUs (libtpu only).

`python tests/attention_aot.py` prints, for the 220M config on v5p:2x2x1 (bf16 compute, f32
params and AdamW state, FSDP over the 4 chips, about 16K tokens per chip), the compiled step's
temporary HBM per device (memory_analysis: exact for the compiled program), and XLA's cost model
(cost_analysis: FLOPs, bytes accessed and `optimal_seconds`, an estimate, never a measurement)
at T = 2048, 4096, 8192 with attention xla and splash. tests/test_model_attention.py uses
`compile_train_step` at a tiny size.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tpu_devices(topology: str):
    """The devices of a TPU topology (e.g. "v5p:2x2x1"), usable for AOT compilation only."""
    from jax.experimental import topologies
    # libtpu takes a host-wide lock on load unless told not to; compiling needs no TPU to own.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


def compile_train_step(overrides: list[str], devices, mesh_axes: dict[str, int]):
    """configs/220m.yaml with `overrides` -> the compiled train step (forward, backward, AdamW)
    on a (data, fsdp, tensor) mesh over `devices`."""
    import jax
    import jax.numpy as jnp

    from delta_jax.sharding import batch_sharding, make_mesh
    from delta_jax.train.config import load_config
    from delta_jax.train.optimizer import make_optimizer, schedules
    from delta_jax.train.state import (abstract_graph_and_params, abstract_state, state_specs,
                                       to_shardings)
    from delta_jax.train.step import make_train_step

    run = load_config(ROOT / "configs" / "220m.yaml", overrides)
    cfg, train = run.model, run.train
    mesh = make_mesh(**mesh_axes, devices=devices)
    tx = make_optimizer(run.optimizer, train.steps)
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    step = make_train_step(graphdef, tx, schedules(run.optimizer, train.steps), train.grad_accum,
                           shardings, mesh)
    batch = jax.ShapeDtypeStruct((train.batch_size, train.seq_len), jnp.int32,
                                 sharding=batch_sharding(mesh))
    with jax.set_mesh(mesh):
        return step.lower(abstract_state(cfg, tx, shardings),
                          {"input_ids": batch, "labels": batch}).compile()


def cost(compiled) -> dict:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per device program
        analysis = analysis[0]
    return analysis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    parser.add_argument("--kinds", default="xla,splash")
    parser.add_argument("--tokens-per-device", type=int, default=16384)
    parser.add_argument("--residual", default="delta_block")
    args = parser.parse_args()
    devices = tpu_devices(args.topology)
    n = len(devices)
    print(f"220M residual={args.residual} on {args.topology} ({n} devices, fsdp={n}), "
          f"{args.tokens_per_device} tokens/device, bf16 compute, f32 params")
    print("| T | batch | attention | temp HBM/device (GiB) | est. step (s) | bytes accessed (GB) "
          "| flops (T) | compile (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in map(int, args.seq_lens.split(",")):
        batch = args.tokens_per_device * n // seq
        for kind in args.kinds.split(","):
            start = time.perf_counter()
            compiled = compile_train_step(
                [f"model.attention={kind}", f"model.residual={args.residual}",
                 f"train.seq_len={seq}", f"train.batch_size={batch}"],
                devices, dict(data=1, fsdp=n, tensor=1))
            seconds = time.perf_counter() - start
            temp = compiled.memory_analysis().temp_size_in_bytes
            c = cost(compiled)
            print(f"| {seq} | {batch} | {kind} | {temp / 2**30:.2f} | "
                  f"{c.get('optimal_seconds', float('nan')):.4f} | "
                  f"{c.get('bytes accessed', float('nan')) / 1e9:.1f} | "
                  f"{c.get('flops', float('nan')) / 1e12:.1f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
