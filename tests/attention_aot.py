"""Compile the real train step for a TPU topology on a host without TPUs (libtpu only).

`python tests/attention_aot.py` prints, for the 220M config on v5p:2x2x1 (bf16 compute, f32
params and AdamW state, FSDP over the 4 chips, about 16K tokens per chip), the compiled step's
temporary HBM per device (memory_analysis: exact for the compiled program), and XLA's cost model
(cost_analysis: FLOPs, bytes accessed and `optimal_seconds`, an estimate, never a measurement)
at T = 2048, 4096, 8192 with attention xla and splash, then the same for one attention call
alone (forward and backward). tests/test_model_attention.py uses `compile_train_step` at a tiny
size.

Two blind spots of XLA's cost model, worked around: it counts a while loop's body once, so the
estimates come from the unrolled layer driver (the temp memory is shown for the lean one too);
and it counts a Mosaic (Pallas) call as next to nothing, so splash's own work is added back
analytically (`splash_flops` at the chip's peak: a floor for the kernel's time, which real
kernels do not reach).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
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

    from delta_jax.data.pipeline import batch_keys
    from delta_jax.sharding import batch_sharding, make_mesh
    from delta_jax.train.config import load_config
    from delta_jax.train.optimizer import make_optimizer, schedules
    from delta_jax.train.state import (
        abstract_graph_and_params,
        abstract_state,
        state_specs,
        to_shardings,
    )
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
                          dict.fromkeys(batch_keys(run.data.packing), batch)).compile()


def splash_flops(num_layers: int, batch: int, seq: int, heads: int, head_dim: int,
                 block: int) -> float:
    """Matmul FLOPs of splash's forward and backward over all layers for `batch` rows: 9 products
    of [T,hd] x [hd,T] size (forward QK^T and PV; the dkv kernel recomputes QK^T, then dP, dV,
    dK; the dq kernel recomputes QK^T and dP, then dQ), each over the causal blocks only, a
    fraction (1 + block/T) / 2 of the square."""
    square = 2 * batch * heads * seq * seq * head_dim
    return num_layers * 9 * square * (1 + block / seq) / 2


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
    # jax names a v5p topology's devices "TPU v5", so the peak comes from the datasheet here.
    parser.add_argument("--peak-tflops", type=float, default=459.0,
                        help="bf16 peak per device (v5p: 459)")
    args = parser.parse_args()
    import jax

    from delta_jax.config import ModelConfig
    from delta_jax.model.attention_kernels import splash_block

    devices = tpu_devices(args.topology)
    n = len(devices)
    cfg = ModelConfig.paper_220m()
    peak = args.peak_tflops * 1e12
    kinds = args.kinds.split(",")

    def estimates(compiled, seq, batch, kind, layers, times=1) -> str:
        """est. step | + splash kernel at peak | bytes accessed | flops, per device, for `batch`
        rows per device, all multiplied by `times` (a program compiled for a part of the batch).
        """
        c = cost(compiled)
        estimate = c.get("optimal_seconds", float("nan"))
        kernel = (splash_flops(layers, batch, seq, cfg.num_heads, cfg.head_dim,
                               splash_block(seq)) / peak if kind == "splash" else 0.0)
        return (f"{times * estimate:.4f} | {times * (estimate + kernel):.4f} | "
                f"{times * c.get('bytes accessed', float('nan')) / 1e9:.1f} | "
                f"{times * c.get('flops', float('nan')) / 1e12:.2f}")

    temp = lambda compiled: f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f}"
    columns = ("est. step (s) | + splash kernel at peak (s) | bytes accessed/device (GB) | "
               "XLA flops/device (T)")
    # XLA's cost analysis counts a while loop's body once, so the scanned layer drivers would
    # show one layer's cost: the estimates come from the unrolled driver, the memory from both.
    print(f"Train step: 220M residual={args.residual} on {args.topology} ({n} devices, "
          f"fsdp={n}), {args.tokens_per_device} tokens/device, bf16 compute, f32 params, "
          f"peak {peak / 1e12:.0f} TFLOP/s/device; estimates of the unrolled program")
    print(f"| T | batch/device | attention | temp HBM/device, lean (GiB) | temp, unrolled (GiB) | "
          f"{columns} |\n" + "|---" * 9 + "|")
    for seq in map(int, args.seq_lens.split(",")):
        batch = args.tokens_per_device * n // seq
        for kind in kinds:
            step = lambda driver, rows: compile_train_step(
                [f"model.attention={kind}", f"model.residual={args.residual}",
                 f"model.layer_driver={driver}", f"train.seq_len={seq}",
                 f"train.batch_size={rows}"], devices, dict(data=1, fsdp=n, tensor=1))
            lean = step("lean", batch)
            try:
                unrolled, times = step("unrolled", batch), 1
                unrolled_temp = temp(unrolled)
            except jax.errors.JaxRuntimeError as error:
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                # Too big for HBM unrolled: estimate from half the batch, doubled (which counts
                # the batch-independent optimizer update twice, a small part of the step).
                needed = re.search(r"temporaries \(([0-9.]+\w)\)", str(error))
                unrolled_temp = f"does not fit ({needed.group(1) if needed else '?'}iB)"
                unrolled, times = step("unrolled", batch // 2), 2
            print(f"| {seq} | {batch // n} | {kind} | {temp(lean)} | {unrolled_temp} | "
                  f"{estimates(unrolled, seq, batch // n // times, kind, cfg.num_layers, times)}"
                  f"{' (half batch x2)' if times > 1 else ''} |", flush=True)

    print(f"\nOne attention call (q [B,T,{cfg.num_heads},{cfg.head_dim}], kv "
          f"{cfg.num_kv_heads} heads, bf16), forward and backward, same batch per device:")
    print(f"| T | batch/device | attention | temp HBM/device (GiB) | {columns} |\n"
          + "|---" * 8 + "|")
    for seq in map(int, args.seq_lens.split(",")):
        batch = args.tokens_per_device * n // seq
        for kind in kinds:
            compiled = compile_attention(cfg, kind, batch, seq, devices)
            print(f"| {seq} | {batch // n} | {kind} | {temp(compiled)} | "
                  f"{estimates(compiled, seq, batch // n, kind, 1)} |", flush=True)


def compile_attention(cfg, kind: str, batch: int, seq: int, devices):
    """grad of sum(attention(q, k, v)) for one layer's shapes, batch split over all devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from delta_jax.model.attention_kernels import causal_attention
    from delta_jax.sharding import make_mesh

    mesh = make_mesh(1, len(devices), 1, devices=devices)
    sharding = NamedSharding(mesh, P("fsdp"))
    attend = lambda q, k, v: causal_attention(q, k, v, kind=kind, scale=cfg.head_dim ** -0.5)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    args = [jax.ShapeDtypeStruct((batch, seq, heads, cfg.head_dim), jnp.bfloat16,
                                 sharding=sharding)
            for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)]
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
