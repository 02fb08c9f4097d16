"""The types that cross the model's module boundaries (docs/spec.md section 7).

Conventions: B batch, T sequence, D hidden, S buffer slots, L layers, hd head dim, N_pad the
padded number of sources of a site ([null?] + S slots + [live?], routing.py).

A decoder layer reads a `Carry` (its `TokenState` and the read-only `SourceBuffer`), its
`ScheduleRow` and a `LayerContext`, and returns a `LayerOutput`: the next `TokenState` and the
`Write`s that the driver commits to the buffer. All of them are pytrees, so the drivers scan,
differentiate and stack them as they are.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from delta_jax.model.layers import LayerCache, inverse_rms
from delta_jax.sharding import constrain


@struct.dataclass
class TokenState:
    """What a layer hands the next one besides the source buffer.

    h      [B,T,D]: the residual stream (baseline, delta, delta_block), the partial block sum
           (block) or the last sublayer output (full);
    stream [B,T,D] or None: only with gate_base="stream" (block, full), the plain residual
           stream summed in the baseline's order, so that a zero gate reproduces it bit for bit.
    """
    h: jax.Array
    stream: jax.Array | None = None

    def constrained(self) -> TokenState:
        axes = ("batch", "seq", "act_embed")
        return TokenState(constrain(self.h, axes),
                          None if self.stream is None else constrain(self.stream, axes))


@struct.dataclass
class Write:
    """A source a layer commits to the buffer.

    value [B,T,D], inv_rms [B,T] float32 (its rsqrt(mean(value^2) + eps), computed once);
    slot: the buffer slot (an int, static or traced); when: a traced bool for writes that only
    happen at block boundaries, None for writes that always happen; logits [G,B,T] float32 or
    None: the source's routing logit at each of the G sites (routing_logits="write", below).
    """
    value: jax.Array
    inv_rms: jax.Array
    slot: Any
    when: Any = None
    logits: jax.Array | None = None

    @classmethod
    def of(cls, value: jax.Array, slot, eps: float, *, when=None, dtype=None,
           site_queries: jax.Array | None = None) -> Write:
        """With `site_queries` [G,D] (each site's w*g) the logits at every site come along:
        inv_rms * (wg . value), the same products a site reading the buffer would form."""
        value = value.astype(dtype or value.dtype)
        inv_rms = inverse_rms(value, eps)
        logits = None
        if site_queries is not None:
            logits = inv_rms * jnp.einsum("btd,gd->gbt", value, site_queries.astype(value.dtype),
                                          preferred_element_type=jnp.float32)
        return cls(value, inv_rms, slot, when, logits)


@struct.dataclass
class SourceBuffer:
    """The committed sources: values [S,B,T,D] and their inverse RMS [S,B,T] float32.

    Every slot is written once, in order, into a buffer that starts as zeros, so an unwritten
    slot holds zeros (the lean backward pass relies on it, drivers.py).

    With routing_logits="write" the buffer also holds every site's w*g, `site_queries` [G,D]
    float32 (G sites in call order: layer l's attention site is 2l, its MLP site 2l+1, the final
    site 2L), and each committed source's logit at every site, `site_logits` [S,G,B,T] float32
    (slot-major like the values, so a prefix of slots is a leading slice): a site then reads its
    [S,B,T] column instead of the [S,B,T,D] values to form its logits.
    """
    values: jax.Array
    inv_rms: jax.Array
    site_queries: jax.Array | None = None
    site_logits: jax.Array | None = None

    @classmethod
    def zeros(cls, num_slots: int, batch: int, length: int, hidden: int, dtype,
              site_queries: jax.Array | None = None) -> SourceBuffer:
        values = jnp.zeros((num_slots, batch, length, hidden), dtype)
        site_logits = None
        if site_queries is not None:
            site_logits = constrain(
                jnp.zeros((num_slots, site_queries.shape[0], batch, length), jnp.float32),
                ("sources", None, "batch", "seq"))
        return cls(constrain(values, ("sources", "batch", "seq", "act_embed")),
                   jnp.zeros((num_slots, batch, length), jnp.float32), site_queries, site_logits)

    @property
    def num_slots(self) -> int:
        return self.values.shape[0]

    def prefix(self, length: int) -> SourceBuffer:
        """Slots [0, length) (static), for layers that read and write no later slot."""
        if length == self.num_slots:
            return self
        return SourceBuffer(self.values[:length], self.inv_rms[:length], self.site_queries,
                            None if self.site_logits is None else self.site_logits[:length])

    def with_prefix(self, prefix: SourceBuffer) -> SourceBuffer:
        """This buffer with its first slots (and the site queries) replaced by `prefix`'s."""
        if prefix.num_slots == self.num_slots:
            return prefix
        site_logits = (None if self.site_logits is None else
                       jax.lax.dynamic_update_slice_in_dim(self.site_logits, prefix.site_logits,
                                                           0, axis=0))
        return SourceBuffer(jax.lax.dynamic_update_slice_in_dim(self.values, prefix.values, 0, 0),
                            jax.lax.dynamic_update_slice_in_dim(self.inv_rms, prefix.inv_rms, 0,
                                                                0),
                            prefix.site_queries, site_logits)

    def slot(self, index) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Slot `index` (static or traced): (value [B,T,D], inv_rms [B,T], logits [G,B,T] or
        None)."""
        logits = (None if self.site_logits is None else
                  jax.lax.dynamic_index_in_dim(self.site_logits, index, axis=0, keepdims=False))
        return (jax.lax.dynamic_index_in_dim(self.values, index, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.inv_rms, index, keepdims=False), logits)

    def commit(self, writes: Sequence[Write]) -> SourceBuffer:
        """The buffer with `writes` applied in order (in place inside a scan)."""
        values, inv_rms, site_logits = self.values, self.inv_rms, self.site_logits
        for write in writes:
            value, rinv, logits = write.value.astype(values.dtype), write.inv_rms, write.logits
            if (site_logits is None) != (logits is None):
                raise ValueError("SourceBuffer.commit: a write's logits must come exactly when "
                                 "the buffer holds site logits (Write.of(site_queries=...))")
            if write.when is not None:  # a write that does not happen keeps the slot's zeros
                old_value, old_rinv, old_logits = SourceBuffer(
                    values, inv_rms, self.site_queries, site_logits).slot(write.slot)
                value = jnp.where(write.when, value, old_value)
                rinv = jnp.where(write.when, rinv, old_rinv)
                if logits is not None:
                    logits = jnp.where(write.when, logits, old_logits)
            values = jax.lax.dynamic_update_index_in_dim(values, value, write.slot, 0)
            inv_rms = jax.lax.dynamic_update_index_in_dim(inv_rms, rinv, write.slot, 0)
            if logits is not None:
                site_logits = jax.lax.dynamic_update_index_in_dim(site_logits, logits,
                                                                  write.slot, 0)
        return SourceBuffer(values, inv_rms, self.site_queries, site_logits)


@struct.dataclass
class Carry:
    """What the layer loop carries: the per-token state and the source buffer."""
    state: TokenState
    buffer: SourceBuffer


@struct.dataclass
class ScheduleRow:
    """A layer's entries of the static schedule (schedule.py): [L] numpy columns for the whole
    stack, or one layer's scalars (traced inside a scan).

    layer:        the layer's index (its sites are 2*layer and 2*layer + 1);
    first_write:  the first slot the layer writes (slots from it on are zero on entry);
    attn_visible: buffer slots its attention site sees (its MLP site sees first_write);
    boundary:     whether the layer starts a block;
    starts_block: static (not a pytree leaf, so it stays a Python value under jit, scan and
                  remat): True or False when `boundary` is known to be that for every layer
                  the row stands for, None when only the traced `boundary` says. A block
                  variant's layer that knows it starts no block then writes nothing at all
                  instead of computing a write and masking it out.
    write_hoisted: static; True where the driver has already committed the block source a
                  layer starting a block would write (delta_block, hoist_block_writes): the
                  layer writes nothing, and its MLP site reads that source from the buffer.
    """
    layer: Any
    first_write: Any
    attn_visible: Any
    boundary: Any
    starts_block: bool | None = struct.field(pytree_node=False, default=None)
    write_hoisted: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer)

    def at(self, index, *, within: tuple[int, int] | None = None) -> ScheduleRow:
        """Layer `index`'s row: static (numpy scalars) for an int, traced for a traced index.
        `within` (start, end): the layers a traced index ranges over; where they all start a
        block or none does, `starts_block` says so."""
        if isinstance(index, (int, np.integer)):
            row = jax.tree.map(lambda column: column[index], self)
            return row.replace(starts_block=bool(row.boundary))
        row = jax.tree.map(lambda column: jnp.asarray(column)[index], self)
        if within is not None:
            starts = np.unique(np.asarray(self.boundary)[within[0]:within[1]])
            row = row.replace(starts_block=bool(starts[0]) if len(starts) == 1 else None)
        return row


@struct.dataclass
class LayerContext:
    """What every layer reads besides the carry: the RoPE tables (cos, sin), each [B,T,hd]
    float32, this layer's decoding cache (k, v [B,C,K,hd]) or None, and the segment ids
    [B,T] int32 of packed documents (attention stays within a segment) or None (one segment)."""
    rope: tuple[jax.Array, jax.Array]
    cache: LayerCache | None = None
    segment_ids: jax.Array | None = None


@struct.dataclass
class LayerOutput:
    """What a layer returns: its new state, the writes for the driver to commit (the layer
    never writes the buffer itself), the (attention-site, MLP-site) routing weights, each
    [N_pad,B,T] float32 (None for the baseline), and the updated decoding cache or None."""
    state: TokenState
    writes: tuple[Write, ...] = ()
    weights: tuple[jax.Array, jax.Array] | None = None
    cache: LayerCache | None = None
