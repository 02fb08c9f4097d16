"""One decoder layer and its residual variants, written for a scan over stacked layers.

Conventions: B batch, T sequence, D hidden, S buffer slots. The carry between layers is
  h      [B,T,D]   residual stream (baseline, delta, delta_block), the partial block sum (block)
                   or the last sublayer output (full);
  stream [B,T,D]   only with gate_base="stream" (block, full): the plain residual stream, summed
                   in the baseline's order so that a zero gate reproduces it bit for bit;
  buf    [S,B,T,D] committed sources, slots written once in order, unwritten slots zero;
  rinv   [S,B,T]   float32 inverse RMS of each committed source.
A layer returns its new per-token state ({"h"} or {"h", "stream"}: every carry entry but the
buffer) and its writes; `row` holds its schedule entries (schedule.py), traced inside a scan.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from delta_jax.model.layers import MLP, Attention, RMSNorm, dtype_of
from delta_jax.model.routing import RoutingSite, Write, inverse_rms
from delta_jax.sharding import constrain

Carry = dict  # {"h": [B,T,D], "stream"?: [B,T,D], "buf": [S,B,T,D], "rinv": [S,B,T]}
BUFFER_KEYS = ("buf", "rinv")


def layer_state(carry: Carry) -> dict:
    """The per-token entries of the carry (everything but the source buffer)."""
    return {k: v for k, v in carry.items() if k not in BUFFER_KEYS}


def make_write(value: jax.Array, slot, eps: float, when=True, dtype=None) -> Write:
    value = value.astype(dtype or value.dtype)
    return Write(value, inverse_rms(value, eps), slot, when)


def apply_writes(carry: Carry, writes: tuple[Write, ...]) -> Carry:
    """Commit a layer's writes to the buffer (in place inside a scan)."""
    buf, rinv = carry["buf"], carry["rinv"]
    for write in writes:
        value, r = write.value.astype(buf.dtype), write.rinv
        if write.when is not True:  # an unwritten slot keeps what it holds (zeros)
            value = jnp.where(write.when, value,
                              jax.lax.dynamic_index_in_dim(buf, write.slot, keepdims=False))
            r = jnp.where(write.when, r,
                          jax.lax.dynamic_index_in_dim(rinv, write.slot, keepdims=False))
        buf = jax.lax.dynamic_update_index_in_dim(buf, value, write.slot, 0)
        rinv = jax.lax.dynamic_update_index_in_dim(rinv, r, write.slot, 0)
    return {**carry, "buf": buf, "rinv": rinv}


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

    def additive_input(self, site: RoutingSite, carry: Carry, visible, h, fresh=None):
        """Delta modes: h + mix (gated); the identity when the site sees no source."""
        mix, weights = site(carry["buf"], carry["rinv"], visible, fresh=fresh)
        return site.gated(h, h + mix), weights

    def replacement_input(self, site: RoutingSite, carry: Carry, visible, live, fresh=None,
                          stream=None):
        """AttnRes modes: the routed mix over committed sources plus the live state, gated
        against the live state (the reference) or the residual stream (gate_base='stream')."""
        mix, weights = site(carry["buf"], carry["rinv"], visible, fresh=fresh, live=live)
        return site.gated(live if stream is None else stream, mix), weights

    # The layer ---------------------------------------------------------------------------
    def __call__(self, carry: Carry, row: dict, ctx: dict):
        """carry (its buffer read-only), schedule row {first_write, attn_visible, boundary},
        context {"rope": (cos, sin) [B,T,hd], "cache": LayerCache or None} ->
        (state {"h": [B,T,D], "stream"?: [B,T,D]}, writes: tuple of Write for the driver to
         commit, (attention-site weights [N_pad,B,T], MLP-site weights [N_pad,B,T]) or ()
         (baseline), the updated LayerCache or None).

        The layer never writes the buffer itself: its MLP site sees this layer's own write as a
        `fresh` source. Buffer reads are then linear in a loop-invariant array, which lets the
        lean backward pass accumulate their cotangents in place instead of copying the buffer.
        """
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = constrain(carry["h"], ("batch", "seq", "act_embed"))
        stream = carry.get("stream")
        if stream is not None:
            stream = constrain(stream, ("batch", "seq", "act_embed"))
        dtype = carry["buf"].dtype
        slot = row["first_write"]
        variant = cfg.residual
        if variant == "baseline":
            a, cache = self.attention(h, ctx)
            h = h + a
            return {"h": h + self.feed_forward(h)}, (), (), cache

        if variant in ("full", "block"):
            # The live state: full, the last sublayer output (every input state is committed);
            # block, the partial block sum (committed and restarted at each boundary).
            full = variant == "full"
            x, w_attn = self.replacement_input(self.attn_site, carry, row["attn_visible"], h,
                                               stream=stream)
            committed = make_write(h, slot, eps, when=True if full else row["boundary"],
                                   dtype=dtype)
            a, cache = self.attention(x, ctx)
            live = a if full else jnp.where(row["boundary"], jnp.zeros_like(h), h) + a
            stream = None if stream is None else stream + a
            x, w_mlp = self.replacement_input(self.mlp_site, carry, slot, live, fresh=committed,
                                              stream=stream)
            m = self.feed_forward(x)
            state = {"h": m if full else live + m}
            if stream is not None:
                state["stream"] = stream + m
            writes = (committed, make_write(a, slot + 1, eps, dtype=dtype)) if full else (
                committed,)
            return state, writes, (w_attn, w_mlp), cache

        if variant == "delta":
            x, w_attn = self.additive_input(self.attn_site, carry, row["attn_visible"], h)
            a, cache = self.attention(x, ctx)
            first = make_write(a, slot, eps, dtype=dtype)
            h = h + a
            x, w_mlp = self.additive_input(self.mlp_site, carry, slot, h, fresh=first)
            m = self.feed_forward(x)
            second = make_write(m, slot + 1, eps, dtype=dtype)
            return {"h": h + m}, (first, second), (w_attn, w_mlp), cache

        if variant == "delta_block":
            boundary = row["boundary"]
            x, w_attn = self.additive_input(self.attn_site, carry, row["attn_visible"], h)
            a, cache = self.attention(x, ctx)
            # Unwritten slots are zero in the forward pass, so both rules give h itself for the
            # first block; the masks keep them right over the final buffer in the lean backward.
            buf = carry["buf"]
            if cfg.block_sources == "reference":
                previous = jnp.where(slot > 0, jax.lax.dynamic_index_in_dim(
                    buf, jnp.maximum(slot - 1, 0), keepdims=False), 0)
            else:
                before = jnp.arange(buf.shape[0]) < slot
                previous = jnp.sum(jnp.where(before[:, None, None, None], buf, 0), axis=0)
            committed = make_write(h - previous.astype(h.dtype), slot, eps, when=boundary,
                                   dtype=dtype)
            h = h + a
            x, w_mlp = self.additive_input(self.mlp_site, carry, slot, h, fresh=committed)
            return {"h": h + self.feed_forward(x)}, (committed,), (w_attn, w_mlp), cache

        raise ValueError(f"unknown residual variant {variant!r}")
