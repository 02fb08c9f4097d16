"""The lean layer driver: the forward of a scan over the layers, under a custom_vjp whose
backward pass is a reverse scan that recomputes each layer from the final source buffer.

Every slot is written once, from zero, so layer i's input buffer is the final one masked to the
slots written before layer i (its sites mask the rest out of their softmax): the backward pass
keeps the per-token state (h, the stream) of each layer and not the buffer, O(S) buffer memory
for one extra forward (the same as full remat). The layers run as the static loops of
schedule.layer_loops, each over the buffer prefix its layers touch; before a loop that is one
block's first layers (delta_block) the block's source is committed (`hoist`,
decoder.HoistedBlockWrite), and no layer inside it writes. With `rebuild` (delta,
decoder.DeltaStateRebuild) the forward pass keeps each loop's input state only, and the
backward rebuilds each layer's from it and the buffer.

Conventions: L layers, S buffer slots; types from protocol.py; `step(inputs_l, carry, row) ->
LayerOutput` runs one layer on its slice of the stacked `inputs` (drivers.py).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from delta_jax.model.protocol import Carry, LayerOutput, ScheduleRow, SourceBuffer, TokenState
from delta_jax.model.schedule import LayerLoop


def run_lean(step, inputs, carry: Carry, rows: ScheduleRow, loops: tuple[LayerLoop, ...],
             unroll: bool = False, hoist=None, rebuild=None):
    """The layers' final Carry, differentiable with the lean backward pass, and no layer outputs
    (no routing weights, no cache: callers that need them use drivers.run_scan). `unroll` writes
    both passes' loops out layer by layer (the same program without while loops, for XLA's cost
    analysis)."""
    driver = LeanDriver(step, rows, loops, unroll, hoist, rebuild)

    @jax.custom_vjp
    def lean(inputs, carry):
        return driver.forward(inputs, carry, keep_states=False)[0]

    def forward(inputs, carry):
        final, kept_states = driver.forward(inputs, carry, keep_states=True)
        return final, (inputs, kept_states, final)

    lean.defvjp(forward, driver.backward)
    return lean(inputs, carry), (None, None)


@dataclasses.dataclass(frozen=True, eq=False)
class LeanDriver:
    """The two passes of run_lean over its static loops."""
    step: Callable[..., LayerOutput]
    rows: ScheduleRow  # the schedule's [L] columns
    loops: tuple[LayerLoop, ...]
    unroll: bool
    hoist: Any  # decoder.HoistedBlockWrite (delta_block) or None
    rebuild: Any  # decoder.DeltaStateRebuild (delta with rebuild_states) or None

    def row(self, index, loop: LayerLoop) -> ScheduleRow:
        row = self.rows.at(index, within=(loop.start, loop.end))
        return row.replace(write_hoisted=loop.hoisted)

    def forward(self, inputs, carry: Carry, keep_states: bool) -> tuple[Carry, list]:
        """(the final carry, per loop what its backward pass needs: with `keep_states` its layers'
        input states [n, ...] stacked, or with `rebuild` the loop's input state; else None)."""
        kept = []
        for loop in self.loops:
            if loop.hoisted:
                row = self.rows.at(loop.start)
                write = self.hoist.write(self.hoist.source(carry, row), row, carry.buffer)
                carry = carry.replace(buffer=carry.buffer.commit((write,)))
            loop_carry = Carry(carry.state, carry.buffer.prefix(loop.prefix))
            keep_each = keep_states and self.rebuild is None

            def body(c: Carry, xs, loop=loop):
                inputs_l, index = xs
                out = self.step(inputs_l, c, self.row(index, loop))
                return (Carry(out.state, c.buffer.commit(out.writes)),
                        c.state if keep_each else None)

            part, states = _over_layers(body, loop_carry,
                                        _layer_range(inputs, loop.start, loop.end),
                                        loop.start, loop.end, unroll=self.unroll)
            kept.append(loop_carry.state if self.rebuild is not None else states)
            carry = Carry(part.state, carry.buffer.with_prefix(part.buffer))
        return carry, kept

    def backward(self, residuals, final_cotangent: Carry):
        """The custom_vjp's backward: (d inputs, d carry) from the final carry's cotangent."""
        inputs, kept, final = residuals
        # Slots written before the loops (delta's embedding) reach the caller through d_carry.
        # Where nothing after the layers reads the buffer (delta, delta_block) its cotangent
        # arrives as zeros. In the looped program XLA sinks those zeros into the first backward
        # loop as a select over the whole buffer, materialised in every iteration; behind a
        # barrier they are one plain buffer (figures: BENCHMARKS.md, "Tried, not kept").
        # The unrolled cost twin keeps the constant, as before: it has no loop to sink the
        # zeros into, and XLA folds them away there.
        d_carry = final_cotangent
        if not self.unroll:
            d_carry = d_carry.replace(buffer=jax.lax.optimization_barrier(d_carry.buffer))
        # Loops run last to first over shrinking prefixes. Once a loop is done, the slots its
        # layers wrote have passed their cotangents on (as d_writes) and no earlier layer reads
        # them, so both the cotangent and the final buffer go on as the next loop's prefix: the
        # whole-buffer cotangent is not kept, and the caller gets zeros for those slots. The
        # barrier takes each prefix of the final buffer only once the loop before it is done;
        # without it XLA slices every prefix right after the forward pass and holds them all
        # (BENCHMARKS.md, "Tried, not kept").
        d_inputs = []
        d_state, d_buffer, final_buffer = d_carry.state, d_carry.buffer, final.buffer
        for loop, states in zip(reversed(self.loops), reversed(kept)):
            part, final_buffer, d_loop = self.loop_backward(
                loop, inputs, states, Carry(d_state, d_buffer.prefix(loop.prefix)),
                final_buffer.prefix(loop.prefix))
            d_inputs.insert(0, d_loop)
            d_state, d_buffer = part.state, part.buffer
            if not self.unroll:
                d_buffer, final_buffer = jax.lax.optimization_barrier((d_buffer, final_buffer))
        spent = jax.tree.map(jnp.zeros_like, d_carry.buffer)
        d_carry = Carry(d_state, spent.with_prefix(d_buffer))
        if len(d_inputs) > 1:
            d_inputs = [jax.tree.map(lambda *parts: jnp.concatenate(parts), *d_inputs)]
        return d_inputs[0], d_carry

    def loop_backward(self, loop: LayerLoop, inputs, states, cotangent: Carry,
                      final_prefix: SourceBuffer) -> tuple[Carry, SourceBuffer, Any]:
        """One loop's backward pass, from the cotangent after it and the final buffer's prefix:
        (the cotangent before it, that prefix as the loop passed it on, d inputs of its layers).
        With `rebuild`, `states` is the loop's input state, which each layer's step reads whole;
        else its layers' input states, one a step."""
        loop_input = None if self.rebuild is None else states
        (cotangent, final_prefix), d_loop = _over_layers(
            functools.partial(self.layer_backward, loop, loop_input), (cotangent, final_prefix),
            (_layer_range(inputs, loop.start, loop.end), None if loop_input is not None
             else states), loop.start, loop.end, reverse=True, unroll=self.unroll)
        if loop.hoisted:
            cotangent = _hoisted_write_backward(self.hoist, self.rows.at(loop.start), cotangent,
                                                final_prefix, self.unroll)
        return cotangent, final_prefix, d_loop

    def layer_backward(self, loop: LayerLoop, loop_input: TokenState | None,
                       carried: tuple[Carry, SourceBuffer], xs):
        """One backward step: layer `index` recomputed over the final buffer under jax.vjp.
        -> ((the cotangent before the layer, the final buffer), d its inputs)."""
        cotangent, final_buffer = carried
        (inputs_l, state_in), index = xs
        if loop_input is not None:  # rebuild: the loop's input state, not the layer's
            state_in = loop_input
        row = self.row(index, loop)
        if loop.end - loop.start == 1:
            # Outside a loop nothing orders the layer's recompute after the cotangent that
            # reaches it: XLA would start it early and hold its saved activations through the
            # backward pass.
            cotangent, inputs_l, state_in, buffer = jax.lax.optimization_barrier(
                (cotangent, inputs_l, state_in, final_buffer))
        else:
            buffer = final_buffer
        if loop_input is not None:
            state_in = self.rebuild.state(state_in, buffer, self.rows, loop.start, index)

        def layer_reads(p, state, buffer):
            # Over the final buffer: the slots layer `index` had not yet seen are masked in its
            # sites, so reading them changes nothing and passes them no gradient.
            out = self.step(p, Carry(state, buffer), row)
            return ((out.state, [(w.value, w.inv_rms) for w in out.writes]),
                    [(w.slot, w.when) for w in out.writes])

        _, vjp, targets = jax.vjp(layer_reads, inputs_l, state_in, buffer, has_aux=True)
        d_writes = [_written_cotangent(cotangent.buffer, slot, when) for slot, when in targets]
        d_inputs, d_state, d_buffer = vjp((cotangent.state, d_writes))
        if not self.unroll:
            # The final buffer rides through the loop so that the next loop takes its prefix
            # from this loop's copy (in the layout the loop wants). Passed through as it is, XLA
            # forwards the copy from before the loop instead and holds both through it
            # (BENCHMARKS.md, "Tried, not kept").
            final_buffer = jax.lax.optimization_barrier(final_buffer)
        return ((Carry(d_state, jax.tree.map(jnp.add, cotangent.buffer, d_buffer)),
                 final_buffer), d_inputs)


def _layer_range(stacked, start: int, end: int):
    return jax.tree.map(lambda x: x[start:end], stacked)


def _over_layers(body, carry, xs, start: int, end: int, *, reverse: bool = False,
                 unroll: bool = False):
    """jax.lax.scan of `body(carry, (xs_l, index)) -> (carry, out)` over layers [start, end),
    `xs` holding those layers on its leading axis. A single layer is a plain call with its
    index static (its schedule row then fully static): no loop whose carry XLA would copy in
    and out. Its output still gets the leading layer axis."""
    if end - start == 1:
        carry, out = body(carry, (jax.tree.map(lambda x: x[0], xs), start))
        return carry, jax.tree.map(lambda x: x[None], out)
    return jax.lax.scan(body, carry, (xs, jnp.arange(start, end)), reverse=reverse,
                        unroll=unroll)


def _written_cotangent(d_buffer: SourceBuffer, slot, when) -> tuple:
    """The cotangent of a write (value, inv_rms): what later layers' reads left in its slot
    (none when the write did not happen)."""
    parts = d_buffer.slot(slot)
    if when is None:
        return parts
    return tuple(jnp.where(when, part, 0) for part in parts)


def _hoisted_write_backward(hoist, row: ScheduleRow, cotangent: Carry,
                            final_buffer: SourceBuffer, unroll: bool) -> Carry:
    """The cotangent before a hoisted write (LeanDriver.hoist), from the one after it. Slots
    are written once, so the final buffer holds the source the write wrote; the source's map
    from the state and the buffer is linear, so its transpose needs neither (the loop's saved
    states are not kept for it)."""
    value = final_buffer.slot(row.first_write)[0]
    if not unroll:
        # Recompute the write once the loop after it is done, not earlier; of the buffer it
        # needs only the written slot.
        cotangent, value = jax.lax.optimization_barrier((cotangent, value))

    def fields(value):
        write = hoist.write(value, row, final_buffer)
        return write.value, write.inv_rms

    _, write_vjp = jax.vjp(fields, value)
    (d_value,) = write_vjp(_written_cotangent(cotangent.buffer, row.first_write, None))
    # Linear: its transpose is the same at any point, so evaluate it at zeros.
    zeros = jax.tree.map(jnp.zeros_like, cotangent)
    _, source_vjp = jax.vjp(lambda state, buffer: hoist.source(Carry(state, buffer), row),
                            zeros.state, zeros.buffer)
    d_state, d_buffer = source_vjp(d_value)
    return jax.tree.map(jnp.add, cotangent, Carry(d_state, d_buffer))
