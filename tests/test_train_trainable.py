"""train.trainable: which parameters a pattern selects, the config's refusals, a step that
differentiates, updates and keeps Adam state for the trainable parameters alone (their gradient
the whole model's, restricted to them), and a routing-only run that resumes bitwise, refuses
another subset at resume, and exports to Hugging Face."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_train_step import flat, make_batches

from delta_jax import ModelConfig, init_model, load_pretrained
from delta_jax.checkpoint import save_checkpoint
from delta_jax.convert.__main__ import main as convert
from delta_jax.sharding import batch_sharding, make_mesh
from delta_jax.train.config import OptimizerConfig, load_config
from delta_jax.train.faults import PreflightError
from delta_jax.train.loop import Trainer, run
from delta_jax.train.optimizer import make_optimizer, schedules
from delta_jax.train.state import (
    abstract_graph_and_params,
    abstract_state,
    init_state,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_train_step
from delta_jax.train.trainable import merge, split, trainable_paths
from test_train_loop import MODEL, SPLIT, STEPS, config, data_dir, losses, params_at  # noqa: F401

# Every kind of routing parameter: pseudo-queries, their norms, null sources and gates.
CFG = ModelConfig.tiny(residual="delta_block", null_source=True, routing_gate=True)
ROUTING = sorted(f"layers/{site}/{name}" for site in ("attn_site", "mlp_site")
                 for name in ("query", "norm", "null", "gate"))
OPT = OptimizerConfig(lr=1e-2, routing_lr=5e-2, warmup_steps=0)


def abstract_params(cfg=CFG) -> dict:
    return abstract_graph_and_params(cfg)[1].to_pure_dict()


def test_routing_and_patterns_select_parameters_and_modules():
    params = abstract_params()
    assert sorted(trainable_paths(params, ("routing",))) == ROUTING
    assert len(trainable_paths(params, ("all",))) == len(flat(params)) == 21
    # A pattern matches a parameter's path or the path of a module holding it; `*` crosses "/".
    assert trainable_paths(params, ("*_site/query",)) == ["layers/attn_site/query",
                                                          "layers/mlp_site/query"]
    assert trainable_paths(params, ("layers/self_attn", "norm")) == [
        f"layers/self_attn/{name}" for name in ("k_norm/scale", "k_proj", "o_proj",
                                                "q_norm/scale", "q_proj", "v_proj")
    ] + ["norm/scale"]
    full = abstract_params(ModelConfig.tiny(residual="full"))
    assert trainable_paths(full, ("final_site",)) == ["final_site/norm", "final_site/query"]
    # split keeps the nesting, drops emptied modules, and merge undoes it.
    trainable, frozen = split(params, ("routing",))
    assert sorted(flat(trainable)) == ROUTING and set(trainable) == {"layers"}
    assert not set(flat(trainable)) & set(flat(frozen))
    assert flat(merge(trainable, frozen)) == flat(params)


@pytest.mark.parametrize("overrides, message", [
    (["train.trainable=layers/nope*"], "train.trainable pattern 'layers/nope*' matches no "
                                       "parameter; the model's parameters: embed_tokens, "),
    (["train.trainable=routing,embed_tokens"], "train.trainable='routing,embed_tokens' is "
                                               "invalid: expected all or routing alone"),
    (["train.trainable=[]"], "train.trainable='' is invalid: expected all, routing or a list"),
    (["model.residual=baseline", "train.trainable=routing"],
     "train.trainable='routing' selects no parameter of this model: model.residual='baseline'"),
])
def test_config_refuses_a_selection_of_nothing(overrides, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("[", r"\[")):
        load_config(None, overrides)


def gradient_recorder() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient it was given and whose updates are 0."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def train(mesh, trainable, tx, steps=3, cfg=CFG, grad_accum=1):
    """(initial params, final state, state shardings, grad norms) of `steps` steps from the
    seed-0 init."""
    shardings = to_shardings(state_specs(cfg, tx, mesh, trainable), mesh)
    step = make_train_step(abstract_graph_and_params(cfg)[0], tx, schedules(OPT, 10), grad_accum,
                           shardings, mesh, trainable=trainable)
    with jax.set_mesh(mesh):
        state = init_state(cfg, tx, shardings, seed=0, trainable=trainable)
        first, norms = jax.device_get(state.params), []
        for batch in make_batches(n=steps):
            state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
            norms.append(float(metrics["grad_norm"]))
    return first, state, shardings, norms


@pytest.mark.slow
def test_frozen_parameters_have_no_adam_state_and_stay_bitwise():
    """Routing only, on (data 2, fsdp 2, tensor 2) with 2 microbatches: Adam's moments exist for
    the routing parameters alone, sharded as they are; the rest are untouched bit for bit."""
    first, state, shardings, _ = train(make_mesh(2, 2, 2), ("routing",),
                                       make_optimizer(OPT, total_steps=10), grad_accum=2)
    moments = {k for k in flat(state.opt_state) if k.startswith(("1/mu/", "1/nu/"))}
    assert moments == {f"1/{m}/{path}" for m in ("mu", "nu") for path in ROUTING}
    param_specs = flat(jax.tree.map(lambda s: s.spec, shardings.params))
    for key, leaf in flat(state.opt_state).items():
        if key in moments:
            assert leaf.sharding.spec == param_specs[key.split("/", 2)[2]], key
    after = flat(jax.device_get(state.params))
    for path, before in flat(first).items():
        changed = not np.array_equal(after[path], before)
        assert changed == (path in ROUTING), path


@pytest.mark.slow
@pytest.mark.parametrize("trainable", [("routing",), ("layers/mlp_site", "norm", "*/q_proj")])
def test_the_gradient_is_the_whole_models_restricted_to_the_trainable(trainable):
    """float32 on one device: the step's gradient of the trainable parameters (what the
    recorder keeps) equals the gradient of every parameter at those paths, and grad_norm is
    its norm. Without gates, which start at 0 and so give the queries no gradient at first."""
    mesh, cfg = make_mesh(1, 1, 1, devices=jax.devices()[:1]), CFG.replace(routing_gate=False)
    _, whole, _, _ = train(mesh, ("all",), gradient_recorder(), steps=1, cfg=cfg)
    _, part, _, norms = train(mesh, trainable, gradient_recorder(), steps=1, cfg=cfg)
    whole, part = flat(jax.device_get(whole.opt_state)), flat(jax.device_get(part.opt_state))
    assert sorted(part) == sorted(trainable_paths(abstract_params(cfg), trainable))
    for path, gradient in part.items():
        assert np.abs(gradient).max() > 0, path
        # Two programs: equal up to float reassociation, 1e-6 of the gradient's norm.
        assert np.linalg.norm(gradient - whole[path]) <= 1e-6 * np.linalg.norm(whole[path]), path
    np.testing.assert_allclose(norms[0], optax.global_norm([whole[p] for p in part]), rtol=1e-6)


ROUTING_RUN = ("train.trainable=routing", "model.routing_gate=true", "model.null_source=true")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A model checkpoint of the routing run's architecture (seed 7) and its parameters."""
    folder = tmp_path_factory.mktemp("pretrained") / "model"
    model = init_model(ModelConfig(**MODEL, routing_gate=True, null_source=True), seed=7)
    save_checkpoint(model, folder)
    return folder, jax.device_get(nnx.state(model, nnx.Param).to_pure_dict())


