"""Layer drivers: three ways to run the stacked decoder layers over the carry.

- `scan`: jax.lax.scan over the stacked parameters. Differentiating it saves the whole carry,
  source buffer included, once per layer: O(L*S) activations.
- `lean` (default, lean.py): the same forward under a custom_vjp whose backward pass recomputes
  each layer from the final buffer: O(S) buffer memory for one extra forward. It runs the
  static layer loops of schedule.layer_loops, hoisting delta_block's block writes out of them.
- `unrolled`: a Python loop with static layer indices; the reference path tests compare against.

Conventions: L layers; types from protocol.py. `step(inputs_l, carry, row) -> LayerOutput` runs
one layer on its slice `inputs_l` of the stacked `inputs` (parameters, and the layer's KV cache
when decoding), reading the buffer; the driver commits the returned writes. `rows` is the
schedule's ScheduleRow of [L] columns, `loops` schedule.layer_loops (the lean driver's alone).
Each driver returns (final Carry, per-layer outputs (routing weights, cache) stacked on a
leading L axis).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from delta_jax.model.lean import run_lean
from delta_jax.model.protocol import Carry, LayerOutput, ScheduleRow

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


def run_scan(step, inputs, carry: Carry, rows: ScheduleRow, loops=(), unroll: bool = False,
             hoist=None, rebuild=None):
    # One loop: its per-layer routing weights are padded to the whole buffer.
    del loops, hoist, rebuild
    def body(c, xs):
        inputs_l, index = xs
        return _advance(step, inputs_l, c, rows.at(index))

    return jax.lax.scan(body, carry, (inputs, jnp.arange(rows.num_layers)), unroll=unroll)


def run_unrolled(step, inputs, carry: Carry, rows: ScheduleRow, loops=(), unroll: bool = True,
                 hoist=None, rebuild=None):
    # Always unrolled, always over the whole buffer (the reference path); its rows are static.
    del unroll, loops, hoist, rebuild
    outputs = []
    for index in range(rows.num_layers):
        inputs_l = jax.tree.map(lambda x: x[index], inputs)
        carry, out = _advance(step, inputs_l, carry, rows.at(index))
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


DRIVERS = {"scan": run_scan, "lean": run_lean, "unrolled": run_unrolled}
