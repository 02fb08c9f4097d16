"""Layer drivers: three ways to run the stacked decoder layers over the carry.

- `scan`: jax.lax.scan over the stacked parameters. Differentiating it saves the whole carry,
  source buffer included, once per layer: O(L*S) activations.
- `lean` (default): the same forward, under a custom_vjp whose backward is a reverse scan that
  rebuilds layer i's input buffer from the final one (every slot is written once, from zero, so
  the input is the final buffer masked to the slots written before layer i) and recomputes the
  layer under jax.vjp. Saves only the residual stream per layer: O(S) buffer memory, the cost of
  one extra forward (the same as full remat).
- `unrolled`: a Python loop with static layer indices; the reference path tests compare against.

Conventions: L layers; `params` is the nnx.State of the stacked layers (leading axis L);
`step(params_l, carry, row) -> (carry, outputs)` runs one layer; `rows` holds the schedule
columns [L] (schedule.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


def run_scan(step, params, carry, rows: dict):
    def body(c, xs):
        params_l, index = xs
        return step(params_l, c, _row(rows, index))

    num_layers = len(next(iter(rows.values())))
    return jax.lax.scan(body, carry, (params, jnp.arange(num_layers)))


def run_unrolled(step, params, carry, rows: dict):
    outputs = []
    num_layers = len(next(iter(rows.values())))
    for index in range(num_layers):
        params_l = jax.tree.map(lambda x: x[index], params)
        carry, out = step(params_l, carry, {k: v[index] for k, v in rows.items()})
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def run_lean(step, params, carry, rows: dict):
    """Forward like run_scan but with the O(S) backward; returns no layer outputs (no routing
    weights, no cache): callers that need them use run_scan."""
    num_layers = len(rows["first_write"])
    indices = jnp.arange(num_layers)
    first_write = jnp.asarray(rows["first_write"])

    def layer(params_l, c, index):
        return step(params_l, c, _row(rows, index))[0]

    @jax.custom_vjp
    def lean(params, carry):
        return jax.lax.scan(lambda c, xs: (layer(xs[0], c, xs[1]), None), carry,
                            (params, indices))[0]

    def forward(params, carry):
        final, h_inputs = jax.lax.scan(lambda c, xs: (layer(xs[0], c, xs[1]), c["h"]), carry,
                                       (params, indices))
        return final, (params, h_inputs, final)

    def backward(residuals, final_cotangent):
        params, h_inputs, final = residuals
        slots = jnp.arange(final["buf"].shape[0])

        def body(cotangent, xs):
            params_l, h_in, index = xs
            # Layer `index` saw the slots written before it; the others were still zero.
            written = slots < first_write[index]
            carry_in = {
                "h": h_in,
                "buf": jnp.where(written[:, None, None, None], final["buf"],
                                 jnp.zeros((), final["buf"].dtype)),
                "rinv": jnp.where(written[:, None, None], final["rinv"], 0.0),
            }
            _, vjp = jax.vjp(lambda p, c: layer(p, c, index), params_l, carry_in)
            d_params, d_carry = vjp(cotangent)
            return d_carry, d_params

        # Slots written before the loop (delta's embedding) reach the caller through d_carry.
        d_carry, d_params = jax.lax.scan(body, final_cotangent, (params, h_inputs, indices),
                                         reverse=True)
        return d_params, d_carry

    lean.defvjp(forward, backward)
    return lean(params, carry), ((), None)


DRIVERS = {"scan": run_scan, "lean": run_lean, "unrolled": run_unrolled}
