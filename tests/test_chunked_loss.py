"""The vocabulary-chunked cross-entropy (train/loss.py, train.loss_vocab_chunks): the whole
logits' loss and gradients, in a sharded train step, its config check, and the memory it saves.
(The packed-documents loss with chunks is checked in test_model_packing.py.)"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from delta_jax import ModelConfig
from delta_jax.sharding import batch_sharding, make_mesh
from delta_jax.train.config import OptimizerConfig, load_config
from delta_jax.train.loss import vocab_chunked_cross_entropy
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (
    abstract_graph_and_params,
    abstract_state,
    init_state,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_train_step

B, T, D, V = 2, 8, 16, 96


def _inputs(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(keys[0], (B, T, D)).astype(dtype)
    head = (jax.random.normal(keys[1], (D, V)) * 0.5).astype(dtype)
    labels = jax.random.randint(keys[2], (B, T), 0, V)
    weights = jax.random.normal(keys[3], (B, T))  # a cotangent that differs per token
    return hidden, head, labels, weights


def _whole(hidden, head, labels, weights):
    logits = (hidden @ head).astype(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights).sum()


def _chunked(chunks):
    def loss(hidden, head, labels, weights):
        return (vocab_chunked_cross_entropy(hidden, head, labels, chunks) * weights).sum()
    return loss


@pytest.mark.parametrize("chunks", [1, 4, V])
def test_float32_matches_the_whole_logits(chunks):
    hidden, head, labels, weights = _inputs(jnp.float32)
    ce = vocab_chunked_cross_entropy(hidden, head, labels, chunks)
    whole_ce = optax.softmax_cross_entropy_with_integer_labels(hidden @ head, labels)
    np.testing.assert_allclose(ce, whole_ce, rtol=1e-6, atol=1e-6)
    grads = jax.grad(_chunked(chunks), argnums=(0, 1))(hidden, head, labels, weights)
    whole_grads = jax.grad(_whole, argnums=(0, 1))(hidden, head, labels, weights)
    chex.assert_trees_all_close(grads, whole_grads, atol=3e-6, rtol=0)


def test_bfloat16_rounds_each_chunk_like_the_whole_logits():
    """bf16 logits are rounded before the float32 softmax in both; the gradients come back in
    bf16 and agree to its rounding."""
    hidden, head, labels, weights = _inputs(jnp.bfloat16)
    np.testing.assert_allclose(_chunked(4)(hidden, head, labels, weights),
                               _whole(hidden, head, labels, weights), rtol=1e-6)
    grads = jax.grad(_chunked(4), argnums=(0, 1))(hidden, head, labels, weights)
    whole_grads = jax.grad(_whole, argnums=(0, 1))(hidden, head, labels, weights)
    for got, want in zip(grads, whole_grads):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=2e-2, rtol=1e-2)


def _train(mesh, cfg, vocab_chunks, batch):
    opt = OptimizerConfig(lr=1e-2, routing_lr=5e-2, warmup_steps=0)
    tx = make_optimizer(opt, total_steps=10)
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    with jax.set_mesh(mesh):
        state = init_state(cfg, tx, shardings, seed=0)
        step = make_train_step(graphdef, tx, schedules(opt, 10), 1, shardings, mesh,
                               loss_vocab_chunks=vocab_chunks)
        metrics = []
        for _ in range(2):
            state, m = step(state, jax.device_put(batch, batch_sharding(mesh)))
            metrics.append({k: float(v) for k, v in m.items()})
    return metrics, jax.device_get(state.params)


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_sharded_train_step_matches_the_whole_logits(tied):
    """On a (data 2, fsdp 2, tensor 2) mesh, so each chunk of the tensor-sharded head is split
    across devices: the loss, gradient norm and updated parameters of two steps."""
    cfg = ModelConfig.tiny(residual="delta_block", tie_word_embeddings=tied)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    mesh = make_mesh(2, 2, 2)
    whole_metrics, whole_params = _train(mesh, cfg, 1, batch)
    metrics, params = _train(mesh, cfg, 8, batch)
    for got, want in zip(metrics, whole_metrics):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)
    chex.assert_trees_all_close(params, whole_params, atol=1e-4, rtol=0)


def test_config_names_a_chunk_count_the_vocabulary_does_not_split_into():
    with pytest.raises(ValueError, match=r"train.loss_vocab_chunks=3 is invalid: expected a "
                                         r"divisor of model.vocab_size=128"):
        load_config("configs/demo.yaml", ["model.vocab_size=128", "train.loss_vocab_chunks=3"])


def test_compiled_step_never_holds_the_whole_logits():
    """The compiled train step's temporaries, with a vocabulary large enough that the float32
    logits (4 x 256 x 32768: 128 MiB) dominate: chunking in 8 saves at least 3/4 of them."""
    cfg = ModelConfig.tiny(vocab_size=32768)
    ids = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = OptimizerConfig()
    tx = make_optimizer(opt, total_steps=10)
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    state = abstract_state(cfg, tx, shardings)
    temp = {}
    with jax.set_mesh(mesh):
        for chunks in (1, 8):
            step = make_train_step(graphdef, tx, schedules(opt, 10), 1, shardings, mesh,
                                   loss_vocab_chunks=chunks)
            compiled = step.lower(state, {"input_ids": ids, "labels": ids}).compile()
            temp[chunks] = compiled.memory_analysis().temp_size_in_bytes
    logits_f32 = 4 * 256 * 32768 * 4
    assert temp[1] - temp[8] > 0.75 * logits_f32, temp
