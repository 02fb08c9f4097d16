"""Qwen3 building blocks in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Conventions: B batch, T sequence, D hidden, H query heads, K kv heads, hd head dim, I MLP width,
V vocab. Every parameter carries `logical_axes` (names mapped to mesh axes in sharding.py); a
module built with `stack=L` gets a leading 'layers' axis on all of its parameters, which is how
the decoder layers are stored for the scan.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from delta_jax.model.attention_kernels import causal_attention
from delta_jax.sharding import constrain


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def make_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...],
               *, init: str, std: float, dtype, stack: int | None) -> nnx.Param:
    """A parameter drawn N(0, std) ('normal'), or filled with ones/zeros; stacked if asked."""
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"unknown parameter init {init!r}")
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def inverse_rms(x: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [...] float32: rsqrt(mean(x^2) + eps)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [..., D] in x's dtype; statistics in float32 like Qwen3RMSNorm."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, param_dtype, stack: int | None = None):
        self.eps = eps
        self.scale = make_param(None, (size,), ("norm",), init="ones", std=0.0,
                                dtype=param_dtype, stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [B,T] int -> (cos, sin) [B,T,hd] float32, rotate-half layout (HF Qwen3)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,T,N,hd], cos/sin [B,T,hd] -> [B,T,N,hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Causal GQA attention with per-head q/k RMSNorm before RoPE; no biases.

    Without a cache the kernel is `cfg.attention` (auto, xla, splash or cudnn;
    attention_kernels.py);
    with one, the XLA masked path, whose mask depends on the cache's runtime length and rows.
    """

    def __init__(self, cfg, rngs: nnx.Rngs, *, stack: int | None = None):
        d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd, std = dtype_of(cfg.param_dtype), cfg.init_std
        self.num_heads, self.head_dim, self.eps = h, hd, cfg.rms_norm_eps
        self.dtype = dtype_of(cfg.dtype)
        self.kernel = cfg.attention
        kw = dict(init="normal", std=std, dtype=pd, stack=stack)
        self.q_proj = make_param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), **kw)
        self.k_proj = make_param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), **kw)
        self.v_proj = make_param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), **kw)
        self.o_proj = make_param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), **kw)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, stack=stack)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, stack=stack)

    def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B,T,D] -> q [B,T,H,hd], k, v [B,T,K,hd] with RoPE applied to q and k."""
        x = x.astype(self.dtype)
        q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...].astype(self.dtype))
        k = jnp.einsum("btd,dnh->btnh", x, self.k_proj[...].astype(self.dtype))
        v = jnp.einsum("btd,dnh->btnh", x, self.v_proj[...].astype(self.dtype))
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return q, k, v

    def output(self, attended: jax.Array) -> jax.Array:
        """[B,T,H,hd] -> [B,T,D]."""
        return jnp.einsum("btnh,nhd->btd", attended, self.o_proj[...].astype(self.dtype))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 cache: LayerCache | None = None, segment_ids: jax.Array | None = None):
        """x [B,T,D] -> ([B,T,D], the updated LayerCache or None), causal over T, and within
        a segment when `segment_ids` [B,T] are given (packed documents; no cache then).

        With a cache, the T new tokens sit at cache positions [length, length + T) and attend
        to every cached key from their row's `start` up to themselves.
        """
        q, k, v = self.project_qkv(x, cos, sin)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        scale = self.head_dim ** -0.5
        if cache is None:
            attended = causal_attention(q, k, v, kind=self.kernel, scale=scale,
                                        segment_ids=segment_ids)
            return self.output(attended), None
        cache = cache.append(k, v)
        attended = jax.nn.dot_product_attention(q, cache.k, cache.v, mask=cache.mask(q.shape[1]),
                                                scale=scale)
        return self.output(attended), cache


@struct.dataclass
class LayerCache:
    """One layer's keys and values for decoding.

    k, v [B,S,K,hd] (S the cache capacity); length: tokens already written (scalar int32);
    start [B] int32: the first real position of each row (left padding before it is masked).
    """
    k: jax.Array
    v: jax.Array
    length: jax.Array
    start: jax.Array

    def append(self, k: jax.Array, v: jax.Array) -> LayerCache:
        """Write k, v [B,T,K,hd] at [length, length + T); length itself advances in the model."""
        index = (0, self.length, 0, 0)
        return self.replace(k=jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), index),
                            v=jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), index))

    def mask(self, num_new: int) -> jax.Array:
        """[B,1,T,S] bool: causal over the cache, rows' padding hidden (each query sees itself)."""
        query = self.length + jnp.arange(num_new)[:, None]
        key = jnp.arange(self.k.shape[1])[None, :]
        visible = (key <= query)[None] & (key >= self.start[:, None, None])
        return (visible | (key == query)[None])[:, None]


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); no biases."""

    def __init__(self, cfg, rngs: nnx.Rngs, *, stack: int | None = None):
        d, i = cfg.hidden_size, cfg.intermediate_size
        kw = dict(init="normal", std=cfg.init_std, dtype=dtype_of(cfg.param_dtype), stack=stack)
        self.dtype = dtype_of(cfg.dtype)
        self.gate_proj = make_param(rngs, (d, i), ("embed", "mlp"), **kw)
        self.up_proj = make_param(rngs, (d, i), ("embed", "mlp"), **kw)
        self.down_proj = make_param(rngs, (i, d), ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B,T,D] -> [B,T,D]."""
        x = x.astype(self.dtype)
        gate = x @ self.gate_proj[...].astype(self.dtype)
        up = x @ self.up_proj[...].astype(self.dtype)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        return hidden @ self.down_proj[...].astype(self.dtype)
