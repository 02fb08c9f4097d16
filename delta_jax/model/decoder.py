"""One decoder layer and its residual variants, written for a scan over stacked layers.

Conventions: B batch, T sequence, D hidden, S buffer slots; the types are protocol.py's.
`DecoderLayer` holds the parameters (Qwen3's sublayers and, for the routing variants, one
routing site per sublayer); its call dispatches to the function of its variant family
(`VARIANT_LAYERS`), each of which reads a Carry (the buffer read-only) and returns a
LayerOutput. A layer never writes the buffer itself: its MLP site sees this layer's own write
as a `fresh` source. Buffer reads are then linear in a loop-invariant array, which lets the
lean backward pass accumulate their cotangents in place instead of copying the buffer.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from delta_jax.model.layers import MLP, Attention, LayerCache, RMSNorm, dtype_of
from delta_jax.model.protocol import (
    Carry,
    LayerContext,
    LayerOutput,
    ScheduleRow,
    SourceBuffer,
    TokenState,
    Write,
)
from delta_jax.model.routing import RoutingSite


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

    # Sublayers, their outputs named for remat policies -------------------------------------
    def attention(self, x: jax.Array, ctx: LayerContext) -> tuple[jax.Array, LayerCache | None]:
        """[B,T,D] (before the input norm) -> ([B,T,D], the updated cache or None)."""
        out, cache = self.self_attn(self.input_layernorm(x), *ctx.rope, cache=ctx.cache,
                                    segment_ids=ctx.segment_ids)
        return checkpoint_name(out, "attn_out"), cache

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """[B,T,D] (before the post-attention norm) -> [B,T,D]."""
        return checkpoint_name(self.mlp(self.post_attention_layernorm(x)), "mlp_out")

    def __call__(self, carry: Carry, row: ScheduleRow, ctx: LayerContext) -> LayerOutput:
        carry = carry.replace(state=carry.state.constrained())
        return VARIANT_LAYERS[self.cfg.residual](self, carry, row, ctx)


def additive_input(site: RoutingSite, buffer: SourceBuffer, visible, h: jax.Array,
                   fresh: Write | None = None) -> tuple[jax.Array, jax.Array]:
    """Delta modes' sublayer input h + mix (gated against h); h itself with no source.
    -> (input [B,T,D], weights [N_pad,B,T])."""
    mix, weights = site(buffer, visible, fresh=fresh)
    return checkpoint_name(site.gated(h, h + mix), "routed_input"), weights


def replacement_input(site: RoutingSite, buffer: SourceBuffer, visible, live: jax.Array,
                      stream: jax.Array | None, fresh: Write | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """AttnRes modes' sublayer input: the mix over the committed sources and the live state,
    gated against the live state (the reference) or the residual stream (gate_base="stream").
    -> (input [B,T,D], weights [N_pad,B,T])."""
    mix, weights = site(buffer, visible, fresh=fresh, live=live)
    return checkpoint_name(site.gated(live if stream is None else stream, mix),
                           "routed_input"), weights


def _writer(cfg, buffer: SourceBuffer) -> Callable[..., Write]:
    """Write.of for a layer's sources: the config's eps and the buffer's dtype."""
    return functools.partial(Write.of, eps=cfg.rms_norm_eps, dtype=buffer.values.dtype)


def baseline_layer(layer: DecoderLayer, carry: Carry, row: ScheduleRow,
                   ctx: LayerContext) -> LayerOutput:
    """Qwen3's pre-norm layer (docs/spec.md section 1): h += Attn(h); h += MLP(h)."""
    h = carry.state.h
    a, cache = layer.attention(h, ctx)
    h = h + a
    return LayerOutput(TokenState(h + layer.feed_forward(h)), cache=cache)


def replacement_layer(layer: DecoderLayer, carry: Carry, row: ScheduleRow,
                      ctx: LayerContext) -> LayerOutput:
    """block and full (AttnRes, docs/spec.md sections 2 and 3): each sublayer reads the routed mix
    of the committed sources and the live state instead of a residual stream.

    The one difference: `full` commits every sublayer's input (its layer input at slot 2l, the
    attention output at 2l+1) and its live state is the last sublayer output; `block` commits
    its live state, the partial block sum, only at a block boundary and restarts it from zero.
    With gate_base="stream" the state also carries the plain residual stream (docs/spec.md
    section 6), which every site's gate starts from.
    """
    full = layer.cfg.residual == "full"
    write = _writer(layer.cfg, carry.buffer)
    h, stream, slot = carry.state.h, carry.state.stream, row.first_write
    x, w_attn = replacement_input(layer.attn_site, carry.buffer, row.attn_visible, h, stream)
    committed = write(h, slot) if full else _block_write(write, h, slot, row)
    a, cache = layer.attention(x, ctx)
    if full:
        live = a
    elif row.starts_block is None:  # block restarts its partial sum at a boundary
        live = jnp.where(row.boundary, jnp.zeros_like(h), h) + a
    else:
        live = a if row.starts_block else h + a
    stream = None if stream is None else stream + a
    x, w_mlp = replacement_input(layer.mlp_site, carry.buffer, slot, live, stream,
                                 fresh=committed)
    m = layer.feed_forward(x)
    state = TokenState(m if full else live + m, None if stream is None else stream + m)
    writes = (committed, write(a, slot + 1)) if full else _written(committed)
    return LayerOutput(state, writes, (w_attn, w_mlp), cache)


