"""The Pallas routing kernel (delta_jax/kernels/routing.py) against the XLA routing site: site
outputs and gradients at tiny shapes, whole models of every variant under the scan and lean
drivers, the shard_map path under a mesh, and (with libtpu) a real TPU compilation.

On CPU the kernel runs in the Pallas interpreter. Tolerances, float32: the kernel sums the
softmax online and in another order, so outputs agree to ~1e-6; the bars are 2e-6 absolute on
site outputs, 1e-5 relative (norm) on site gradients and whole-model gradients, 2e-5 on
model logits. bf16 buffers: the XLA site rounds wg and the weights to bf16 where the kernel
keeps float32, so both are held to 2e-2 of a float32 evaluation on the same bf16 sources.
"""
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from routing_fixtures import open_gates_and_nulls

from delta_jax import ModelConfig, init_model
from delta_jax.config import RUNTIME_FIELDS
from delta_jax.kernels.routing import route_buffer
from delta_jax.model.layers import inverse_rms
from delta_jax.model.protocol import SourceBuffer, Write
from delta_jax.model.routing import RoutingSite
from delta_jax.sharding import make_mesh

SLOTS, BATCH, LENGTH, HIDDEN = 5, 2, 6, 32


def _relative_error(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / (jnp.linalg.norm(a.ravel()) + 1e-30))


def _sources(dtype=jnp.float32, seed=0):
    """A buffer whose every slot holds a source (as the lean driver's final buffer does), a
    fresh source and a live one; values [S,B,T,D] etc."""
    keys = jax.random.split(jax.random.key(seed), 3)
    values = jax.random.normal(keys[0], (SLOTS, BATCH, LENGTH, HIDDEN)).astype(dtype)
    fresh = jax.random.normal(keys[1], (BATCH, LENGTH, HIDDEN)).astype(dtype)
    live = jax.random.normal(keys[2], (BATCH, LENGTH, HIDDEN)).astype(dtype)
    return values, inverse_rms(values, 1e-6), fresh, inverse_rms(fresh, 1e-6), live


def _sites(null_source: bool):
    """An XLA and a Pallas site with the same parameters, routing far from uniform."""
    cfg = ModelConfig.tiny(residual="delta", null_source=null_source, init_std=1.0)
    sites = {k: RoutingSite(cfg.replace(routing_kernel=k), nnx.Rngs(params=1))
             for k in ("xla", "pallas")}
    norm = 1 + 0.5 * jax.random.normal(jax.random.key(2), (HIDDEN,))
    null = jax.random.normal(jax.random.key(3), (HIDDEN,))
    for site in sites.values():
        site.norm[...] = norm
        if site.null is not None:
            site.null[...] = null
    return sites


def _site_run(site, num_valid, *, fresh=False, fresh_when=None, live=False, traced=False,
              dtype=jnp.float32):
    """(mix, weights) and the gradient of a random projection of both w.r.t. the parameters,
    the buffer and the outside sources, jitted."""
    values, inv_rms, fresh_value, fresh_inv, live_value = _sources(dtype)
    graphdef, params = nnx.split(site, nnx.Param)
    pads = (site.null is not None) + SLOTS + live
    keys = jax.random.split(jax.random.key(9), 2)
    d_mix = jax.random.normal(keys[0], (BATCH, LENGTH, HIDDEN))
    d_weights = jax.random.normal(keys[1], (pads, BATCH, LENGTH))

    def loss(params, values, inv_rms, fresh_value, fresh_inv, live_value, num_valid):
        write = (Write(fresh_value, fresh_inv, num_valid, fresh_when) if fresh else None)
        mix, weights = nnx.merge(graphdef, params)(
            SourceBuffer(values, inv_rms), num_valid, fresh=write,
            live=live_value if live else None)
        return (jnp.sum(mix.astype(jnp.float32) * d_mix) + jnp.sum(weights * d_weights),
                (mix, weights))

    args = (params, values, inv_rms, fresh_value, fresh_inv, live_value)
    grad = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)
    if traced:
        (_, outputs), grads = jax.jit(grad)(*args, jnp.int32(num_valid))
    else:
        (_, outputs), grads = jax.jit(lambda *a: grad(*a, num_valid))(*args)
    return outputs, grads


