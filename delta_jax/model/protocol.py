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
    happen at block boundaries, None for writes that always happen.
    """
    value: jax.Array
    inv_rms: jax.Array
    slot: Any
    when: Any = None

    @classmethod
    def of(cls, value: jax.Array, slot, eps: float, *, when=None, dtype=None) -> Write:
        value = value.astype(dtype or value.dtype)
        return cls(value, inverse_rms(value, eps), slot, when)


@struct.dataclass
class SourceBuffer:
    """The committed sources: values [S,B,T,D] and their inverse RMS [S,B,T] float32.

    Every slot is written once, in order, into a buffer that starts as zeros, so an unwritten
    slot holds zeros (the lean backward pass relies on it, lean.py).
    """
    values: jax.Array
    inv_rms: jax.Array

    @classmethod
    def zeros(cls, num_slots: int, batch: int, length: int, hidden: int, dtype) -> SourceBuffer:
        values = jnp.zeros((num_slots, batch, length, hidden), dtype)
        return cls(constrain(values, ("sources", "batch", "seq", "act_embed")),
                   jnp.zeros((num_slots, batch, length), jnp.float32))

    @property
    def num_slots(self) -> int:
        return self.values.shape[0]

    def prefix(self, length: int) -> SourceBuffer:
        """Slots [0, length) (static), for layers that read and write no later slot."""
        if length == self.num_slots:
            return self
        return SourceBuffer(self.values[:length], self.inv_rms[:length])

    def with_prefix(self, prefix: SourceBuffer) -> SourceBuffer:
        """This buffer with its first slots replaced by `prefix`'s."""
        if prefix.num_slots == self.num_slots:
            return prefix
        return SourceBuffer(jax.lax.dynamic_update_slice_in_dim(self.values, prefix.values, 0, 0),
                            jax.lax.dynamic_update_slice_in_dim(self.inv_rms, prefix.inv_rms, 0,
                                                                0))

    def slot(self, index) -> tuple[jax.Array, jax.Array]:
        """Slot `index` (static or traced): (value [B,T,D], inv_rms [B,T])."""
        return (jax.lax.dynamic_index_in_dim(self.values, index, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.inv_rms, index, keepdims=False))

    def commit(self, writes: Sequence[Write]) -> SourceBuffer:
        """The buffer with `writes` applied in order (in place inside a scan)."""
        values, inv_rms = self.values, self.inv_rms
        for write in writes:
            value, rinv = write.value.astype(values.dtype), write.inv_rms
            if write.when is not None:  # a write that does not happen keeps the slot's zeros
                old_value, old_rinv = SourceBuffer(values, inv_rms).slot(write.slot)
                value = jnp.where(write.when, value, old_value)
                rinv = jnp.where(write.when, rinv, old_rinv)
            values = jax.lax.dynamic_update_index_in_dim(values, value, write.slot, 0)
            inv_rms = jax.lax.dynamic_update_index_in_dim(inv_rms, rinv, write.slot, 0)
        return SourceBuffer(values, inv_rms)


@struct.dataclass
class Carry:
    """What the layer loop carries: the per-token state and the source buffer."""
    state: TokenState
    buffer: SourceBuffer


@struct.dataclass
class ScheduleRow:
    """A layer's entries of the static schedule (schedule.py): [L] numpy columns for the whole
    stack, or one layer's scalars (traced inside a scan).

    first_write:  the first slot the layer writes (slots from it on are zero on entry);
    attn_visible: buffer slots its attention site sees (its MLP site sees first_write);
    boundary:     whether the layer starts a block;
    starts_block: static (not a pytree leaf, so it stays a Python value under jit, scan and
                  remat): True or False when `boundary` is known to be that for every layer
                  the row stands for, None when only the traced `boundary` says. A block
                  variant's layer that knows it starts no block then writes nothing at all
                  instead of computing a write and masking it out.
    write_hoisted: static; True where the driver has already committed the block source a
                  layer starting a block would write (delta_block, schedule.LayerLoop): the
                  layer writes nothing, and its MLP site reads that source from the buffer.
    """
    first_write: Any
    attn_visible: Any
    boundary: Any
    starts_block: bool | None = struct.field(pytree_node=False, default=None)
    write_hoisted: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_layers(self) -> int:
        return len(self.first_write)

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