def delta_layer(layer: DecoderLayer, carry: Carry, row: ScheduleRow,
                ctx: LayerContext) -> LayerOutput:
    """Delta AttnRes (docs/spec.md section 3): every sublayer output is a source, and each
    sublayer reads h + the routed mix; the embedding is source 0, written before the loop."""
    write = _writer(layer.cfg, carry.buffer)
    h, slot = carry.state.h, row.first_write
    x, w_attn = additive_input(layer.attn_site, carry.buffer, row.attn_visible, h)
    a, cache = layer.attention(x, ctx)
    first = write(a, slot)
    h = h + a
    x, w_mlp = additive_input(layer.mlp_site, carry.buffer, slot, h, fresh=first)
    m = layer.feed_forward(x)
    second = write(m, slot + 1)
    return LayerOutput(TokenState(h + m), (first, second), (w_attn, w_mlp), cache)


def delta_block_layer(layer: DecoderLayer, carry: Carry, row: ScheduleRow,
                      ctx: LayerContext) -> LayerOutput:
    """Delta Block (docs/spec.md section 3): at a block boundary the stream's change since
    the previous source is committed (block_sources "reference": h - S[-1]; "paper":
    h - sum(S)); the attention site routes before that write, the MLP site after it."""
    h, slot, buffer = carry.state.h, row.first_write, carry.buffer
    x, w_attn = additive_input(layer.attn_site, buffer, row.attn_visible, h)
    a, cache = layer.attention(x, ctx)
    committed, mlp_visible = None, slot
    if row.write_hoisted:  # the block's source is in the buffer already
        mlp_visible = slot + row.boundary.astype(np.int32)
    elif row.starts_block is not False:
        committed = _block_write(_writer(layer.cfg, buffer),
                                 delta_block_source(layer.cfg, buffer, h, slot), slot, row)
    h = h + a
    x, w_mlp = additive_input(layer.mlp_site, buffer, mlp_visible, h, fresh=committed)
    return LayerOutput(TokenState(h + layer.feed_forward(x)), _written(committed),
                       (w_attn, w_mlp), cache)


def delta_block_source(cfg, buffer: SourceBuffer, h: jax.Array, slot) -> jax.Array:
    """The source a delta_block layer commits at a block boundary into `slot`: the stream's
    change since the previous source ("reference": h - S[slot-1]; "paper": h - sum(S[:slot]))."""
    # Unwritten slots are zero in the forward pass, so both rules give h itself for the first
    # block; the masks keep them right over the final buffer in the lean backward pass.
    if cfg.block_sources == "reference":
        previous = jnp.where(slot > 0, jax.lax.dynamic_index_in_dim(
            buffer.values, jnp.maximum(slot - 1, 0), keepdims=False), 0)
    else:
        before = jnp.arange(buffer.values.shape[0]) < slot
        previous = jnp.sum(jnp.where(before[:, None, None, None], buffer.values, 0), axis=0)
    return h - previous.astype(h.dtype)


@dataclasses.dataclass(frozen=True)
class HoistedBlockWrite:
    """The write of a delta_block layer that starts a block, made by the lean driver before the
    layer's loop where that loop is one block's first layers (schedule.LayerLoop.hoisted): its
    source depends only on the layer's input state and the buffer. In two parts for the
    backward pass: `source` is linear in the state and the buffer, and `write` needs only the
    source, which the backward pass reads back from its slot."""
    cfg: object

    def source(self, carry: Carry, row: ScheduleRow) -> jax.Array:
        return delta_block_source(self.cfg, carry.buffer, carry.state.h, row.first_write)

    def write(self, value: jax.Array, row: ScheduleRow, buffer: SourceBuffer) -> Write:
        return _writer(self.cfg, buffer)(value, row.first_write)


@dataclasses.dataclass(frozen=True)
class DeltaStateRebuild:
    """delta's residual stream is the running sum of its sources: a layer adds the two values it
    writes, h <- (h + a) + m with a, m in slots first_write and first_write + 1 (delta_layer).
    So the lean driver need not keep every layer's input state for its backward pass: from a
    loop's input state and the final buffer it adds the same values in the same order again
    (rebuild_states). Bit for bit the same states where the buffer holds the compute dtype, as
    it does (Write.of casts to it); a compiler that keeps the sum in more precision inside one
    layer and not across the rebuild can differ in the last bit."""

    def state(self, first: TokenState, buffer: SourceBuffer, rows: ScheduleRow, start: int,
              index) -> TokenState:
        """Layer `index`'s input state, from layer `start`'s input `first`: the writes of layers
        [start, index) added to it in order (index static or traced)."""
        def add_layer(layer, h):
            slot = jnp.asarray(rows.first_write)[layer]
            a, m = (buffer.slot(slot + k)[0].astype(h.dtype) for k in (0, 1))
            return (h + a) + m

        return TokenState(jax.lax.fori_loop(start, index, add_layer, first.h))


def _block_write(write: Callable[..., Write], value: jax.Array, slot, row: ScheduleRow
                 ) -> Write | None:
    """A block variant's write of `value`, which happens only where the layer starts a block:
    None where the row knows statically that it does not, unconditional where it knows that
    it does, masked by the traced `row.boundary` otherwise."""
    if row.starts_block is False:
        return None
    return write(value, slot, when=None if row.starts_block else row.boundary)


def _written(write: Write | None) -> tuple[Write, ...]:
    return () if write is None else (write,)


VARIANT_LAYERS: dict[str, Callable[..., LayerOutput]] = {
    "baseline": baseline_layer,
    "block": replacement_layer,
    "full": replacement_layer,
    "delta": delta_layer,
    "delta_block": delta_block_layer,
}
