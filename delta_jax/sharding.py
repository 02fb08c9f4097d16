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
from jax.experimental import mesh_utils
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


# Each mesh axis is an in-slice part (ICI on a TPU slice, NVLink within a GPU node) times an
# across-slice part (DCN, the data-centre network between slices or nodes). By default every
# slice goes on `data`, so that only the gradient all-reduce crosses the slow network.
ACROSS_SLICES_DEFAULT = (-1, 1, 1)


def slice_groups(devices: Sequence) -> tuple[str, list[list]]:
    """The devices split into the granules the slow network joins, in order: TPU slices (or GPU
    nodes that carry a slice index), else on GPU one group per process (node). One group
    otherwise. Returns (what a group is called, the groups)."""
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        key, name = "slice_index", "slices"
    elif devices[0].platform == "gpu" and len({d.process_index for d in devices}) > 1:
        key, name = "process_index", "nodes"
    else:
        return "slices", [list(devices)]
    groups: dict[int, list] = {}
    for device in devices:
        groups.setdefault(getattr(device, key), []).append(device)
    return name, [groups[k] for k in sorted(groups)]


def _resolve(sizes: Sequence[int], total: int, what: str, unit: str = "devices",
             context: str = "") -> tuple[int, ...]:
    """(data, fsdp, tensor) with its one -1 resolved so that the product is `total`, or a
    one-line ValueError naming the sizes and what is available."""
    out = list(sizes)
    if -1 in out:
        fixed = math.prod(n for n in sizes if n != -1)
        axis = MESH_AXES[out.index(-1)]
        if total % fixed:
            raise ValueError(f"{what} {axis}=-1: {total} {unit} do not split over the other "
                             f"axes' {fixed}{context}")
        out[out.index(-1)] = total // fixed
    if math.prod(out) != total:
        text = " x ".join(f"{axis}={n}" for axis, n in zip(MESH_AXES, out))
        raise ValueError(f"{what} {text} = {math.prod(out)} {unit}, but {total} are "
                         f"available{context}")
    return tuple(out)


def make_hybrid_mesh(per_slice: Sequence[int] = (1, -1, 1),
                     across_slices: Sequence[int] = ACROSS_SLICES_DEFAULT,
                     devices: Sequence | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh every entry point runs on, over one slice or many, with
    Auto axes (plain indexing of sharded arrays works).

    per_slice: each axis's devices within one slice (or node); across_slices: how many slices
    (nodes) each axis spans; each may hold one -1 (the rest). Axis sizes are the products.
    """
    devices = list(jax.devices() if devices is None else devices)
    grid = device_grid(per_slice, across_slices, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(per_slice: Sequence[int], across_slices: Sequence[int],
                devices: Sequence) -> np.ndarray:
    """make_hybrid_mesh's devices as a [data, fsdp, tensor] array. Several slices go through
    mesh_utils.create_hybrid_device_mesh: along each axis, index = slice part * in-slice size
    + in-slice part, so every group of an axis's in-slice part lies within one slice, laid out
    for the slice's interconnect."""
    granule, groups = slice_groups(devices)
    if len({len(g) for g in groups}) > 1:
        raise ValueError(f"the devices come in {granule} of unequal sizes "
                         f"{sorted({len(g) for g in groups})}: expected equal ones")
    across = _resolve(across_slices, len(groups), "mesh across slices:", granule)
    within = _resolve(per_slice, len(groups[0]), "mesh", context=(
        f" in each of the {len(groups)} {granule}" if len(groups) > 1 else
        f" ({devices[0].platform})"))
    # v5e slices lay out well only if a physical axis may be split (as jax.make_mesh does)
    split = devices[0].device_kind in ("TPU v5 lite", "TPU v5e")
    if len(groups) > 1:
        return mesh_utils.create_hybrid_device_mesh(
            within, across, devices, process_is_granule=granule == "nodes",
            allow_split_physical_axes=split)
    if _cores_share_chips(devices):
        # v2-v4 topologies list each TensorCore; jax's interconnect-aware layout wants one
        # device per chip: take them in order.
        return np.array(devices).reshape(within)
    return mesh_utils.create_device_mesh(within, devices, allow_split_physical_axes=split)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None, *,
              across_slices: Sequence[int] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh of these total sizes (one may be -1: the devices the others
    leave), with Auto axes.

    Over several slices (or GPU nodes) the slices go on `data` unless across_slices says how
    many each axis spans; each axis's in-slice part is its size over that (make_hybrid_mesh).
    """
    devices = list(jax.devices() if devices is None else devices)
    granule, groups = slice_groups(devices)
    sizes = _resolve((data, fsdp, tensor), len(devices), "mesh",
                     context=f" ({devices[0].platform})")
    if across_slices is None:
        if sizes[0] % len(groups):
            per_slice = len(devices) // len(groups)
            raise ValueError(
                f"mesh data {sizes[0]} x fsdp {sizes[1]} x tensor {sizes[2]} over "
                f"{len(groups)} {granule} of {per_slice} devices: the {granule} go on the data "
                f"axis, so data must be a multiple of {len(groups)}, such as data "
                f"{len(groups)} x fsdp {per_slice} x tensor 1 (or say across_slices)")
        across_slices = (len(groups), 1, 1)
    across = _resolve(across_slices, len(groups), "mesh across slices:", granule)
    if any(n % a for n, a in zip(sizes, across)):
        raise ValueError(f"mesh sizes {sizes} do not split over {across} {granule}: expected "
                         "each axis a multiple of its part across them")
    return make_hybrid_mesh([n // a for n, a in zip(sizes, across)], across, devices)


def _cores_share_chips(devices: Sequence) -> bool:
    """TPU devices that are TensorCores of fewer chips (v2-v4 topologies)."""
    if devices[0].platform != "tpu":
        return False
    chips = {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices}
    return len(chips) < len(devices)


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