CASES = {
    "partial": dict(num_valid=3),
    "none": dict(num_valid=0),
    "full": dict(num_valid=SLOTS),
    "traced": dict(num_valid=2, traced=True),
    "traced-none": dict(num_valid=0, traced=True),
    "null-fresh": dict(num_valid=2, null=True, fresh=True),
    "null-fresh-live-traced": dict(num_valid=3, null=True, fresh=True, live=True, traced=True),
    "fresh-not-written": dict(num_valid=1, fresh=True, fresh_when=jnp.bool_(False)),
    "null-only": dict(num_valid=0, null=True, live=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_site_matches_xla(case):
    case = dict(case)
    sites = _sites(case.pop("null", False))
    (mix, weights), grads = _site_run(sites["pallas"], **case)
    (want_mix, want_weights), want_grads = _site_run(sites["xla"], **case)
    np.testing.assert_allclose(mix, want_mix, atol=5e-6, rtol=0)
    np.testing.assert_allclose(weights, want_weights, atol=2e-6, rtol=0)
    names = ("params", "values", "inv_rms", "fresh value", "fresh inv_rms", "live")
    for name, got, want in zip(names, grads, want_grads):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if float(jnp.abs(w).max()) == 0:  # e.g. the fresh source's when it is absent
                assert float(jnp.abs(g).max()) == 0, name
            else:
                assert _relative_error(w, g) < 1e-5, name
    # The lean driver recomputes sites over the final buffer: later slots get no gradient.
    for d_buffer in grads[1:3]:
        assert not jnp.any(d_buffer[case["num_valid"]:])


def test_site_matches_xla_with_a_bf16_buffer():
    sites = _sites(null_source=True)
    case = dict(num_valid=3, fresh=True, live=True)
    (mix, weights), grads = _site_run(sites["pallas"], dtype=jnp.bfloat16, **case)
    (xla_mix, xla_weights), xla_grads = _site_run(sites["xla"], dtype=jnp.bfloat16, **case)
    assert mix.dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    # float32 evaluation on the very same (bf16-rounded) sources
    exact_site = _sites(null_source=True)["xla"]
    values, inv_rms, fresh, fresh_inv, live = _sources(jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    want_mix, want_weights = exact_site(
        SourceBuffer(f32(values), inv_rms), 3, fresh=Write(f32(fresh), fresh_inv, 3),
        live=f32(live))
    for got_mix, got_weights in ((mix, weights), (xla_mix, xla_weights)):
        np.testing.assert_allclose(f32(got_mix), want_mix, atol=2e-2, rtol=0)
        np.testing.assert_allclose(got_weights, want_weights, atol=2e-2, rtol=0)
    for got, want in zip(grads, xla_grads):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert _relative_error(w, g) < 2e-2


def test_route_buffer_under_a_mesh_matches_one_device():
    """The shard_map path (tokens split over data and fsdp): outputs and gradients, wg's summed
    over the shards."""
    values, inv_rms, *_ = _sources()
    values = jnp.concatenate([values, values[:, ::-1]], axis=1)  # batch 4: data 2 x fsdp 2
    inv_rms = jnp.concatenate([inv_rms, inv_rms[:, ::-1]], axis=1)
    wg = jax.random.normal(jax.random.key(4), (HIDDEN,))
    d_mix = jax.random.normal(jax.random.key(5), values.shape[1:])

    def loss(values, inv_rms, wg):
        logits, mix = route_buffer(values, inv_rms, wg, 3)
        return jnp.sum(mix * d_mix) + jnp.sum(jnp.where(jnp.isfinite(logits), logits, 0) ** 2)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want_loss, want = run(values, inv_rms, wg)
    with jax.set_mesh(make_mesh(data=2, fsdp=2, tensor=2)):
        got_loss, got = run(values, inv_rms, wg)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w in zip(got, want):
        assert _relative_error(w, g) < 1e-6


def test_route_buffer_with_a_partial_last_token_tile(monkeypatch):
    """B*T = 12 tokens in tiles of 8: the last tile's rows past the end are dropped and kept
    out of d_wg (on TPU, B*T is often 2047 * batch)."""
    import delta_jax.kernels.routing as kernel

    values, inv_rms, *_ = _sources()
    wg = jax.random.normal(jax.random.key(4), (HIDDEN,))
    d_mix = jax.random.normal(jax.random.key(5), values.shape[1:])

    def run():
        def loss(values, inv_rms, wg):
            logits, mix = route_buffer(values, inv_rms, wg, 4)
            finite = jnp.where(jnp.isfinite(logits), logits, 0)
            return jnp.sum(mix * d_mix) + jnp.sum(finite ** 2), (finite, mix)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            values, inv_rms, wg)

    want_outputs, want_grads = run()[0][1], run()[1]
    monkeypatch.setattr(kernel, "_VMEM_BLOCK_BUDGET", 1)
    assert kernel._token_tile(BATCH * LENGTH, HIDDEN, 4, SLOTS) == 8
    (_, outputs), grads = run()
    for got, want in zip((*outputs, *grads), (*want_outputs, *want_grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def _model_loss_and_grads(cfg, driver):
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, 128)
    model = open_gates_and_nulls(init_model(cfg, 5))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(ids[:, :-1], driver=driver)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        return loss, logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return logits, jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("config,drivers", [
    (dict(residual="block", routing_gate=True, gate_base="stream"), ("lean",)),
    (dict(residual="full"), ("lean",)),
    (dict(residual="delta", null_source=True, routing_gate=True), ("scan", "lean")),
    (dict(residual="delta_block", null_source=True), ("lean",)),
], ids=lambda c: c["residual"] if isinstance(c, dict) else "-".join(c))
def test_model_matches_xla(config, drivers):
    """Logits within 2e-5 and the whole gradient within 1e-5 relative of the XLA sites under
    the scan driver. Every variant under the lean driver, whose backward pass recomputes each
    site over the final buffer; the scan driver (the kernel differentiated directly) once, as
    each compile of a model with interpreted kernels takes seconds here."""
    cfg = ModelConfig.tiny(num_layers=3, num_blocks=2, init_std=0.2, **config)
    want_logits, want_grads = _model_loss_and_grads(cfg, "scan")
    for driver in drivers:
        logits, grads = _model_loss_and_grads(cfg.replace(routing_kernel="pallas"), driver)
        np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
        assert _relative_error(want_grads, grads) < 1e-5, driver


def test_routing_kernel_is_a_validated_runtime_field():
    assert "routing_kernel" in RUNTIME_FIELDS
    cfg = ModelConfig.tiny(routing_kernel="pallas")
    assert cfg.architecture() == ModelConfig.tiny().architecture()
    with pytest.raises(ValueError, match=r"routing_kernel='triton' .*xla, pallas"):
        ModelConfig.tiny(routing_kernel="triton")


def _libtpu_missing() -> str | None:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install libtpu==0.0.42.1 to compile for TPU here)"
    return None


@pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))
def test_kernel_compiles_for_tpu():
    """The Mosaic kernels (not the interpreter) lower and compile for a v5p chip from this
    host, forward and backward, at a shape with several token tiles, within VMEM."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    # Compiling needs no chip: let libtpu load beside another process that holds its lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                     sharding=SingleDeviceSharding(device))

    def forward_and_backward(values, inv_rms, wg, num_valid):
        (logits, mix), vjp = jax.vjp(lambda *a: route_buffer(*a, num_valid), values, inv_rms, wg)
        return mix, vjp((jnp.zeros_like(logits), jnp.ones_like(mix)))

    # 2 x 511 tokens: four tiles of 256 rows at D = 1280, the last one partial
    compiled = jax.jit(forward_and_backward).lower(
        spec((9, 2, 511, 1280), jnp.bfloat16), spec((9, 2, 511), jnp.float32),
        spec((1280,), jnp.float32), spec((), jnp.int32)).compile()
    hlo = compiled.as_text()
    assert hlo.count("tpu_custom_call") == 2  # the forward and the backward kernel
    chex.assert_scalar_positive(float(compiled.cost_analysis()["bytes accessed"]))
