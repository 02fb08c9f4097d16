"""routing_logits="write": each source's logits at every site, computed once when it is written,
give the same model as the sites forming them from the buffer ("read")."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from routing_fixtures import open_gates_and_nulls

from delta_jax.config import RUNTIME_FIELDS, ModelConfig
from delta_jax.model.causal_lm import init_model
from delta_jax.model.protocol import SourceBuffer, Write

VARIANTS = {
    "block_stream_gate": dict(residual="block", routing_gate=True, gate_base="stream"),
    "full": dict(residual="full"),
    "delta_null_gate": dict(residual="delta", null_source=True, routing_gate=True),
    "delta_block_null": dict(residual="delta_block", null_source=True),
    "delta_block_paper": dict(residual="delta_block", block_sources="paper"),
}


def _model(cfg: ModelConfig):
    return open_gates_and_nulls(init_model(cfg, 5))


def _logits_and_grads(cfg: ModelConfig, driver: str):
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    graphdef, params, rest = nnx.split(_model(cfg), nnx.Param, ...)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(ids[:, :-1], driver=driver)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return logits, grads


def _relative_error(want, got) -> float:
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    return float(jnp.linalg.norm(flat(got) - flat(want)) / jnp.linalg.norm(flat(want)))


@pytest.mark.parametrize("config", VARIANTS.values(), ids=VARIANTS.keys())
def test_write_time_logits_match_read_time_logits(config):
    """Every routing variant under the lean driver (its backward pass carries the site logits'
    cotangent) and the unrolled one (the planner's cost twin), and delta under scan too: logits
    within 1e-5 and the whole gradient (the sites' queries and norm scales included, which now
    reach the loss through the buffer's site logits) within 1e-5 relative of the sites reading
    the buffer under the scan driver."""
    cfg = ModelConfig.tiny(num_layers=3, num_blocks=2, init_std=0.2, **config)
    want_logits, want_grads = _logits_and_grads(cfg, "scan")
    drivers = ("lean", "unrolled") + (("scan",) if cfg.residual == "delta" else ())
    for driver in drivers:
        logits, grads = _logits_and_grads(cfg.replace(routing_logits="write"), driver)
        np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0, err_msg=driver)
        assert _relative_error(want_grads, grads) < 1e-5, driver
        # The MLP sites see 2+ sources in every variant here: a query gradient that is not zero.
        assert float(jnp.abs(grads["layers"]["mlp_site"]["query"][...]).max()) > 0, driver


def test_routing_weights_and_decoding_match():
    """The reported routing weights, and prefill plus one decoding step through the KV cache,
    agree with the read-time form (delta, the variant with the most sources)."""
    cfg = ModelConfig.tiny(num_layers=3, residual="delta", init_std=0.2)
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    outputs = {}
    for when in ("read", "write"):
        model = _model(cfg.replace(routing_logits=when))
        routed = model.forward(ids, return_routing=True)
        cache = model.init_cache(2, 16)
        prefill = model.forward(ids[:, :8], cache=cache)
        step = model.forward(ids[:, 8:], cache=prefill.cache)
        outputs[when] = (routed.routing.weights, routed.logits, prefill.logits, step.logits)
    for got, want in zip(outputs["write"], outputs["read"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_the_buffer_holds_each_sources_logit_at_every_site():
    """A committed source's column of site_logits is inv_rms * (wg . value) for every site, and a
    write that does not happen (when=False) leaves the slot's zeros."""
    queries = jax.random.normal(jax.random.key(0), (5, 8))
    buffer = SourceBuffer.zeros(3, 2, 4, 8, jnp.float32, site_queries=queries)
    chex.assert_shape(buffer.site_logits, (3, 5, 2, 4))
    value = jax.random.normal(jax.random.key(1), (2, 4, 8))
    write = Write.of(value, 1, 1e-6, site_queries=queries)
    skipped = Write.of(2 * value, 2, 1e-6, when=jnp.array(False), site_queries=queries)
    buffer = buffer.commit((write, skipped))
    rms = jnp.sqrt(jnp.mean(value**2, axis=-1) + 1e-6)
    want = jnp.einsum("btd,gd->gbt", value, queries) / rms
    np.testing.assert_allclose(buffer.site_logits[1], want, rtol=1e-5, atol=1e-5)
    assert not np.any(buffer.site_logits[np.array([0, 2])])
    assert not np.any(buffer.values[2])
    with pytest.raises(ValueError, match="site logits"):
        buffer.commit((Write.of(value, 0, 1e-6),))


def test_routing_logits_is_a_validated_runtime_field():
    assert "routing_logits" in RUNTIME_FIELDS
    assert (ModelConfig.tiny(routing_logits="write").architecture()
            == ModelConfig.tiny().architecture())
    with pytest.raises(ValueError, match=r"routing_logits='later' .*read, write"):
        ModelConfig.tiny(routing_logits="later")
    with pytest.raises(ValueError, match="routing_kernel='pallas'"):
        ModelConfig.tiny(routing_kernel="pallas", routing_logits="write")
