"""One mesh builder for every entry point, over one slice or many (TPU Multislice, GPU nodes).

Multi-slice device lists come from libtpu's compile-only topologies (no TPU needed) and, for
GPU nodes, from stand-in device objects: each node's devices must lie on the in-node axes and
only `data` may cross the slow network by default. The trainer's own train and eval steps are
compiled over such meshes.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.plan.compile import build_mesh, compile_step
from delta_jax.plan.topology import PlanError, resolve
from delta_jax.sharding import batch_sharding, device_grid, make_hybrid_mesh, make_mesh
from delta_jax.train.config import load_config
from delta_jax.train.optimizer import make_optimizer
from delta_jax.train.state import (
    abstract_graph_and_params,
    abstract_state,
    state_specs,
    to_shardings,
)
from delta_jax.train.step import make_eval_step
from tests.test_plan import TINY, needs_libtpu


def slice_of(grid: np.ndarray, key: str = "slice_index") -> np.ndarray:
    return np.vectorize(lambda d: getattr(d, key))(grid)


def assert_groups_within_slices(grid: np.ndarray, key: str = "slice_index") -> None:
    """Every fsdp group (fixed data, tensor) and every tensor group lies in one slice."""
    slices = slice_of(grid, key)
    for d in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            assert len(set(slices[d, :, t])) == 1, slices
        for f in range(grid.shape[1]):
            assert len(set(slices[d, f, :])) == 1, slices


def tpu_devices(name: str, num_slices: int) -> list:
    return list(resolve(name, num_slices).devices)


@needs_libtpu
def test_two_slices_put_data_across_them_and_fsdp_inside():
    devices = tpu_devices("v5p:2x2x1", 2)
    mesh = make_mesh(data=2, fsdp=4, devices=devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert_groups_within_slices(mesh.devices)
    assert sorted(slice_of(mesh.devices)[:, 0, 0]) == [0, 1]  # data spans the slices
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@needs_libtpu
def test_sizes_that_do_not_fit_the_slices_say_what_would():
    devices = tpu_devices("v5p:2x2x1", 2)
    with pytest.raises(ValueError, match=r"over 2 slices of 4 devices: the slices go on the data "
                                         r"axis, so data must be a multiple of 2, such as data 2 "
                                         r"x fsdp 4 x tensor 1"):
        make_mesh(data=1, fsdp=8, devices=devices)
    with pytest.raises(ValueError, match=r"mesh data=1 x fsdp=8 x tensor=1 = 8 devices, but 4 "
                                         r"are available in each of the 2 slices"):
        make_hybrid_mesh((1, 8, 1), devices=devices)
    with pytest.raises(ValueError, match=r"mesh across slices: data=3 x fsdp=1 x tensor=1 = 3 "
                                         r"slices, but 2 are available"):
        make_hybrid_mesh((1, -1, 1), (3, 1, 1), devices)


@needs_libtpu
def test_four_slices_config_sizes_are_per_slice_and_dcn_may_split_fsdp():
    devices = tpu_devices("v5e:2x2", 4)
    one_slice_config = make_hybrid_mesh((1, -1, 1), devices=devices)  # the shipped configs'
    assert dict(one_slice_config.shape) == {"data": 4, "fsdp": 4, "tensor": 1}
    assert_groups_within_slices(one_slice_config.devices)
    # fsdp over two slices: its size is 2 x 2, each half (the in-slice part) in one slice
    grid = device_grid((1, 2, 2), (2, 2, 1), devices)
    assert grid.shape == (2, 4, 2)
    slices = slice_of(grid)
    for d in range(2):
        for half in (slice(0, 2), slice(2, 4)):
            assert len(set(slices[d, half, :].flat)) == 1, slices
        assert slices[d, 0, 0] != slices[d, 2, 0]
    assert len(set(slices.flat)) == 4


@dataclasses.dataclass(frozen=True)
class StandInGpu:
    """What the builder reads of a GPU device of a multi-node job without a slice index."""
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def test_gpu_nodes_lie_on_the_in_node_axes():
    devices = [StandInGpu(id=8 * node + g, process_index=node) for node in (1, 0)
               for g in range(8)]
    grid = device_grid((1, 4, 2), (-1, 1, 1), devices)
    assert grid.shape == (2, 4, 2)
    assert_groups_within_slices(grid, key="process_index")
    assert [int(p) for p in slice_of(grid, "process_index")[:, 0, 0]] == [0, 1]
    with pytest.raises(ValueError, match=r"but 8 are available in each of the 2 nodes"):
        device_grid((1, 16, 1), (-1, 1, 1), devices)


def test_one_cpu_slice_is_the_plain_mesh():
    mesh = make_hybrid_mesh((2, -1, 2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert list(mesh.devices.flat) == jax.devices()  # in device order, as jax.make_mesh
    with pytest.raises(ValueError, match=r"mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but 8 "
                                         r"are available \(cpu\)"):
        make_mesh(3, 1, 1)


def _compile_eval_step(run, topology):
    mesh = build_mesh(run, topology)
    tx = make_optimizer(run.optimizer, run.train.steps)
    shardings = to_shardings(state_specs(run.model, tx, mesh), mesh)
    graphdef, _ = abstract_graph_and_params(run.model)
    params = abstract_state(run.model, tx, shardings).params
    ids = jax.ShapeDtypeStruct((run.train.batch_size, run.train.seq_len), jnp.int32,
                               sharding=batch_sharding(mesh))
    evaluate = make_eval_step(graphdef, shardings.params, mesh, run.train.loss_vocab_chunks)
    with jax.set_mesh(mesh):
        return evaluate.lower(params, {"input_ids": ids, "labels": ids}).compile()


@needs_libtpu
@pytest.mark.slow  # two TPU compiles of the train and eval steps: about 20 s each
@pytest.mark.parametrize("name,num_slices,residual", [("v5p:2x2x1", 2, "delta"),
                                                      ("v5e:2x2", 4, "delta_block")])
def test_the_trainer_steps_compile_across_slices(name, num_slices, residual):
    """A config written for one slice (data 1, fsdp -1), unchanged: its data axis spans the
    slices, and the trainer's train and eval steps compile over that mesh."""
    run = load_config("configs/220m.yaml", [*TINY, f"model.residual={residual}",
                                            "data.packing=concat", "train.batch_size=16"])
    assert (run.mesh.data, run.mesh.fsdp) == (1, -1)
    topology = resolve(name, num_slices)
    plan = compile_step(run, topology, estimate=False)
    assert plan.mesh == {"data": num_slices, "fsdp": 4, "tensor": 1}
    assert plan.num_devices == 4 * num_slices and plan.total_bytes > plan.params_bytes > 0
    evaluated = _compile_eval_step(run, topology)
    assert evaluated.memory_analysis().argument_size_in_bytes > 0
    assert_groups_within_slices(build_mesh(run, topology).devices)


@needs_libtpu
def test_the_planner_names_a_mesh_that_does_not_fit_the_slices():
    run = load_config("configs/220m.yaml", [*TINY, "mesh.fsdp=8"])
    with pytest.raises(PlanError, match=r"fsdp=8 x tensor=1 = 8 devices, but 4 are available "
                                        r"in each of the 2 slices \(topology v5p:2x2x1 x 2 "
                                        r"slices\)"):
        build_mesh(run, resolve("v5p:2x2x1", 2))
