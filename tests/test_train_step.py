"""The jitted train step: sharded equals unsharded, the partition-spec table, gradient
accumulation, mixed precision."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from delta_jax import ModelConfig
from delta_jax.sharding import batch_sharding, make_mesh
from delta_jax.train.config import OptimizerConfig
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import abstract_graph_and_params, init_state, state_specs, to_shardings
from delta_jax.train.step import make_train_step

CFG = ModelConfig.tiny(residual="delta_block")  # vocab 128, d 32, 4 layers, H 4, KV 2, hd 8
OPT = OptimizerConfig(lr=1e-2, routing_lr=5e-2, warmup_steps=0)
STEPS = 3

# Parameter specs on a (data 2, fsdp 2, tensor 2) mesh: 'embed' -> fsdp, heads/kv_heads/mlp/
# vocab -> tensor, the stacked 'layers' axis, head_dim, norms and routing vectors replicated.
EXPECTED_PARAM_SPECS = {
    "embed_tokens": P("tensor", "fsdp"),
    "norm/scale": P(None),
    "layers/input_layernorm/scale": P(None, None),
    "layers/post_attention_layernorm/scale": P(None, None),
    "layers/self_attn/q_proj": P(None, "fsdp", "tensor", None),
    "layers/self_attn/k_proj": P(None, "fsdp", "tensor", None),
    "layers/self_attn/v_proj": P(None, "fsdp", "tensor", None),
    "layers/self_attn/o_proj": P(None, "tensor", None, "fsdp"),
    "layers/self_attn/q_norm/scale": P(None, None),
    "layers/self_attn/k_norm/scale": P(None, None),
    "layers/mlp/gate_proj": P(None, "fsdp", "tensor"),
    "layers/mlp/up_proj": P(None, "fsdp", "tensor"),
    "layers/mlp/down_proj": P(None, "tensor", "fsdp"),
    "layers/attn_site/query": P(None, None),
    "layers/attn_site/norm": P(None, None),
    "layers/mlp_site/query": P(None, None),
    "layers/mlp_site/norm": P(None, None),
}


def _name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(key)


def flat(tree) -> dict:
    return {"/".join(_name(k) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                tree, is_leaf=lambda x: isinstance(x, P))}


def make_batches(batch_size=8, seq=16, n=STEPS):
    """The same random batch n times: the loss must fall as the model memorises it."""
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (batch_size, seq + 1))
    return [{"input_ids": ids[:, :-1].astype(np.int32), "labels": ids[:, 1:].astype(np.int32)}
            ] * n


def train(mesh, cfg=CFG, grad_accum=1, batches=None):
    """(losses [STEPS], final state, initial state, state shardings, grad norms [STEPS])."""
    tx = make_optimizer(OPT, total_steps=10)
    shardings = to_shardings(state_specs(cfg, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(cfg)
    with jax.set_mesh(mesh):
        state = init_state(cfg, tx, shardings, seed=0)
        step = make_train_step(graphdef, tx, schedules(OPT, 10), grad_accum, shardings, mesh)
        losses, norms, first_state = [], [], state
        for batch in batches or make_batches():
            state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    return np.array(losses), state, first_state, shardings, np.array(norms)


@pytest.fixture(scope="module")
def one_device():
    return train(make_mesh(1, 1, 1, devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py fakes 8 CPU devices"
    return train(make_mesh(2, 2, 2))


def test_sharded_equals_unsharded(one_device, eight_devices):
    losses_1, state_1, *_ = one_device
    losses_8, state_8, *_ = eight_devices
    assert losses_1[-1] < losses_1[0]  # it trains
    np.testing.assert_allclose(losses_8, losses_1, atol=1e-5, rtol=0)
    # Adam divides by sqrt(v), which magnifies rounding differences of small gradients: compare
    # the parameters to a small fraction of one step (lr 1e-2, routing 5e-2).
    chex.assert_trees_all_close(jax.device_get(state_8.params), jax.device_get(state_1.params),
                                atol=1e-4, rtol=0)
    assert int(state_8.step) == int(state_1.step) == STEPS


def test_partition_specs_of_parameters_and_optimizer_state(eight_devices):
    _, state, first_state, shardings, _ = eight_devices
    param_specs = flat(jax.tree.map(lambda s: s.spec, shardings.params))
    assert param_specs == EXPECTED_PARAM_SPECS
    # The arrays themselves are laid out so, after init and after a (donating) step.
    assert {k: v.sharding.spec for k, v in flat(state.params).items()} == EXPECTED_PARAM_SPECS
    assert first_state.params["embed_tokens"].is_deleted()  # the state was donated
    # Adam's mu and nu mirror the parameters; the step counters are replicated.
    opt_specs = flat(jax.tree.map(lambda s: s.spec, shardings.opt_state))
    expected_opt = {}
    for moment in ("mu", "nu"):
        expected_opt.update({f"1/{moment}/{k}": v for k, v in EXPECTED_PARAM_SPECS.items()})
    expected_opt["1/count"] = P()
    for group in ("base", "routing"):  # the counters of the two learning-rate schedules
        expected_opt[f"3/inner_states/{group}/inner_state/count"] = P()
    assert opt_specs == expected_opt
    assert {k: v.sharding.spec for k, v in flat(state.opt_state).items()} == expected_opt
    assert shardings.step.spec == P()


def test_gradient_accumulation_2x4_equals_one_batch_of_8(one_device):
    losses_1, state_1, _, _, norms_1 = one_device
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    losses_a, state_a, _, _, norms_a = train(mesh, grad_accum=2)
    np.testing.assert_allclose(losses_a, losses_1, atol=2e-6, rtol=0)
    np.testing.assert_allclose(norms_a, norms_1, rtol=1e-5)
    chex.assert_trees_all_close(jax.device_get(state_a.params), jax.device_get(state_1.params),
                                atol=1e-4, rtol=0)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bf16_compute(one_device, param_dtype):
    """bf16 compute with float32 master weights, and the reference's pure bf16."""
    cfg = CFG.replace(dtype="bfloat16", param_dtype=param_dtype)
    losses, state, *_ = train(make_mesh(1, 1, 1, devices=jax.devices()[:1]), cfg=cfg)
    dtypes = {x.dtype for x in jax.tree.leaves(state.params)}
    assert dtypes == {jnp.dtype(param_dtype)}
    mu_dtypes = {x.dtype for x in jax.tree.leaves(state.opt_state[1].mu)}
    assert mu_dtypes == {jnp.dtype(param_dtype)}
    np.testing.assert_allclose(losses, one_device[0], atol=0.05 if param_dtype == "float32"
                               else 0.1)
