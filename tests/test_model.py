"""Model properties beyond the golden files: shapes, source counts, the three layer drivers,
zero-query equivalences, parameter counts and config validation."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import CausalLM, ModelConfig, count_params, init_model
from delta_jax.model.drivers import with_remat
from delta_jax.model.layers import inverse_rms, rope_tables
from delta_jax.model.protocol import Carry, LayerContext, SourceBuffer, TokenState
from delta_jax.model.routing import RoutingSite, weighted_sum
from delta_jax.model.schedule import layer_loops, schedule
from numerics import assert_float32_equal
from reference_forward import reference_forward

VARIANTS = ["baseline", "block", "full", "delta", "delta_block"]
SLOW = pytest.mark.slow  # the quick suite (make test) keeps one or two cases of a family
IDS = jax.random.randint(jax.random.key(0), (2, 12), 0, 128)


def tiny(**overrides):
    return ModelConfig.tiny(init_std=0.2, **overrides)


def expected_site_sources(residual: str, num_layers: int, num_blocks: int):
    """docs/spec.md section 3, counted by hand: [(attn, mlp) per layer], final."""
    lpb = max(1, math.ceil(num_layers / num_blocks))
    blocks_before = lambda l: sum(1 for k in range(l) if k % lpb == 0)
    if residual == "full":
        return [(2 * l + 1, 2 * l + 2) for l in range(num_layers)], 2 * num_layers + 1
    if residual == "block":
        return ([(blocks_before(l) + 1, blocks_before(l + 1) + 1) for l in range(num_layers)],
                blocks_before(num_layers) + 1)
    if residual == "delta":
        return [(2 * l + 1 if l else 0, 2 * l + 2) for l in range(num_layers)], 0
    if residual == "delta_block":
        return [(blocks_before(l), blocks_before(l + 1)) for l in range(num_layers)], 0
    return [(0, 0)] * num_layers, 0


@pytest.mark.parametrize("residual", VARIANTS[1:])
@pytest.mark.parametrize("num_layers,num_blocks", [
    (4, 2), *[pytest.param(*geometry, marks=SLOW) for geometry in ((5, 2), (6, 4), (3, 8))]])
def test_sources_per_site_match_spec(residual, num_layers, num_blocks):
    cfg = tiny(residual=residual, num_layers=num_layers, num_blocks=num_blocks)
    model = init_model(cfg, 1)
    routing = model.forward(IDS[:, :6], return_routing=True).routing
    sites, final = expected_site_sources(residual, num_layers, num_blocks)
    np.testing.assert_array_equal(routing.num_sources, np.array(sites))
    assert routing.final_sources == final
    for l, (attn, mlp) in enumerate(sites):
        for s, count in ((0, attn), (1, mlp)):
            weights = routing.site_weights(l, s)
            chex.assert_shape(weights, (count, 2, 6))
            # the padded weights hold exactly `count` live slots, summing to one per token
            padded = np.asarray(routing.weights[l, s])
            if count:
                np.testing.assert_allclose(padded.sum(0), 1.0, atol=1e-6)
                assert (padded > 0).sum(0).max() == count


@pytest.mark.parametrize("config", [
    pytest.param(dict(residual="delta_block", block_sources="paper", num_layers=5, num_blocks=2),
                 marks=SLOW),
    pytest.param(dict(residual="delta_block", block_sources="reference", num_layers=5,
                      num_blocks=3), marks=SLOW),  # the golden files cover it in the quick suite
    pytest.param(dict(residual="delta", null_source=True, routing_gate=True), marks=SLOW),
    pytest.param(dict(residual="delta_block", null_source=True, num_layers=6, num_blocks=3),
                 marks=SLOW),
    dict(residual="block", num_layers=5, num_blocks=3, routing_gate=True),
    pytest.param(dict(residual="full", num_layers=3), marks=SLOW),
    pytest.param(dict(residual="block", num_layers=5, num_blocks=3, routing_gate=True,
                      gate_base="stream"), marks=SLOW),
    pytest.param(dict(residual="full", num_layers=3, routing_gate=True, gate_base="stream"),
                 marks=SLOW),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_scan_matches_literal_spec(config):
    """Configs the golden files do not cover, against a list-based transcription of the spec."""
    model = _set_gates(init_model(tiny(**config), 2), 0.7)  # gates and null sources off zero
    for layer_site in (model.layers.attn_site, model.layers.mlp_site):
        if layer_site.null is not None:
            layer_site.null[...] = jax.random.normal(jax.random.key(3), layer_site.null.shape)
    out = jax.jit(lambda ids: model.forward(ids, return_routing=True))(IDS)
    logits, routing = out.logits, out.routing
    want_logits, want_calls = reference_forward(model, IDS)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    calls = routing.calls()
    assert [c.shape for c in calls] == [c.shape for c in want_calls]
    for ours, theirs in zip(calls, want_calls):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@SLOW
def test_public_output_shapes():
    cfg = tiny(residual="block", num_layers=3, num_blocks=2, tie_word_embeddings=False)
    model = init_model(cfg, 0)
    out = model.forward(IDS, return_routing=True)
    logits, routing, hidden = out.logits, out.routing, out.hidden
    chex.assert_shape(logits, (2, 12, 128))
    chex.assert_shape(hidden, (2, 12, 32))
    n_pad = model.schedule.num_slots + 1  # committed slots + the live partial
    chex.assert_shape(routing.weights, (3, 2, n_pad, 2, 12))
    chex.assert_shape(routing.final, (n_pad, 2, 12))
    stats = routing.statistics()
    for key in ("max_weight", "entropy", "normalized_entropy"):
        chex.assert_shape(stats[key], (3, 2))
        chex.assert_shape(stats["final_" + key], ())
        chex.assert_tree_all_finite(stats[key])
    cache = model.init_cache(2, 16)
    out = model.forward(IDS[:, :4], cache=cache)
    step_logits, cache = out.logits, out.cache
    chex.assert_shape(step_logits, (2, 4, 128))
    chex.assert_shape([cache.k, cache.v], [(3, 2, 16, 2, 8)] * 2)
    assert int(cache.length) == 4


def test_routing_statistics_definitions():
    model = init_model(tiny(residual="delta"), 4)
    routing = model.forward(IDS, return_routing=True).routing
    stats = routing.statistics()
    alpha = np.asarray(routing.site_weights(2, 1), np.float64)  # [N,B,T]
    entropy = -(alpha * np.log(alpha)).sum(0).mean()
    np.testing.assert_allclose(stats["max_weight"][2, 1], alpha.max(0).mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["entropy"][2, 1], entropy, rtol=1e-5)
    np.testing.assert_allclose(stats["normalized_entropy"][2, 1],
                               entropy / np.log(alpha.shape[0]), rtol=1e-5)
    assert np.isnan(stats["max_weight"][0, 0])  # delta's layer-0 attention site is unused


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6),
                                             pytest.param(jnp.bfloat16, 1e-2, marks=SLOW)])
def test_weighted_sum_has_autodiffs_gradient(dtype, tolerance):
    """routing.weighted_sum (a site's mix: the buffer's slots and the sources outside it) keeps
    its cotangent in the buffer's dtype; its value and gradient are autodiff's of the float32
    sum. The weights' gradients sum over D in another order: float32 agrees to ~1e-7, bf16 to
    its rounding."""
    def plain(weights, values, outside):
        mix = jnp.einsum("sbt,sbtd->btd", weights, values, preferred_element_type=jnp.float32)
        for weight, value in outside:
            mix = mix + weight[..., None] * value.astype(jnp.float32)
        return mix.astype(values.dtype)

    keys = jax.random.split(jax.random.key(0), 5)
    weights = jax.nn.softmax(jax.random.normal(keys[0], (6, 2, 6)), axis=0)
    values = jax.random.normal(keys[1], (4, 2, 6, 32)).astype(dtype)
    outside = ((weights[4], jax.random.normal(keys[2], (2, 6, 32)).astype(dtype)),
               (weights[5], jax.random.normal(keys[3], (2, 6, 32)).astype(dtype)))
    cotangent = jax.random.normal(keys[4], (2, 6, 32)).astype(dtype)
    args = (weights[:4].astype(dtype), values, outside)
    ours, ours_vjp = jax.vjp(weighted_sum, *args)
    theirs, theirs_vjp = jax.vjp(plain, *args)
    assert ours.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    for mine, autodiffs in zip(jax.tree.leaves(ours_vjp(cotangent)),
                               jax.tree.leaves(theirs_vjp(cotangent))):
        assert mine.dtype == autodiffs.dtype
        assert _relative_error(autodiffs.astype(jnp.float32),
                               mine.astype(jnp.float32)) < tolerance


@pytest.mark.parametrize("num_valid", [pytest.param(0, marks=SLOW), pytest.param(1, marks=SLOW),
                                       "traced"])
def test_a_site_over_one_slot_is_the_softmax_over_one_source(num_valid):
    """Over a one-slot buffer (delta_block's first lean loop) a site skips the logit and the
    sum: its mix, weights and gradients are those of the full softmax path over a two-slot
    buffer that masks the second slot (a softmax over one source is exactly 1; to float32
    rounding, the two being different programs)."""
    cfg = ModelConfig.tiny(residual="delta_block", num_layers=2, num_blocks=2)
    keys = jax.random.split(jax.random.key(1), 4)
    site = RoutingSite(cfg, nnx.Rngs(3))
    site.query[...] = jax.random.normal(keys[0], site.query.shape)
    site.norm[...] = 1 + jax.random.normal(keys[1], site.norm.shape)
    graphdef, params = nnx.split(site)
    values = jax.random.normal(keys[2], (2, 2, 5, cfg.hidden_size))
    cotangent = jax.random.normal(keys[3], (2, 5, cfg.hidden_size))

    def route(params, values, count):
        site = nnx.merge(graphdef, params)
        buffer = SourceBuffer(values, inverse_rms(values, cfg.rms_norm_eps))
        return site(buffer, count)

    def mix_and_gradient(slots):
        run = jax.jit(route) if num_valid == "traced" else route
        count = jnp.int32(1) if num_valid == "traced" else num_valid
        (mix, weights), pullback = jax.vjp(lambda p, v: run(p, v, count), params,
                                           values[:slots])
        d_params, d_values = pullback((cotangent, jnp.zeros_like(weights)))
        return mix, weights[:1], d_params, d_values[:1]

    one, full = mix_and_gradient(1), mix_and_gradient(2)
    assert_float32_equal(one, full)
    assert float(jnp.abs(one[1]).max()) == (0.0 if num_valid == 0 else 1.0)


def _set_gates(model: CausalLM, value: float) -> CausalLM:
    for site in (model.layers.attn_site, model.layers.mlp_site, model.final_site):
        if site is not None and site.gate is not None:
            site.gate[...] = jnp.full(site.gate.shape, value)
    return model


def _loss_and_grads(cfg, driver, gate=None):
    model = init_model(cfg, 5)
    if gate is not None:
        _set_gates(model, gate)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(IDS[:, :-1], driver=driver)
        return optax.softmax_cross_entropy_with_integer_labels(logits, IDS[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def _relative_error(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / (jnp.linalg.norm(a.ravel()) + 1e-30))


@pytest.mark.parametrize("residual,extra,gate", [
    *[pytest.param(residual, {}, None, marks=SLOW) for residual in ("baseline", "block", "full")],
    pytest.param("delta", dict(null_source=True, routing_gate=True), None, marks=SLOW),
    ("delta_block", dict(null_source=True, routing_gate=True), None),
    # the residual stream travels in the carry: its cotangent must cross the lean backward too
    *[pytest.param(residual, dict(routing_gate=True, gate_base="stream"), 0.5, marks=SLOW)
      for residual in ("block", "full")],
], ids=["baseline", "block", "full", "delta", "delta_block", "block-stream", "full-stream"])
def test_gradients_scan_and_lean_equal_unrolled(residual, extra, gate):
    """Relative 1e-5 over the whole gradient; 1e-4 per parameter (float32 sums of thousands of
    terms in another order differ by a few 1e-6 relative, more for near-cancelling scalars)."""
    cfg = ModelConfig.tiny(residual=residual, num_layers=3, num_blocks=2, **extra)
    want_loss, want = _loss_and_grads(cfg, "unrolled", gate)
    want_flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(want)])
    runs = [("scan", cfg), ("lean", cfg), *[("lean", cfg.replace(layer_loops=loops))
                                            for loops in (2, 3)]]
    for driver, run_cfg in runs:
        loss, grads = _loss_and_grads(run_cfg, driver, gate)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
        assert _relative_error(want_flat, flat) < 1e-5, driver
        for (path, g), g_want in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree.leaves(want)):
            if float(jnp.abs(g_want).max()) == 0.0:  # e.g. the queries behind a zero gate
                assert float(jnp.abs(g).max()) == 0.0, (driver, jax.tree_util.keystr(path))
            else:  # a scalar whose terms nearly cancel may differ relatively, not absolutely
                scale = float(jnp.abs(want_flat).max())
                close = (_relative_error(g_want, g) < 1e-4
                         or float(jnp.abs(g - g_want).max()) < 1e-6 * scale)
                assert close, (driver, jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["delta", "full"])
def test_remat_policies_keep_the_gradient_and_save_the_routed_input(residual, capsys):
    """Every remat policy gives the no-remat gradient (lean and scan drivers); save_dots keeps
    each site's routed sublayer input, so the layer's backward does not read the buffer again
    to rebuild it."""
    cfg = ModelConfig.tiny(residual=residual, num_layers=3)
    want_loss, want = _loss_and_grads(cfg, "scan")
    want_flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(want)])
    for remat in ("full", "save_dots", "save_sublayer_outputs"):
        for driver in ("lean", "scan"):
            loss, grads = _loss_and_grads(cfg.replace(remat=remat), driver)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
            flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
            assert _relative_error(want_flat, flat) < 1e-5, (remat, driver)

    model = init_model(cfg, 0)
    graphdef, stacked = nnx.split(model.layers)
    plan, (batch, length) = model.schedule, IDS.shape
    rope = rope_tables(jnp.broadcast_to(jnp.arange(length), IDS.shape), cfg.head_dim,
                       cfg.rope_theta)
    buffer = SourceBuffer.zeros(plan.num_slots, batch, length, cfg.hidden_size, jnp.float32)

    def layer_sum(params, h):
        carry = Carry(TokenState(h, None), buffer)
        out = nnx.merge(graphdef, params)(carry, plan.rows().at(1), LayerContext(rope))
        return out.state.h.sum()

    second_layer = jax.tree.map(lambda x: x[1], stacked)
    h = jnp.ones((batch, length, cfg.hidden_size))
    jax.ad_checkpoint.print_saved_residuals(with_remat(layer_sum, "save_dots"), second_layer, h)
    saved = capsys.readouterr().out
    assert saved.count("named 'routed_input'") == 2, saved  # the attention and MLP sites'


@pytest.mark.parametrize("residual", VARIANTS[1:])
@pytest.mark.parametrize("loops", [1, 2, 3, 5, 9])
def test_layer_loops_cover_the_layers_and_every_slot_they_touch(residual, loops):
    cfg = ModelConfig.tiny(residual=residual, num_layers=5, num_blocks=2, layer_loops=loops)
    plan = schedule(cfg)
    spans = layer_loops(cfg, plan)
    assert len(spans) == min(loops, 5)
    assert [loop.start for loop in spans] == [0] + [loop.end for loop in spans[:-1]]
    assert (spans[-1].end, spans[-1].prefix) == (5, plan.num_slots)
    for loop in spans:
        assert loop.prefix <= plan.num_slots
        for layer in range(loop.start, loop.end):  # reads and writes stay inside the prefix
            assert plan.mlp_visible[layer] <= loop.prefix
            assert plan.attn_visible[layer] <= loop.prefix
            assert plan.first_write[layer] <= loop.prefix
    # only delta_block hoists, and only a loop that is one block's first layers (blocks of 3)
    hoisted = [loop.hoisted for loop in spans]
    assert hoisted == ([(loop.start, loop.end) in [(0, 2), (0, 1), (3, 5), (3, 4)]
                        for loop in spans] if residual == "delta_block" else [False] * len(spans))


@pytest.mark.parametrize("residual", [pytest.param("block", marks=SLOW), "delta_block"])
def test_layers_known_to_start_no_block_skip_their_write(residual):
    """Over a layer loop inside one block (schedule.layer_loops, one that does not begin at a
    block boundary) the rows know statically that no layer starts a block, and a layer then
    commits nothing instead of computing a write and masking it out: the same state."""
    cfg = tiny(residual=residual, num_layers=6, num_blocks=2)
    rows = schedule(cfg).rows()
    index = jnp.asarray(1)
    assert rows.at(index, within=(1, 3)).starts_block is False
    assert rows.at(index, within=(0, 1)).starts_block is True
    assert rows.at(index, within=(0, 3)).starts_block is None
    assert rows.at(index).starts_block is None and rows.at(3).starts_block is True

    model = init_model(cfg, 0)
    graphdef, stacked = nnx.split(model.layers)
    batch, length = IDS.shape
    rope = rope_tables(jnp.broadcast_to(jnp.arange(length), IDS.shape), cfg.head_dim,
                       cfg.rope_theta)
    buffer = SourceBuffer.zeros(schedule(cfg).num_slots, batch, length, cfg.hidden_size,
                                jnp.float32)
    h = jnp.ones((batch, length, cfg.hidden_size))
    layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[1], stacked))
    out = layer(Carry(TokenState(h, None), buffer), rows.at(index, within=(1, 3)),
                LayerContext(rope))
    assert out.writes == ()
    traced = layer(Carry(TokenState(h, None), buffer), rows.at(index), LayerContext(rope))
    assert len(traced.writes) == 1 and traced.writes[0].when is not None
    np.testing.assert_array_equal(out.state.h, traced.state.h)


@pytest.mark.parametrize("extra", [
    pytest.param(dict(layer_loops=2), marks=SLOW),  # delta_block's gradient test hoists too
    pytest.param(dict(layer_loops=3, remat="save_dots", unroll_layers=True), marks=SLOW),
    pytest.param(dict(layer_loops=2, block_sources="paper", null_source=True, routing_gate=True),
                 marks=SLOW),
])
def test_hoisted_block_writes_keep_the_function_and_its_gradient(extra, monkeypatch):
    """The lean driver commits delta_block's source before a loop that is one block's first
    layers, and no layer inside computes a write: the same loss and gradient as the unrolled
    reference. With 2 loops over 2 blocks of 3 layers both are hoisted; with 3 loops only the
    first ([0, 2)), the others keep their masked write."""
    from delta_jax.model.decoder import HoistedBlockWrite

    cfg = tiny(residual="delta_block", num_layers=6, num_blocks=2, **extra)
    assert [loop.hoisted for loop in layer_loops(cfg, schedule(cfg))] == (
        [True, True] if cfg.layer_loops == 2 else [True, False, False])
    gate = 0.7 if cfg.routing_gate else None
    want_loss, want = _loss_and_grads(cfg.replace(unroll_layers=False), "unrolled", gate)
    hoisted_slots, original = set(), HoistedBlockWrite.source

    def spy(self, carry, row):
        hoisted_slots.add(int(row.first_write))
        return original(self, carry, row)

    monkeypatch.setattr(HoistedBlockWrite, "source", spy)
    loss, grads = _loss_and_grads(cfg, "lean", gate)
    assert hoisted_slots == ({0, 1} if cfg.layer_loops == 2 else {0})
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    flat = lambda tree: jnp.concatenate([g.ravel() for g in jax.tree.leaves(tree)])
    assert _relative_error(flat(want), flat(grads)) < 1e-5


@pytest.mark.parametrize("extra", [
    dict(layer_loops=1),
    pytest.param(dict(layer_loops=3), marks=SLOW),
    pytest.param(dict(layer_loops=2, null_source=True, routing_gate=True, remat="save_dots"),
                 marks=SLOW),
])
def test_delta_states_rebuilt_from_the_buffer_keep_the_gradient(extra, monkeypatch):
    """With rebuild_states the lean driver keeps each loop's input state only and rebuilds its
    layers' states from the buffer in the backward pass: in float32 the same sums as the
    forward's, so the same loss and gradient (to float32 rounding: another program); and it
    does rebuild, once a loop."""
    from delta_jax.model.decoder import DeltaStateRebuild

    cfg = tiny(residual="delta", num_layers=6, **extra)
    gate = 0.7 if cfg.routing_gate else None
    want_loss, want = _loss_and_grads(cfg, "lean", gate)
    rebuilt, original = [], DeltaStateRebuild.state

    def spy(self, first, buffer, rows, start, index):
        rebuilt.append(start)
        return original(self, first, buffer, rows, start, index)

    monkeypatch.setattr(DeltaStateRebuild, "state", spy)
    loss, grads = _loss_and_grads(cfg.replace(rebuild_states=True), "lean", gate)
    # once in each loop's body (traced once), from the loop's first layer
    assert sorted(rebuilt) == [loop.start for loop in layer_loops(cfg, schedule(cfg))]
    assert_float32_equal(loss, want_loss)
    assert_float32_equal(grads, want)


def _with_params_of(target: CausalLM, source: CausalLM) -> CausalLM:
    """Copy every parameter both models have (same path) from source into target."""
    src = nnx.state(source, nnx.Param).flat_state()
    dst = nnx.state(target, nnx.Param)
    flat = dst.flat_state()
    for path, variable in flat:
        if path in dict(src):
            variable.set_value(dict(src)[path].get_value())
    nnx.update(target, nnx.State.from_flat_path(flat))
    return target


def _zero_query_differences(**config):
    baseline = init_model(tiny(residual="baseline", **config), 6)
    want = baseline(IDS)
    differences = {}
    for residual in VARIANTS[1:]:
        cfg = tiny(residual=residual, router_init="zeros", **config)
        model = _with_params_of(init_model(cfg, 7), baseline)
        differences[residual] = float(jnp.abs(model(IDS) - want).max())
    return differences


@pytest.mark.slow
def test_zero_queries_give_the_baseline_except_delta_block(capsys):
    """Uniform weights route the mean of sources that sum to the baseline's residual state, and
    the next RMSNorm removes the 1/N: exact up to RMSNorm's eps, which then acts as N^2 eps.
    With eps -> 0 the identity is checked to float32 rounding; at eps 1e-6 the gap is printed."""
    exact = _zero_query_differences(rms_norm_eps=1e-12)
    with_eps = _zero_query_differences()
    with capsys.disabled():
        for name, diffs in (("eps 1e-12", exact), ("eps 1e-6", with_eps)):
            print(f"\nmax |logits - baseline| with zero queries, {name}: " +
                  ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    for residual in ("block", "full", "delta"):
        assert exact[residual] < 1e-5, residual
    # delta_block routes over the previous blocks only: a real change of the function
    assert exact["delta_block"] > 1e-1


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["block", "full"])
def test_stream_gate_spans_the_baseline_and_attnres(residual):
    """gate_base='stream': every gate at 0 is the plain Qwen3 (the stream is summed in the
    baseline's order; to float32 rounding, being another program), every gate at 1 is the
    reference's ungated AttnRes."""
    baseline = init_model(tiny(residual="baseline"), 6)
    gated = _with_params_of(init_model(tiny(residual=residual, routing_gate=True,
                                            gate_base="stream"), 7), baseline)
    plain = _with_params_of(init_model(tiny(residual=residual), 8), gated)
    assert gated.final_site.gate is not None and plain.final_site.gate is None
    forward = jax.jit(lambda model, ids: model(ids))
    assert_float32_equal(forward(gated, IDS), forward(baseline, IDS))
    attnres = np.asarray(forward(plain, IDS))
    assert np.abs(attnres - np.asarray(forward(baseline, IDS))).max() > 1e-2  # queries normal
    np.testing.assert_allclose(forward(_set_gates(gated, 1.0), IDS), attnres, atol=1e-6, rtol=0)
    # and the gates learn: at zero their gradient is the routing's pull, not zero (but for the
    # first attention site, whose only source is the embedding: its mix is the stream itself)
    graphdef, params, rest = nnx.split(_set_gates(gated, 0.0), nnx.Param, ...)
    grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(IDS).sum())(params)
    assert float(grads["layers"]["attn_site"]["gate"][...][0]) == 0.0
    for gate in (grads["layers"]["attn_site"]["gate"][1:], grads["layers"]["mlp_site"]["gate"],
                 grads["final_site"]["gate"]):
        assert np.all(np.abs(np.asarray(gate[...])) > 0)


@pytest.mark.parametrize("name,expected,tolerance", [
    ("220m", 220.5e6, 0.05e6), ("533m", 533.1e6, 0.05e6), ("1044m", 1043.9e6, 0.05e6),
    ("qwen3-0.6b", 596e6, 0.5e6), ("8b", 7.57e9, 0.005e9)])
def test_preset_parameter_counts(name, expected, tolerance):
    count = count_params(ModelConfig.preset(name, residual="baseline"))
    assert abs(count - expected) <= tolerance, f"{name}: {count:,}"
    routed = count_params(ModelConfig.preset(name, residual="block"))
    cfg = ModelConfig.preset(name)
    assert routed - count == (4 * cfg.num_layers + 2) * cfg.hidden_size


@pytest.mark.parametrize("changes,message", [
    (dict(num_heads=6, num_kv_heads=4), r"num_heads=6 .*multiple of num_kv_heads=4"),
    (dict(num_blocks=0), r"num_blocks=0 .*integer >= 1"),
    (dict(layer_loops=0), r"layer_loops=0 .*integer >= 1"),
    (dict(residual="resnet"), r"residual='resnet' .*baseline, block, full, delta, delta_block"),
    (dict(block_sources="both"), r"block_sources='both' .*reference, paper"),
    (dict(router_init="xavier"), r"router_init='xavier' .*normal, zeros"),
    (dict(hidden_size=0), r"hidden_size=0 .*positive integer"),
    (dict(dtype="float8"), r"dtype='float8' .*float32, bfloat16, float16"),
    (dict(residual="block", null_source=True), r"null_source=True .*residual='block'"),
    (dict(residual="baseline", routing_gate=True), r"routing_gate=True .*baseline"),
    (dict(residual="block", gate_base="stream"),
     r"gate_base='stream' .*residual='block', routing_gate=False: it needs routing_gate=True"),
    (dict(residual="delta", routing_gate=True, gate_base="stream"),
     r"gate_base='stream' .*residual='delta'.*'block' or 'full'"),
    (dict(residual="block", routing_gate=True, gate_base="residual"),
     r"gate_base='residual' .*live, stream"),
])
def test_bad_configs_name_field_value_and_allowed(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*220m"):
        ModelConfig.preset("huge")
