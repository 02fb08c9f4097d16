"""The train state and its shardings on a (data, fsdp, tensor) mesh.

The state is functional: a step counter, the parameters as the pure dict of
`nnx.state(model, nnx.Param)` (the layout of delta_jax/checkpoint.py), and the optax state of
the trainable parameters alone (train.trainable; train/trainable.py splits the tree): frozen
parameters have no Adam state. The model's graph (`graphdef`) is static and kept beside it.
Parameter shardings come from the parameters' logical axes (delta_jax.sharding); the optimizer
state's param-shaped leaves (Adam's mu and nu) take their parameter's sharding, its scalars are
replicated.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.config import ModelConfig
from delta_jax.model.causal_lm import CausalLM, abstract_model
from delta_jax.sharding import state_partition_specs
from delta_jax.train.trainable import ALL, split


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: optimizer steps taken
    params: dict  # pure dict of nnx.Param values, every parameter
    opt_state: optax.OptState  # of the trainable parameters only


def abstract_graph_and_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract nnx.Param state) without allocating anything."""
    return nnx.split(abstract_model(cfg), nnx.Param)


def param_specs(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Pure dict of PartitionSpecs of the parameters."""
    return state_partition_specs(abstract_graph_and_params(cfg)[1], mesh).to_pure_dict()


def state_specs(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh,
                trainable: tuple[str, ...] = (ALL,)) -> TrainState:
    """TrainState of PartitionSpecs."""
    params = split(abstract_graph_and_params(cfg)[1].to_pure_dict(), trainable)[0]
    specs = param_specs(cfg, mesh)
    opt_state = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(tx, lambda _, spec: spec, opt_state,
                                      split(specs, trainable)[0],
                                      transform_non_params=lambda _: P())
    return TrainState(step=P(), params=specs, opt_state=opt_specs)


def to_shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def _fresh(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int,
           trainable: tuple[str, ...]) -> TrainState:
    model = CausalLM(cfg, rngs=nnx.Rngs(params=seed))
    params = nnx.state(model, nnx.Param).to_pure_dict()
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(split(params, trainable)[0]))


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, shardings: TrainState,
               seed: int, trainable: tuple[str, ...] = (ALL,)) -> TrainState:
    """A fresh state, each array created directly on its sharding (no host copy of the model)."""
    return jax.jit(lambda: _fresh(cfg, tx, seed, trainable), out_shardings=shardings)()


def state_from_params(params: dict, tx: optax.GradientTransformation, shardings: TrainState,
                      trainable: tuple[str, ...] = (ALL,)) -> TrainState:
    """Step 0 with given (already sharded) parameters and a fresh optimizer state: fine-tuning."""
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(split(params, trainable)[0])
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
                      params=params, opt_state=opt_state)


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation,
                   shardings: TrainState, trainable: tuple[str, ...] = (ALL,)) -> TrainState:
    """TrainState of jax.ShapeDtypeStruct with shardings: the restore target."""
    shapes = jax.eval_shape(lambda: _fresh(cfg, tx, 0, trainable))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
