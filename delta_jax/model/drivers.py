"""Layer drivers: three ways to run the stacked decoder layers over the carry.

- `scan`: jax.lax.scan over the stacked parameters. Differentiating it saves the whole carry,
  source buffer included, once per layer: O(L*S) activations.
- `lean` (default): the same forward, under a custom_vjp whose backward is a reverse scan that
  rebuilds layer i's input buffer from the final one (every slot is written once, from zero, so
  the input is the final buffer masked to the slots written before layer i) and recomputes the
  layer under jax.vjp. Saves only the per-token state (h, the stream) per layer: O(S) buffer
  memory, at the cost of one extra forward (the same as full remat). With `loops` > 1 it
  runs the layers as consecutive loops over growing buffer prefixes (buffer_spans). With
  `hoist` (delta_block) a loop that is one block's first layers gets the block's source
  committed before it, and no layer in it writes at all (hoistable). With `rebuild` (delta) it
  keeps one state a loop, not one a layer, and rebuilds each layer's from the buffer (its
  stream is the sum of its sources).
- `unrolled`: a Python loop with static layer indices; the reference path tests compare against.

Conventions: L layers; types from protocol.py. `step(inputs_l, carry, row) -> LayerOutput` runs
one layer on its slice `inputs_l` of the stacked `inputs` (parameters, and the layer's KV cache
when decoding), reading the buffer; the driver commits the returned writes. `rows` is the
schedule's ScheduleRow of [L] columns. Each driver returns (final Carry, per-layer outputs
(routing weights, cache) stacked on a leading L axis).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.model.protocol import Carry, LayerOutput, ScheduleRow, SourceBuffer, TokenState

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmul outputs, and each site's routed sublayer input: rebuilding it in the layer's
    # backward would read the source buffer once more per site.
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("routed_input")),
    "save_sublayer_outputs": jax.checkpoint_policies.save_only_these_names("attn_out",
                                                                           "mlp_out"),
}


def with_remat(step, policy: str):
    if policy == "none":
        return step
    return jax.checkpoint(step, policy=REMAT_POLICIES[policy])


def _advance(step, inputs_l, carry: Carry, row: ScheduleRow):
    out: LayerOutput = step(inputs_l, carry, row)
    return Carry(out.state, carry.buffer.commit(out.writes)), (out.weights, out.cache)


def run_scan(step, inputs, carry: Carry, rows: ScheduleRow, unroll: bool = False,
             loops: int = 1, hoist=None, rebuild=None):
    # One loop: its per-layer routing weights are padded to the whole buffer.
    del loops, hoist, rebuild
    def body(c, xs):
        inputs_l, index = xs
        return _advance(step, inputs_l, c, rows.at(index))

    return jax.lax.scan(body, carry, (inputs, jnp.arange(rows.num_layers)), unroll=unroll)


def run_unrolled(step, inputs, carry: Carry, rows: ScheduleRow, unroll: bool = True,
                 loops: int = 1, hoist=None, rebuild=None):
    # Always unrolled, always over the whole buffer (the reference path); its rows are static.
    del unroll, loops, hoist, rebuild
    outputs = []
    for index in range(rows.num_layers):
        inputs_l = jax.tree.map(lambda x: x[index], inputs)
        carry, out = _advance(step, inputs_l, carry, rows.at(index))
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def _written_cotangent(d_buffer: SourceBuffer, slot, when) -> tuple:
    """The cotangent of a write (value, inv_rms): what later layers' reads left in its slot
    (none when the write did not happen)."""
    parts = d_buffer.slot(slot)
    if when is None:
        return parts
    return tuple(jnp.where(when, part, 0) for part in parts)


def buffer_spans(rows: ScheduleRow, num_slots: int, loops: int) -> list[tuple[int, int, int]]:
    """Split the layers into `loops` runs of consecutive layers, each with the buffer prefix
    its layers touch: [(first layer, end layer, prefix length)]. A layer reads and writes only
    the slots written before the next layer, so the run ending at layer b needs
    rows.first_write[b] slots (all S for the last run)."""
    num_layers = rows.num_layers
    count = max(1, min(loops, num_layers)) if num_slots else 1
    edges = [round(k * num_layers / count) for k in range(count + 1)]
    return [(a, b, num_slots if b == num_layers else int(rows.first_write[b]))
            for a, b in zip(edges, edges[1:])]


def hoistable(rows: ScheduleRow, start: int, end: int) -> bool:
    """Whether layers [start, end) are one block's first layers: a block starts at `start` and
    no other does before `end`, so its write can be made before the loop."""
    boundary = np.asarray(rows.boundary)[start:end]
    return bool(boundary[0]) and not boundary[1:].any()


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


def _hoisted_write_backward(hoist, row: ScheduleRow, cotangent: Carry,
                            final_buffer: SourceBuffer, unroll: bool) -> Carry:
    """The cotangent before a hoisted write (run_lean's `hoist`), from the one after it. Slots
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


def run_lean(step, inputs, carry: Carry, rows: ScheduleRow, unroll: bool = False,
             loops: int = 1, hoist=None, rebuild=None):
    """Forward like run_scan but with the O(S) backward; returns no layer outputs (no routing
    weights, no cache): callers that need them use run_scan. `unroll` writes both loops out
    layer by layer (the same program without while loops, for XLA's cost analysis).

    `loops` > 1 runs the layers as that many consecutive loops, each over only the buffer prefix
    its layers touch (buffer_spans): a site then reads about (loops + 1) / (2 * loops) of the
    slots instead of all S, forward and backward, for one copy of the prefix between loops and
    one loop body to compile per loop.

    `hoist` (delta_block, decoder.HoistedBlockWrite): a loop that is
    one block's first layers (hoistable) gets that block's source committed before its loop,
    so that no layer inside the loop computes a write to mask out (ScheduleRow.write_hoisted);
    the backward pass adds the write's cotangent to the loop's input after the loop.

    `rebuild` (delta with rebuild_states, decoder.DeltaStateRebuild): the forward pass keeps
    only each loop's input state, and each step of the backward loop rebuilds its layer's
    input state from it and the final buffer (a loop over the loop's earlier layers' writes):
    `loops` states are kept instead of one a layer, for a few more reads of the buffer."""
    spans = buffer_spans(rows, carry.buffer.num_slots, loops)
    hoisted = {start for start, end, _ in spans
               if hoist is not None and hoistable(rows, start, end)}

    def row_at(index, within):
        row = rows.at(index, within=within)
        return row.replace(write_hoisted=within[0] in hoisted)

    def layer(inputs_l, c, index, within):
        return _advance(step, inputs_l, c, row_at(index, within))[0]

    def run_forward(inputs, carry: Carry, keep_states: bool):
        state_inputs = []
        for start, end, length in spans:
            if start in hoisted:
                row = rows.at(start)
                write = hoist.write(hoist.source(carry, row), row, carry.buffer)
                carry = carry.replace(buffer=carry.buffer.commit((write,)))
            span_carry = Carry(carry.state, carry.buffer.prefix(length))
            keep_each = keep_states and rebuild is None
            part, states = _over_layers(
                lambda c, xs, within=(start, end): (
                    layer(xs[0], c, xs[1], within), c.state if keep_each else None),
                span_carry, _layer_range(inputs, start, end), start, end, unroll=unroll)
            state_inputs.append(span_carry.state if rebuild is not None else states)
            carry = Carry(part.state, carry.buffer.with_prefix(part.buffer))
        return carry, state_inputs

    @jax.custom_vjp
    def lean(inputs, carry):
        return run_forward(inputs, carry, keep_states=False)[0]

    def forward(inputs, carry):
        final, state_inputs = run_forward(inputs, carry, keep_states=True)
        return final, (inputs, state_inputs, final)

    def backward(residuals, final_cotangent: Carry):
        inputs, state_inputs, final = residuals

        def run_body(within: tuple[int, int], span_input: tuple[int, TokenState] | None):
            def body(carried: tuple[Carry, SourceBuffer], xs):
                cotangent, final_buffer = carried
                (inputs_l, state_in), index = xs
                if span_input is not None:  # rebuild: the loop's input state, not the layer's
                    state_in = span_input[1]
                row = row_at(index, within)
                if within[1] - within[0] == 1:
                    # Outside a loop nothing orders the layer's recompute after the cotangent
                    # that reaches it: XLA would start it early and hold its saved activations
                    # through the backward pass.
                    cotangent, inputs_l, state_in, buffer = jax.lax.optimization_barrier(
                        (cotangent, inputs_l, state_in, final_buffer))
                else:
                    buffer = final_buffer
                if span_input is not None:
                    state_in = rebuild.state(state_in, buffer, rows, span_input[0], index)

                def layer_reads(p, state, buffer):
                    # Over the final buffer: the slots layer `index` had not yet seen are masked
                    # in its sites, so reading them changes nothing and passes them no gradient.
                    out = step(p, Carry(state, buffer), row)
                    return ((out.state, [(w.value, w.inv_rms) for w in out.writes]),
                            [(w.slot, w.when) for w in out.writes])

                _, vjp, targets = jax.vjp(layer_reads, inputs_l, state_in, buffer,
                                          has_aux=True)
                d_writes = [_written_cotangent(cotangent.buffer, slot, when)
                            for slot, when in targets]
                d_inputs, d_state, d_buffer = vjp((cotangent.state, d_writes))
                if not unroll:
                    # The final buffer rides through the loop so that the next span takes its
                    # prefix from the loop's copy (in the layout the loop wants). Passed through
                    # as it is, XLA forwards the copy from before the loop instead and holds both
                    # through it (220M delta_block on v5p: 8.91 against 8.68 GiB a device).
                    final_buffer = jax.lax.optimization_barrier(final_buffer)
                return ((Carry(d_state, jax.tree.map(jnp.add, cotangent.buffer, d_buffer)),
                         final_buffer), d_inputs)
            return body

        # Slots written before the loop (delta's embedding) reach the caller through d_carry.
        # Where nothing after the layers reads the buffer (delta, delta_block) its cotangent
        # arrives as zeros. In the looped program XLA sinks those zeros into the first backward
        # loop as a select over the whole buffer, materialised in every iteration; behind a
        # barrier they are one plain buffer (8B delta on v5p: 42.12 GiB a device without it,
        # 36.37 with it).
        # The unrolled cost twin keeps the constant, as before: it has no loop to sink the
        # zeros into, and XLA folds them away there.
        d_carry = final_cotangent
        if not unroll:
            d_carry = d_carry.replace(buffer=jax.lax.optimization_barrier(d_carry.buffer))
        # Spans run last to first over shrinking prefixes. Once a span is done, the slots its
        # layers wrote have passed their cotangents on (as d_writes) and no earlier layer reads
        # them, so both the cotangent and the final buffer go on as the next span's prefix: the
        # whole-buffer cotangent is not kept, and the caller gets zeros for those slots. The
        # barrier takes each prefix of the final buffer only once the span before it is done;
        # without it XLA slices every prefix right after the forward pass and holds them all
        # (220M delta on v5p: 14.85 against 12.25 GiB a device).
        d_inputs = []
        d_state, d_buffer, final_buffer = d_carry.state, d_carry.buffer, final.buffer
        for (start, end, length), states in zip(reversed(spans), reversed(state_inputs)):
            part, final_prefix = (Carry(d_state, d_buffer.prefix(length)),
                                  final_buffer.prefix(length))
            # With `rebuild`, `states` is the span's input state, which each layer's step reads
            # whole; else the span's per-layer states, one a step.
            span_input = None if rebuild is None else (start, states)
            (part, final_prefix), d_part = _over_layers(
                run_body((start, end), span_input), (part, final_prefix),
                (_layer_range(inputs, start, end), None if rebuild is not None else states),
                start, end, reverse=True, unroll=unroll)
            d_inputs.insert(0, d_part)
            if start in hoisted:
                part = _hoisted_write_backward(hoist, rows.at(start), part, final_prefix, unroll)
            d_state, d_buffer, final_buffer = part.state, part.buffer, final_prefix
            if not unroll:
                d_buffer, final_buffer = jax.lax.optimization_barrier((d_buffer, final_buffer))
        spent = jax.tree.map(jnp.zeros_like, d_carry.buffer)
        d_carry = Carry(d_state, spent.with_prefix(d_buffer))
        if len(d_inputs) > 1:
            d_inputs = [jax.tree.map(lambda *parts: jnp.concatenate(parts), *d_inputs)]
        return d_inputs[0], d_carry

    lean.defvjp(forward, backward)
    return lean(inputs, carry), (None, None)


DRIVERS = {"scan": run_scan, "lean": run_lean, "unrolled": run_unrolled}
