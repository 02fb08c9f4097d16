"""The knobs that trade speed for memory, and the runs that turn each one notch.

Alternatives to a run that does not fit, each one change away from it: a stronger remat policy
(the layer saves less and recomputes more), more gradient accumulation (smaller microbatches;
the rows of one must still split over data x fsdp), every device on fsdp (parameters and
optimizer state sharded over all of them, when some sat on data or tensor), a loss that forms
the logits a vocabulary chunk at a time (when it forms them whole), and, for delta under the
lean driver, one residual-stream state kept a layer loop instead of one a layer
(model.rebuild_states: the backward pass rebuilds the others from the source buffer).
"""
from __future__ import annotations

import dataclasses

from delta_jax.train.config import RunConfig

# Least to most memory saved (each saves a subset of what the previous one keeps).
REMAT_ORDER = ("none", "save_dots", "save_sublayer_outputs", "full")
# The chunk count offered to a run whose loss forms the whole [B,T,V] logits.
LOSS_VOCAB_CHUNKS = 8


def with_remat(run: RunConfig, policy: str) -> RunConfig:
    return dataclasses.replace(run, model=run.model.replace(remat=policy))


def with_grad_accum(run: RunConfig, grad_accum: int) -> RunConfig:
    return dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum=grad_accum))


def with_loss_vocab_chunks(run: RunConfig, chunks: int) -> RunConfig:
    return dataclasses.replace(run, train=dataclasses.replace(run.train,
                                                              loss_vocab_chunks=chunks))


def with_rebuilt_states(run: RunConfig) -> RunConfig:
    return dataclasses.replace(run, model=run.model.replace(rebuild_states=True))


def with_mesh(run: RunConfig, data: int, fsdp: int, tensor: int) -> RunConfig:
    """`run` with these sizes within each slice (the slices, if several, still on data)."""
    return dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, data=data, fsdp=fsdp,
                                                             tensor=tensor))


def stronger_remat(policy: str) -> tuple[str, ...]:
    return REMAT_ORDER[REMAT_ORDER.index(policy) + 1:]


def max_grad_accum(batch_size: int, shards: int) -> int:
    """The most microbatches whose rows still split evenly over `shards` (data x fsdp)."""
    return max((a for a in range(1, batch_size + 1)
                if batch_size % a == 0 and (batch_size // a) % shards == 0), default=1)


def alternatives(run: RunConfig, mesh: dict[str, int]) -> list[tuple[str, RunConfig]]:
    """(what changed, the changed run) for each one-notch alternative to `run` on `mesh`."""
    out = [(f"model.remat={p}", with_remat(run, p)) for p in stronger_remat(run.model.remat)]
    shards = mesh["data"] * mesh["fsdp"]
    accum, limit = run.train.grad_accum, max_grad_accum(run.train.batch_size, shards)
    for factor in (2, 4):
        if accum * factor <= limit and (run.train.batch_size // (accum * factor)) % shards == 0:
            out.append((f"train.grad_accum={accum * factor}",
                        with_grad_accum(run, accum * factor)))
    if run.train.loss_vocab_chunks == 1 and run.model.vocab_size % LOSS_VOCAB_CHUNKS == 0:
        out.append((f"train.loss_vocab_chunks={LOSS_VOCAB_CHUNKS}",
                    with_loss_vocab_chunks(run, LOSS_VOCAB_CHUNKS)))
    model = run.model
    if model.residual == "delta" and model.layer_driver == "lean" and not model.rebuild_states:
        out.append(("model.rebuild_states=true", with_rebuilt_states(run)))
    devices = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
    all_fsdp = with_mesh(run, 1, -1, 1)  # every device of a slice; the slices stay on data
    if (all_fsdp.mesh != run.mesh and mesh["data"] * mesh["tensor"] > 1
            and run.train.batch_size // accum % devices == 0):
        out.append(("mesh.data=1 mesh.fsdp=-1 mesh.tensor=1", all_fsdp))
    return out
