"""The optimizer: schedule values, AdamW with the routing parameters' own lr, weight-decay mask."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from delta_jax.train.config import OptimizerConfig
from delta_jax.train.optimizer import decay_mask, lr_schedule, make_optimizer, param_groups


def params():
    """The shape of a model's pure parameter dict, in miniature."""
    ones = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    return {"embed_tokens": ones(6, 4), "lm_head": ones(4, 6), "norm": {"scale": ones(4)},
            "final_site": {"query": ones(4), "norm": ones(4)},
            "layers": {"input_layernorm": {"scale": ones(2, 4)},
                       "self_attn": {"q_proj": ones(2, 4, 2, 2), "q_norm": {"scale": ones(2, 2)}},
                       "mlp": {"up_proj": ones(2, 4, 8)},
                       "attn_site": {"query": ones(2, 4), "norm": ones(2, 4),
                                     "gate": ones(2)}}}


def test_schedule_values_at_known_steps():
    lr = lr_schedule(6e-4, 6e-5, warmup_steps=1000, decay_steps=10_000)
    expected = {0: 0.0, 500: 3e-4, 1000: 6e-4, 5500: (6e-4 + 6e-5) / 2, 10_000: 6e-5,
                12_000: 6e-5}
    for step, value in expected.items():
        np.testing.assert_allclose(lr(step), value, rtol=1e-5, atol=1e-12, err_msg=str(step))
    # Cosine: a quarter of the way through the decay sits at
    # floor + (peak - floor)(1 + cos(pi/4))/2.
    quarter = 6e-5 + (6e-4 - 6e-5) * (1 + np.cos(np.pi / 4)) / 2
    np.testing.assert_allclose(lr(1000 + 9000 // 4), quarter, rtol=1e-5)
    # No warmup starts at the peak; a run shorter than its warmup stays on the ramp.
    np.testing.assert_allclose(lr_schedule(1e-3, 0.0, 0, 100)(0), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(lr_schedule(1e-3, 0.0, 10, 5)(5), 5e-4, rtol=1e-6)


def test_groups_and_decay_masks():
    p = params()
    groups = param_groups(p)
    assert groups["final_site"]["query"] == groups["layers"]["attn_site"]["gate"] == "routing"
    assert groups["embed_tokens"] == groups["layers"]["mlp"]["up_proj"] == "base"
    assert all(jax.tree.leaves(decay_mask(p, "all")))
    m = decay_mask(p, "matrices")
    decayed = {"lm_head", "layers/self_attn/q_proj", "layers/mlp/up_proj"}
    for path, value in jax.tree_util.tree_leaves_with_path(m):
        name = "/".join(k.key for k in path)
        assert value == (name in decayed), name


def first_update(cfg: OptimizerConfig, grads):
    tx = make_optimizer(cfg, total_steps=100)
    p = params()
    updates, _ = jax.jit(tx.update)(grads, tx.init(p), p)
    return updates


def test_routing_parameters_get_their_own_learning_rate():
    cfg = OptimizerConfig(lr=1e-3, routing_lr=5e-2, warmup_steps=0, weight_decay=0.0)
    grads = jax.tree.map(lambda x: 1e-3 * jnp.ones_like(x), params())
    updates = first_update(cfg, grads)
    # Adam's first step moves every coordinate by lr (m / sqrt(v) = 1 after bias correction).
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        name = "/".join(k.key for k in path)
        lr = 5e-2 if "site" in name else 1e-3
        np.testing.assert_allclose(u, -lr, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("mode", ["all", "matrices"])
def test_weight_decay_follows_the_mask(mode):
    cfg = OptimizerConfig(lr=1e-2, routing_lr=1e-1, warmup_steps=0, weight_decay=0.5, decay=mode)
    updates = first_update(cfg, jax.tree.map(jnp.zeros_like, params()))
    mask = decay_mask(params(), mode)
    groups = param_groups(params())
    for u, decays, group in zip(jax.tree.leaves(updates), jax.tree.leaves(mask),
                                jax.tree.leaves(groups)):
        lr = 1e-1 if group == "routing" else 1e-2
        np.testing.assert_allclose(u, -lr * 0.5 if decays else 0.0, rtol=1e-5)


def test_the_chain_is_adamw_after_global_norm_clipping():
    """Two steps against optax.adamw behind clip_by_global_norm; the first gradient is clipped."""
    cfg = OptimizerConfig(lr=1e-2, min_lr=1e-2, warmup_steps=0, weight_decay=0.1, clip_norm=1.0)
    reference = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
    unclipped = optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    p = params()
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda x, s=s: s * rng.standard_normal(x.shape, np.float32), p)
             for s in (100.0, 0.01)]
    results = []
    for tx in (make_optimizer(cfg, total_steps=10), reference, unclipped):
        @jax.jit
        def two_steps(q, tx=tx):
            state = tx.init(q)
            for g in grads:
                updates, state = tx.update(g, state, q)
                q = optax.apply_updates(q, updates)
            return q

        results.append(two_steps(p))
    mine, ref, plain = results
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), mine, ref)
    assert not np.allclose(mine["lm_head"], plain["lm_head"], rtol=1e-3)
