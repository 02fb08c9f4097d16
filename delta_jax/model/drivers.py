"""Layer drivers: three ways to run the stacked decoder layers over the carry.

- `scan`: jax.lax.scan over the stacked parameters. Differentiating it saves the whole carry,
  source buffer included, once per layer: O(L*S) activations.
- `lean` (default): the same forward, under a custom_vjp whose backward is a reverse scan that
  rebuilds layer i's input buffer from the final one (every slot is written once, from zero, so
  the input is the final buffer masked to the slots written before layer i) and recomputes the
  layer under jax.vjp. Saves only the per-token state (h, the stream) per layer: O(S) buffer memory, the cost of
  one extra forward (the same as full remat).
- `unrolled`: a Python loop with static layer indices; the reference path tests compare against.

Conventions: L layers; `params` is the nnx.State of the stacked layers (leading axis L);
`step(params_l, carry, row) -> (state, writes, outputs)` runs one layer, reading the buffer and
returning its new per-token state ({"h"} or {"h", "stream"}) and its writes (decoder.py), which
the driver commits; `rows` holds the schedule columns [L] (schedule.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from delta_jax.model.decoder import apply_writes, layer_state

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_sublayer_outputs": jax.checkpoint_policies.save_only_these_names("attn_out",
                                                                           "mlp_out"),
}


def with_remat(step, policy: str):
    if policy == "none":
        return step
    return jax.checkpoint(step, policy=REMAT_POLICIES[policy])


def _row(rows: dict, index) -> dict:
    return {k: jnp.asarray(v)[index] for k, v in rows.items()}


def _advance(step, params_l, carry, row):
    state, writes, outputs = step(params_l, carry, row)
    return apply_writes({**carry, **state}, writes), outputs


def run_scan(step, params, carry, rows: dict):
    def body(c, xs):
        params_l, index = xs
        return _advance(step, params_l, c, _row(rows, index))

    num_layers = len(next(iter(rows.values())))
    return jax.lax.scan(body, carry, (params, jnp.arange(num_layers)))


def run_unrolled(step, params, carry, rows: dict):
    outputs = []
    num_layers = len(next(iter(rows.values())))
    for index in range(num_layers):
        params_l = jax.tree.map(lambda x: x[index], params)
        carry, out = _advance(step, params_l, carry, {k: v[index] for k, v in rows.items()})
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def run_lean(step, params, carry, rows: dict):
    """Forward like run_scan but with the O(S) backward; returns no layer outputs (no routing
    weights, no cache): callers that need them use run_scan."""
    indices = jnp.arange(len(rows["first_write"]))

    def layer(params_l, c, index):
        return _advance(step, params_l, c, _row(rows, index))[0]

    @jax.custom_vjp
    def lean(params, carry):
        return jax.lax.scan(lambda c, xs: (layer(xs[0], c, xs[1]), None), carry,
                            (params, indices))[0]

    def forward(params, carry):
        final, state_inputs = jax.lax.scan(
            lambda c, xs: (layer(xs[0], c, xs[1]), layer_state(c)), carry, (params, indices))
        return final, (params, state_inputs, final)

    def backward(residuals, final_cotangent):
        params, state_inputs, final = residuals

        def body(cotangent, xs):
            params_l, state_in, index = xs
            row = _row(rows, index)

            def layer_reads(p, state, buf, rinv):
                # Over the final buffer: the slots layer `index` had not yet seen are masked in
                # its sites, so reading them changes nothing and passes them no gradient.
                state_out, writes, _ = step(p, {**state, "buf": buf, "rinv": rinv}, row)
                return ((state_out, [(w.value, w.rinv) for w in writes]),
                        [(w.slot, w.when) for w in writes])

            _, vjp, slots = jax.vjp(layer_reads, params_l, state_in, final["buf"],
                                    final["rinv"], has_aux=True)
            # A written value's cotangent is what later layers' reads left in its slot.
            d_writes = [tuple(jnp.where(when, jax.lax.dynamic_index_in_dim(
                cotangent[key], slot, keepdims=False), 0) for key in ("buf", "rinv"))
                for slot, when in slots]
            d_params, d_state, d_buf, d_rinv = vjp((layer_state(cotangent), d_writes))
            return {**d_state, "buf": cotangent["buf"] + d_buf,
                    "rinv": cotangent["rinv"] + d_rinv}, d_params

        # Slots written before the loop (delta's embedding) reach the caller through d_carry.
        d_carry, d_params = jax.lax.scan(body, final_cotangent, (params, state_inputs, indices),
                                         reverse=True)
        return d_params, d_carry

    lean.defvjp(forward, backward)
    return lean(params, carry), ((), None)


DRIVERS = {"scan": run_scan, "lean": run_lean, "unrolled": run_unrolled}