@pytest.fixture(scope="module")
def routing_runs(data_dir, pretrained, tmp_path_factory):  # noqa: F811
    """Routing only from `pretrained`: STEPS straight, and SPLIT steps then resumed."""
    runs = tmp_path_factory.mktemp("routing_runs")
    common = (*ROUTING_RUN, f"train.init_from={pretrained[0]}")
    run(config(data_dir, runs / "straight", *common))
    run(config(data_dir, runs / "resumed", *common, f"train.steps={SPLIT}"))
    with (Trainer(config(data_dir, runs / "resumed", *common[1:])) as trainer,
          pytest.raises(PreflightError, match="saved with train.trainable='routing', resuming "
                                              "with 'all': its optimizer state")):
        trainer.initial_state()
    assert run(config(data_dir, runs / "resumed", *common))["start_step"] == SPLIT
    return runs / "straight", runs / "resumed"


@pytest.mark.slow
def test_a_routing_run_resumes_bitwise_and_freezes_the_rest(routing_runs, pretrained):
    straight, resumed = routing_runs
    assert losses(resumed) == losses(straight)
    final = flat(params_at(straight, STEPS))
    for path, value in flat(params_at(resumed, STEPS)).items():
        np.testing.assert_array_equal(value, final[path], err_msg=path)
    for path, value in flat(pretrained[1]).items():
        assert np.array_equal(final[path], value) == ("_site/" not in path), path


@pytest.mark.slow
def test_a_routing_run_exports_and_starts_a_second_stage(routing_runs, data_dir,  # noqa: F811
                                                         tmp_path):
    """orbax-to-hf writes its parameters; train.init_from=<its checkpoints> starts a run of
    every parameter from them (one step at lr 0, the warmup's first, leaves them as loaded)."""
    straight, _ = routing_runs
    final = flat(params_at(straight, STEPS))
    assert convert(["orbax-to-hf", str(straight / "checkpoints"), str(tmp_path / "hf"),
                    "--dtype", "float32"]) == 0
    exported = flat(jax.device_get(nnx.state(load_pretrained(tmp_path / "hf"),
                                             nnx.Param).to_pure_dict()))
    stage_2 = tmp_path / "stage_2"
    run(config(data_dir, stage_2, *ROUTING_RUN[1:], f"train.init_from={straight / 'checkpoints'}",
               "train.steps=1", "optimizer.warmup_steps=5"))
    for path, value in flat(params_at(stage_2, 1)).items():
        np.testing.assert_array_equal(exported[path], final[path], err_msg=path)
        np.testing.assert_array_equal(value, final[path], err_msg=path)


@pytest.mark.slow
def test_frozen_weights_cost_no_gradient_flops():
    """XLA's count of a step's FLOPs (layers written out, so that each is counted): training the
    routing alone saves the weight gradients of every matmul, 2 FLOPs a weight a token."""
    cfg = ModelConfig(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=64, intermediate_size=1024, residual="delta_block", num_blocks=2,
                      unroll_layers=True)
    mesh, tx, batch, seq = make_mesh(1, 1, 1, devices=jax.devices()[:1]), optax.sgd(0.1), 8, 128
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding(mesh))
    flops = {}
    for trainable in (("all",), ("routing",)):
        shardings = to_shardings(state_specs(cfg, tx, mesh, trainable), mesh)
        step = make_train_step(abstract_graph_and_params(cfg)[0], tx, schedules(OPT, 10), 1,
                               shardings, mesh, trainable=trainable)
        with jax.set_mesh(mesh):
            compiled = step.lower(abstract_state(cfg, tx, shardings, trainable),
                                  {"input_ids": ids, "labels": ids}).compile()
        cost = compiled.cost_analysis()
        flops[trainable] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    # The stacked layer matrices ([L, ...], 3 dims or more) and the tied embedding (the head).
    weights = sum(leaf.size for path, leaf in flat(abstract_params(cfg)).items()
                  if leaf.ndim >= 3 or path == "embed_tokens")
    saved = flops[("all",)] - flops[("routing",)]
    assert saved == pytest.approx(2 * weights * batch * seq, rel=0.05)
