"""What the TPU compiler holds against HBM: peak_memory_in_bytes, not temp_size_in_bytes.

A small train step (a scan whose per-layer outputs feed the loss, its gradient, a donated
update) is compiled for one v5e chip (15.75 GiB available) at two sizes. The compiler accepts
the smaller although temp_size_in_bytes and the arguments add up to more than the chip holds,
and refuses the larger naming, as its "temporaries", the peak the same program has on a v5p
chip, where it fits: the live peak with the arguments. The planner reads the refusal that way.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from delta_jax.plan.compile import _oom_peak_bytes, compile_named
from delta_jax.train.config import load_config
from tests.test_plan import TINY, needs_libtpu

GiB = 2**30
V5E_AVAILABLE = 15.75 * GiB  # what the compiler says a v5e chip has for a program
LAYERS, WIDTH = 16, 1024


def _loss(weights, x):
    def layer(h, w):
        h = jnp.tanh(h @ w)
        return h, h
    _, outputs = jax.lax.scan(layer, x, weights)
    return (outputs ** 2).sum()


@functools.cache
def _device(topology_name: str):
    return topologies.get_topology_desc(platform="tpu", topology_name=topology_name).devices[0]


def _compile(topology_name: str, rows: int):
    sharding = NamedSharding(Mesh([_device(topology_name)], ("x",)), PartitionSpec())
    step = jax.jit(lambda w, x: w - 0.1 * jax.grad(_loss)(w, x), donate_argnums=0,
                   in_shardings=(sharding, sharding), out_shardings=sharding)
    return step.lower(jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32, sharding=sharding),
                      jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32, sharding=sharding)).compile()


@needs_libtpu
def test_the_compiler_accepts_by_the_live_peak_and_names_it_when_it_refuses():
    accepted = _compile("v5e:2x2", 17 * 4096).memory_analysis()
    arguments = accepted.argument_size_in_bytes
    assert accepted.peak_memory_in_bytes <= V5E_AVAILABLE
    assert accepted.temp_size_in_bytes + arguments > V5E_AVAILABLE + GiB  # over, yet accepted

    rows = 18 * 4096
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as refused:
        _compile("v5e:2x2", rows)
    named = _oom_peak_bytes(str(refused.value))
    on_v5p = _compile("v5p:2x2x1", rows).memory_analysis()
    assert named is not None and named > V5E_AVAILABLE
    # The message rounds to 0.01G; the arguments (0.34 GiB here) are inside the figure.
    assert abs(named - on_v5p.peak_memory_in_bytes) < 0.01 * GiB
    assert named - (on_v5p.peak_memory_in_bytes - on_v5p.argument_size_in_bytes) > 0.3 * GiB
    assert on_v5p.temp_size_in_bytes > on_v5p.peak_memory_in_bytes + GiB


@needs_libtpu
@pytest.mark.slow
def test_a_refused_step_is_planned_at_the_figure_the_compiler_names():
    # 2M tokens a step on four v5e chips: the logits and XLA attention's [T,T] scores alone are
    # over HBM (splash, what attention auto compiles on TPU, never forms the scores)
    run = load_config("configs/220m.yaml", [*TINY, "train.batch_size=1024", "train.seq_len=2048",
                                             "model.attention=xla"])
    plan = compile_named(run, "v5e:2x2", estimate=False)
    assert plan.oom is not None and "exceeds available HBM" in plan.oom
    named = _oom_peak_bytes(plan.oom)
    assert plan.total_bytes == plan.live_peak_bytes == named > V5E_AVAILABLE
    assert plan.temp_bytes == named - plan.argument_bytes


# What each chip's compiler lets one program hold per device, by its refusals (libtpu 0.0.42.1),
# against the chip's HBM per device (chips.py): the runtime keeps the rest.
COMPILER_LIMITS_GIB = {"v5e:1x1": (15.75, 16), "v6e:1x1": (31.25, 32),
                       "v5p:2x2x1": (95.74, 95), "v4:2x2x1": (15.25, 16)}


@needs_libtpu
@pytest.mark.parametrize("name", COMPILER_LIMITS_GIB)
def test_the_planner_judges_by_the_limit_the_compiler_names(name):
    from delta_jax.plan.topology import resolve

    topology = resolve(name)
    limit, chip = COMPILER_LIMITS_GIB[name]
    assert topology.compiler_hbm_per_device == int(limit * GiB)
    assert topology.chip_hbm_per_device == chip * GiB
    assert topology.hbm_per_device == topology.compiler_hbm_per_device
    # Both figures under their names, and the one the fit is judged against
    memory = topology.memory()
    assert memory.startswith(f"HBM {chip} GiB by the chip's spec; the compiler's limit for a "
                             f"program {limit:.2f} GiB (libtpu's figure; ")
    assert ("rounded down" in memory) == (limit > chip)  # v5p's alone
    assert topology.judged_against() == f"the compiler's limit, {limit:.2f} GiB"


def test_both_refusal_messages_are_read():
    from delta_jax.plan.topology import refusal_bytes

    # The first lines of two real refusals (libtpu 0.0.42.1): the live peak over the limit (the
    # small step above, 18 x 4096 rows), and the heap assigned for a live peak that fitted, with
    # its fragmentation and the arguments (220M on one v5e chip, remat full, 2 microbatches).
    live_over = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                 "HLO temporaries (16.61G) exceeds available HBM (15.75G).")
    heap_over = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. "
                 "Ran out of memory in memory space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm "
                 "capacity by 3.60M.")
    assert refusal_bytes(live_over) == (int(16.61 * GiB), int(15.75 * GiB))
    assert refusal_bytes(heap_over) == (int(15.75 * GiB + 3.6 * 2**20), int(15.75 * GiB))
    assert refusal_bytes("RESOURCE_EXHAUSTED: out of host memory") is None
