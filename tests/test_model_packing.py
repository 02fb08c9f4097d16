"""Documents packing in the model and the train step: a window of several documents, with their
segment ids and positions, gives each document's logits and loss as if it ran alone."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import ModelConfig, init_model
from delta_jax.data.pipeline import IGNORE_LABEL, documents_batch
from delta_jax.sharding import batch_sharding, make_mesh
from delta_jax.train.config import OptimizerConfig
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import abstract_graph_and_params, init_state, state_specs, to_shardings
from delta_jax.train.step import make_eval_step, make_train_step

VARIANTS = ["baseline", "block", "full", "delta", "delta_block"]
EOS = 127
T = 24


def tiny(**overrides):
    return ModelConfig.tiny(**overrides)


def documents(rng, lengths):
    """Documents of the given lengths, each ending with EOS (as `prepare` writes them)."""
    return [np.append(rng.integers(0, EOS, n - 1), EOS).astype(np.int32) for n in lengths]


def packed_window(docs, next_token=5):
    """The window [T + 1] of `docs` (filling T tokens exactly), then the next document's first
    token."""
    window = np.concatenate(docs + [np.array([next_token], np.int32)])
    assert len(window) == T + 1
    return window


# Rows of documents filling T = 24 tokens: several, one, and a one-token document (EOS alone).
ROWS = [[5, 7, 12], [24], [9, 1, 14]]


@pytest.fixture(scope="module")
def packed():
    """(per-row documents, the documents batch of their windows)."""
    rng = np.random.default_rng(0)
    rows = [documents(rng, lengths) for lengths in ROWS]
    return rows, documents_batch(np.stack([packed_window(docs) for docs in rows]), EOS)


def test_documents_batch_fields(packed):
    rows, batch = packed
    np.testing.assert_array_equal(batch["segment_ids"][0], [0] * 5 + [1] * 7 + [2] * 12)
    np.testing.assert_array_equal(batch["positions"][0],
                                  list(range(5)) + list(range(7)) + list(range(12)))
    np.testing.assert_array_equal(batch["segment_ids"][2], [0] * 9 + [1] + [2] * 14)
    # the label of every EOS input (the next document's first token) is ignored, no other
    ignored = batch["labels"] == IGNORE_LABEL
    np.testing.assert_array_equal(ignored, batch["input_ids"] == EOS)
    assert ignored.sum() == sum(len(docs) for docs in rows)


@pytest.mark.parametrize("residual", [
    r if r in ("full", "delta_block") else pytest.param(r, marks=pytest.mark.slow)
    for r in VARIANTS])
def test_packed_logits_are_each_documents_alone(packed, residual):
    rows, batch = packed
    model = init_model(tiny(residual=residual), 1)
    logits = jax.jit(lambda ids, pos, seg: model(ids, positions=pos, segment_ids=seg))(
        batch["input_ids"], batch["positions"], batch["segment_ids"])
    run_alone = jax.jit(lambda ids: model(ids))
    for r, docs in enumerate(rows):
        start = 0
        for doc in docs:
            alone = run_alone(jnp.asarray(doc)[None])[0]
            np.testing.assert_allclose(np.asarray(logits[r, start:start + len(doc)]),
                                       np.asarray(alone), atol=1e-5, rtol=0)
            start += len(doc)


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["block", "delta_block"])
def test_drivers_agree_on_packed_gradients(packed, residual):
    """scan, lean (its own backward pass) and unrolled carry the segment ids alike."""
    _, batch = packed
    model = init_model(tiny(residual=residual), 2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, driver):
        logits = nnx.merge(graphdef, p, rest)(
            batch["input_ids"], positions=batch["positions"],
            segment_ids=batch["segment_ids"], driver=driver)
        labels = jnp.maximum(batch["labels"], 0)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    results = {d: jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, d)
               for d in ("scan", "lean", "unrolled")}
    for driver in ("lean", "unrolled"):
        for a, b in zip(jax.tree.leaves(results[driver]), jax.tree.leaves(results["scan"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_accum,vocab_chunks", [
    pytest.param(1, 1, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow),
    pytest.param(2, 4, marks=pytest.mark.slow)])
def test_packed_loss_is_the_token_weighted_mean_of_document_losses(grad_accum, vocab_chunks):
    """The train step's loss (before its update) and the eval step's sum and count: the EOS
    labels left out, every other token weighs the same, whichever microbatch holds it; also
    with the loss formed a vocabulary chunk at a time (train.loss_vocab_chunks)."""
    cfg = tiny(residual="delta")
    rng = np.random.default_rng(1)
    # few distinct lengths: each compiles the model alone once
    splits = [[5, 7, 12], [24], [12, 12], [7, 5, 12], [1, 5, 1, 5, 12], [12, 7, 5], [5, 12, 7],
              [24]]
    rows = [documents(rng, lengths) for lengths in splits]
    batch = documents_batch(np.stack([packed_window(docs) for docs in rows]), EOS)

    mesh = make_mesh(8, 1, 1)
    opt = OptimizerConfig(lr=1e-2, warmup_steps=0)
    tx = make_optimizer(opt, total_steps=10)
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    with jax.set_mesh(mesh):
        state = init_state(cfg, tx, shardings, seed=0)
        params = jax.device_get(state.params)
        step = make_train_step(graphdef, tx, schedules(opt, 10), grad_accum, shardings, mesh,
                               loss_vocab_chunks=vocab_chunks)
        evaluate = make_eval_step(graphdef, shardings.params, mesh, vocab_chunks)
        on_mesh = jax.device_put(batch, batch_sharding(mesh))
        nll_sum, counted = evaluate(state.params, on_mesh)
        _, metrics = step(state, on_mesh)

    model = nnx.merge(graphdef, nnx.State(params))
    run_alone = jax.jit(lambda ids: model(ids))
    sums, tokens = 0.0, 0
    for docs in rows:
        for doc in docs:
            if len(doc) == 1:  # an EOS alone predicts nothing of its own
                continue
            logits = run_alone(jnp.asarray(doc[:-1])[None])[0]
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, doc[1:])
            sums += float(losses.sum())
            tokens += len(doc) - 1
    assert int(counted) == tokens == (batch["labels"] >= 0).sum()
    np.testing.assert_allclose(float(nll_sum), sums, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), sums / tokens, rtol=1e-5)


def test_no_segment_ids_with_a_cache():
    model = init_model(tiny(), 0)
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids with a cache"):
        model.forward(ids, segment_ids=jnp.zeros((1, 4), jnp.int32),
                      cache=model.init_cache(1, 8))
