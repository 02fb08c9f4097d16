"""Where a CPU train step's time goes, next to eager PyTorch at the same shape.

    python -m delta_jax.bench.versus_torch [--config configs/bench_cpu.yaml] [--steps 5]
        [--warmup 2] [--json OUT] [section.key=value ...]

The baseline Qwen3 of the config (float32) in both frameworks: transformers' Qwen3ForCausalLM
(eager PyTorch, what the reference code builds on) and delta_jax's CausalLM with the same
weights. One row per piece of the step, median seconds of each side and their ratio:

- one MLP-shaped matmul ([B*T, D] x [D, I], the step's most common GEMM), x 10;
- one layer's causal attention, forward + backward (PyTorch's fused scaled_dot_product_attention
  against XLA's, which materialises the [B,H,T,T] probabilities);
- the forward pass (logits);
- forward + backward (the loss's gradients): delta_jax under the lean driver, whose backward
  recomputes each layer, and under the scan driver, which keeps every layer's activations as
  PyTorch's autograd does;
- the whole train step (+ clipping at 1.0 and AdamW): delta_jax's own jitted step
  (delta_jax.train.step, lean driver) against loss.backward(), clip_grad_norm_ and
  torch.optim.AdamW.step().

Both sides use every core (torch.get_num_threads(), XLA's CPU thread pool). Needs torch and
transformers (requirements-test.txt).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax.bench import bench_one
from delta_jax.hf.keymap import config_to_hf
from delta_jax.hf.state_dict import from_state_dict
from delta_jax.model.attention_kernels import causal_attention
from delta_jax.train.config import RunConfig, load_config


def median_seconds(fn: Callable[[], Any], steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_model(run: RunConfig):
    import torch
    import transformers

    cfg = run.model.replace(residual="baseline")
    torch.manual_seed(run.seed)
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config_to_hf(cfg).items()
                                            if k not in ("architectures", "model_type")})
    return transformers.Qwen3ForCausalLM(hf_config).float().train()


def measure(run: RunConfig, steps: int, warmup: int) -> list[dict[str, Any]]:
    import torch

    cfg, train = run.model.replace(residual="baseline", dtype="float32"), run.train
    batch, length = train.batch_size, train.seq_len
    ids_np = np.random.default_rng(run.seed).integers(0, cfg.vocab_size, (batch, length))
    rows: list[dict[str, Any]] = []

    def row(what: str, torch_s: float, jax_s: float, note: str = ""):
        rows.append({"what": what, "torch_s": torch_s, "jax_s": jax_s,
                     "ratio": jax_s / torch_s, "note": note})
        print(f"{what:40} torch {torch_s:8.4f} s   delta_jax {jax_s:8.4f} s   "
              f"{jax_s / torch_s:5.2f}x  {note}", flush=True)

    # One matmul of the MLP's shape, ten times per call (a call's fixed cost out of the way).
    a_np = np.random.default_rng(1).standard_normal((batch * length, cfg.hidden_size),
                                                    np.float32)
    b_np = np.random.default_rng(2).standard_normal((cfg.hidden_size, cfg.intermediate_size),
                                                    np.float32)
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    a_j, b_j = jnp.asarray(a_np), jnp.asarray(b_np)
    matmuls = jax.jit(lambda a, b: sum(jnp.tanh((a + i) @ b)[0, 0] for i in range(10)))
    matmuls(a_j, b_j).block_until_ready()
    row(f"matmul [{batch * length},{cfg.hidden_size}]x[{cfg.hidden_size},"
        f"{cfg.intermediate_size}] x10",
        median_seconds(lambda: sum(torch.tanh((a_t + i) @ b_t)[0, 0] for i in range(10)),
                       steps, warmup),
        median_seconds(lambda: matmuls(a_j, b_j).block_until_ready(), steps, warmup))

    # One layer's causal attention, forward + backward: PyTorch's fused SDPA kernel (what
    # transformers' Qwen3 calls) against XLA's dot_product_attention, which materialises the
    # [B,H,T,T] logits and probabilities.
    heads, groups = cfg.num_heads, cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    qkv_np = [np.random.default_rng(3 + i).standard_normal(
        (batch, length, n, cfg.head_dim), np.float32) for i, n in
        enumerate((heads, cfg.num_kv_heads, cfg.num_kv_heads, heads))]
    q_t, k_t, v_t = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in qkv_np[:3])
    cot_t = torch.from_numpy(qkv_np[3]).transpose(1, 2)

    def torch_attention():
        out = torch.nn.functional.scaled_dot_product_attention(
            q_t, k_t.repeat_interleave(groups, 1), v_t.repeat_interleave(groups, 1),
            is_causal=True, scale=scale)
        return torch.autograd.grad((out * cot_t).sum(), (q_t, k_t, v_t))

    attention_grads = jax.jit(jax.grad(
        lambda q, k, v, cot: jnp.sum(causal_attention(q, k, v, kind="xla", scale=scale) * cot),
        argnums=(0, 1, 2)))
    qkv_j = [jnp.asarray(x) for x in qkv_np]
    grad_gap = max(float(np.max(np.abs(np.asarray(g_j) - g_t.transpose(1, 2).numpy())))
                   for g_j, g_t in zip(attention_grads(*qkv_j), torch_attention()))
    row(f"attention fwd+bwd, one layer (x{cfg.num_layers})",
        median_seconds(torch_attention, steps, warmup),
        median_seconds(lambda: jax.block_until_ready(attention_grads(*qkv_j)), steps, warmup),
        f"torch SDPA vs XLA dot_product_attention; max |grad gap| {grad_gap:.1e}")
    rows[-1]["max_grad_gap"] = grad_gap

    model_t = torch_model(run)
    state_dict = {k: v.detach().numpy() for k, v in model_t.state_dict().items()}
    ids_t = torch.from_numpy(ids_np)
    ids_j = jnp.asarray(ids_np, jnp.int32)

    def torch_forward():
        with torch.no_grad():
            return model_t(ids_t).logits

    def torch_loss():
        logits = model_t(ids_t).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids_t[:, 1:].reshape(-1))

    def torch_backward():
        model_t.zero_grad(set_to_none=True)
        torch_loss().backward()

    optimizer = torch.optim.AdamW(model_t.parameters(), lr=run.optimizer.lr, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=run.optimizer.weight_decay)

    def torch_step():
        optimizer.zero_grad(set_to_none=True)
        torch_loss().backward()
        torch.nn.utils.clip_grad_norm_(model_t.parameters(), run.optimizer.clip_norm)
        optimizer.step()

    def jax_parts(driver: str):
        model = from_state_dict(config_to_hf(cfg), state_dict, layer_driver=driver,
                                dtype="float32")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        forward = jax.jit(lambda p, ids: nnx.merge(graphdef, p, rest)(ids))

        def loss(p, ids):
            logits = nnx.merge(graphdef, p, rest)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], ids[:, 1:]).mean()

        grads = jax.jit(jax.value_and_grad(loss))
        return forward, grads, params

    forward_j, grads_lean, params = jax_parts("lean")
    _, grads_scan, _ = jax_parts("scan")
    logits_j = forward_j(params, ids_j).block_until_ready()
    gap = float(np.max(np.abs(np.asarray(logits_j) - torch_forward().numpy())))
    row("forward (logits)", median_seconds(torch_forward, steps, warmup),
        median_seconds(lambda: forward_j(params, ids_j).block_until_ready(), steps, warmup),
        f"same weights: max |logit gap| {gap:.1e}")
    rows[-1]["max_logit_gap"] = gap
    torch_backward_s = median_seconds(torch_backward, steps, warmup)
    for name, fn in (("lean", grads_lean), ("scan", grads_scan)):
        fn(params, ids_j)[0].block_until_ready()
        row(f"forward + backward ({name} driver)", torch_backward_s,
            median_seconds(lambda f=fn: jax.block_until_ready(f(params, ids_j)), steps, warmup),
            "recomputes each layer's forward" if name == "lean" else
            "keeps every layer's activations")
    step = bench_one(RunConfig(**{**vars(run), "model": cfg.replace(layer_driver="lean")}),
                     steps=steps, warmup=warmup, compile_only=False)
    row("train step (+ clip, AdamW; lean driver)", median_seconds(torch_step, steps, warmup),
        step["step_time_s"])
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m delta_jax.bench.versus_torch",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench_cpu.yaml")
    parser.add_argument("--steps", type=int, default=5, help="timed calls (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    run = load_config(args.config, args.overrides)
    import torch

    print(f"{run.model.num_layers} layers, d {run.model.hidden_size}, "
          f"{run.train.batch_size} x {run.train.seq_len} tokens, float32; torch "
          f"{torch.__version__} on {torch.get_num_threads()} threads, jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}")
    rows = measure(run, args.steps, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
