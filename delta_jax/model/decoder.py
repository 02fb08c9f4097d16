"""One decoder layer and its residual variants, written for a scan over stacked layers.

Conventions: B batch, T sequence, D hidden, S buffer slots. The carry between layers is
  h    [B,T,D]   residual stream (baseline, delta, delta_block), the partial block sum (block) or
                 the last sublayer output (full);
  buf  [S,B,T,D] committed sources, slots written once in order, unwritten slots zero;
  rinv [S,B,T]   float32 inverse RMS of each committed source.
`row` holds this layer's schedule entries (schedule.py) as scalars, traced inside a scan.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from delta_jax.model.layers import MLP, Attention, RMSNorm, dtype_of
from delta_jax.model.routing import RoutingSite, inverse_rms
from delta_jax.sharding import constrain

Carry = dict  # {"h": [B,T,D], "buf": [S,B,T,D], "rinv": [S,B,T]}


def commit(carry: Carry, slot, value: jax.Array, eps: float, when=True) -> Carry:
    """Write `value` [B,T,D] into buffer slot `slot` (if `when`; else rewrite what is there)."""
    buf, rinv = carry["buf"], carry["rinv"]
    value = value.astype(buf.dtype)
    if when is not True:
        value = jnp.where(when, value, jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False))
    new_rinv = inverse_rms(value, eps)
    if when is not True:
        new_rinv = jnp.where(when, new_rinv,
                             jax.lax.dynamic_index_in_dim(rinv, slot, keepdims=False))
    return {**carry,
            "buf": jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0),
            "rinv": jax.lax.dynamic_update_index_in_dim(rinv, new_rinv, slot, 0)}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs, *, stack: int | None = None):
        pd = dtype_of(cfg.param_dtype)
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd,
                                       stack=stack)
        self.self_attn = Attention(cfg, rngs, stack=stack)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=pd, stack=stack)
        self.mlp = MLP(cfg, rngs, stack=stack)
        if cfg.has_routing:
            self.attn_site = RoutingSite(cfg, rngs, stack=stack)
            self.mlp_site = RoutingSite(cfg, rngs, stack=stack)

    # Sublayers, named for remat policies -------------------------------------------------
    def attention(self, x, ctx):
        out, cache = self.self_attn(self.input_layernorm(x), *ctx["rope"], cache=ctx["cache"])
        return checkpoint_name(out, "attn_out"), cache

    def feed_forward(self, x):
        return checkpoint_name(self.mlp(self.post_attention_layernorm(x)), "mlp_out")

    def additive_input(self, site: RoutingSite, carry: Carry, visible):
        """Delta modes: h + mix (gated); the identity when the site sees no source."""
        h = carry["h"]
        mix, weights = site(carry["buf"], carry["rinv"], visible)
        return site.gated(h, h + mix), weights

    def replacement_input(self, site: RoutingSite, carry: Carry, visible):
        """AttnRes modes: the routed mix over committed sources plus the live state."""
        mix, weights = site(carry["buf"], carry["rinv"], visible, live=carry["h"])
        return site.gated(carry["h"], mix), weights

    # The layer ---------------------------------------------------------------------------
    def __call__(self, carry: Carry, row: dict, ctx: dict) -> tuple[Carry, tuple, object]:
        """carry, schedule row {first_write, attn_visible, mlp_visible, boundary}, context
        {"rope": (cos, sin) [B,T,hd], "cache": LayerCache or None} ->
        (carry, (attention-site weights [N_pad,B,T], MLP-site weights [N_pad,B,T]) or () for the
        baseline, the updated LayerCache or None)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        carry = {**carry, "h": constrain(carry["h"], ("batch", "seq", "act_embed"))}
        h = carry["h"]
        variant = cfg.residual
        if variant == "baseline":
            a, cache = self.attention(h, ctx)
            h = h + a
            h = h + self.feed_forward(h)
            return {**carry, "h": h}, (), cache

        if variant == "full":
            slot = row["first_write"]
            x, w_attn = self.replacement_input(self.attn_site, carry, row["attn_visible"])
            carry = commit(carry, slot, h, eps)
            carry["h"], cache = self.attention(x, ctx)
            x, w_mlp = self.replacement_input(self.mlp_site, carry, row["mlp_visible"])
            carry = commit(carry, slot + 1, carry["h"], eps)
            carry["h"] = self.feed_forward(x)
            return carry, (w_attn, w_mlp), cache

        if variant == "block":
            boundary = row["boundary"]
            x, w_attn = self.replacement_input(self.attn_site, carry, row["attn_visible"])
            carry = commit(carry, row["first_write"], h, eps, when=boundary)
            a, cache = self.attention(x, ctx)
            partial = jnp.where(boundary, jnp.zeros_like(h), h) + a
            carry["h"] = partial
            x, w_mlp = self.replacement_input(self.mlp_site, carry, row["mlp_visible"])
            carry["h"] = partial + self.feed_forward(x)
            return carry, (w_attn, w_mlp), cache

        if variant == "delta":
            slot = row["first_write"]
            x, w_attn = self.additive_input(self.attn_site, carry, row["attn_visible"])
            a, cache = self.attention(x, ctx)
            carry = commit(carry, slot, a, eps)
            carry["h"] = h + a
            x, w_mlp = self.additive_input(self.mlp_site, carry, row["mlp_visible"])
            m = self.feed_forward(x)
            carry = commit(carry, slot + 1, m, eps)
            carry["h"] = carry["h"] + m
            return carry, (w_attn, w_mlp), cache

        if variant == "delta_block":
            boundary, slot = row["boundary"], row["first_write"]
            x, w_attn = self.additive_input(self.attn_site, carry, row["attn_visible"])
            a, cache = self.attention(x, ctx)
            # Unwritten slots are zero, so both rules give h itself for the first block.
            if cfg.block_sources == "reference":
                previous = jax.lax.dynamic_index_in_dim(carry["buf"], jnp.maximum(slot - 1, 0),
                                                        keepdims=False)
            else:
                previous = jnp.sum(carry["buf"], axis=0)
            carry = commit(carry, slot, h - previous.astype(h.dtype), eps, when=boundary)
            carry["h"] = h + a
            x, w_mlp = self.additive_input(self.mlp_site, carry, row["mlp_visible"])
            carry["h"] = carry["h"] + self.feed_forward(x)
            return carry, (w_attn, w_mlp), cache

        raise ValueError(f"unknown residual variant {variant!r}")
