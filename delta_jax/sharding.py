"""Logical axis names -> mesh axes, kept in one place.

Mesh axes: 'data' (pure data parallel), 'fsdp' (data parallel with parameters and optimizer
state sharded), 'tensor' (Megatron-style: heads and MLP width split). Parameters name their axes
logically ('embed', 'mlp', ...; see layers.py); activations are constrained through `constrain`,
which is a no-op outside a mesh context, so the same model code runs on one CPU or a pod.
A mesh axis that does not divide a dimension is dropped for that array (it is replicated there)
rather than failing: a 2-kv-head model still runs on tensor=4.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: Mapping[str, tuple[str, ...]] = {
    # parameters
    "layers": (),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "norm": (),
    "routing": (),
    # activations; the routing source buffer is sharded like the residual stream, never on S
    "batch": ("data", "fsdp"),
    "seq": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "sources": (),
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (plain indexing of sharded arrays works).

    One size may be -1: the devices the other axes leave.
    """
    devices = jax.devices() if devices is None else devices
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    fixed = math.prod(n for n in sizes.values() if n != -1)
    for axis, n in sizes.items():
        if n == -1:
            if len(devices) % fixed:
                raise ValueError(f"mesh {axis}=-1: {len(devices)} devices do not split over the "
                                 f"other axes' {fixed}")
            sizes[axis] = len(devices) // fixed
    wanted = math.prod(sizes.values())
    if wanted != len(devices):
        raise ValueError(f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor="
                         f"{sizes['tensor']} = {wanted} devices, but {len(devices)} are "
                         f"available ({jax.default_backend()})")
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int],
                    mesh_shape: Mapping[str, int]) -> P:
    """PartitionSpec for one array; mesh axes that do not divide the dimension are dropped."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match array shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        mesh_axes = []
        if name is not None:
            if name not in LOGICAL_RULES:
                raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_RULES)}")
            extent = 1
            for axis in LOGICAL_RULES[name]:
                n = mesh_shape.get(axis, 1)
                if axis in used or n == 1 or size % (extent * n):
                    continue
                mesh_axes.append(axis)
                extent *= n
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1
                    else tuple(mesh_axes))
    return P(*spec)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names under the current mesh; identity without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, dict(mesh.shape)))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_partition_specs(state, mesh: Mesh):
    """nnx.State of Variables (abstract or concrete) -> the same tree of PartitionSpecs.

    Variables without `logical_axes` (counters, RNG state) are replicated.
    """
    mesh_shape = dict(mesh.shape)

    def spec(variable):
        axes = getattr(variable, "logical_axes", None)
        shape = variable.get_value().shape
        return P() if axes is None else logical_to_spec(axes, shape, mesh_shape)

    return jax.tree.map(spec, state, is_leaf=_is_variable)


def state_shardings(state, mesh: Mesh):
    """nnx.State -> the same tree of NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_partition_specs(state, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [B, T, ...] input batch: batch over (data, fsdp)."""
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


# Inference on a mesh: the tools (eval, generate, analyze, scoring) run on whatever mesh the
# model's parameters were loaded onto, and exactly as before on one device.
def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` are laid out on (NamedSharding); None for arrays on one
    device."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def on_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """jax.set_mesh(mesh), so that the model's activation constraints apply; nothing without."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def placement(tree, mesh: Mesh) -> str:
    """One line for the log: the mesh, and how much of the arrays of `tree` one device holds."""
    arrays = jax.tree.leaves(tree)
    total = sum(x.nbytes for x in arrays)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in arrays)
    return (f"parameters on mesh {' x '.join(f'{k} {v}' for k, v in mesh.shape.items())} "
            f"({mesh.size} devices, {jax.process_count()} processes): {per_device / 1e6:.2f} MB "
            f"of {total / 1e6:.2f} MB per device")


def put_batch(array: np.ndarray, mesh: Mesh | None) -> np.ndarray | jax.Array:
    """A host array [B, ...] that every process holds whole -> a global array on `mesh`, B split
    over (data, fsdp) as far as they divide it, else replicated. Without a mesh, `array`."""
    if mesh is None:
        return array
    spec = logical_to_spec(("batch",) + (None,) * (array.ndim - 1), array.shape, dict(mesh.shape))
    return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec),
                                        lambda index: array[index])


def replicated(tree):
    """Every array of `tree` replicated under the current mesh, so that each process can read
    it whole (np.asarray); identity outside a mesh. Call inside jit, on what it returns."""
    return jax.tree.map(lambda x: constrain(x, (None,) * x.ndim), tree)
