"""Model set-up shared by the tests that compare routing paths."""
import jax
import jax.numpy as jnp


def open_gates_and_nulls(model):
    """Gates open (0.7) and null sources off zero, so that every routed term counts."""
    for site in (model.layers.attn_site, model.layers.mlp_site, model.final_site):
        if site is None:
            continue
        if site.gate is not None:
            site.gate[...] = jnp.full(site.gate.shape, 0.7)
        if site.null is not None:
            site.null[...] = jax.random.normal(jax.random.key(3), site.null.shape)
    return model
