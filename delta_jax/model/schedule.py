"""Static source-buffer geometry of each residual variant (docs/spec.md sections 3 and 7), and
the lean driver's layer loops over it.

Everything here is plain numpy computed from the config, so the scanned layer body can look up
its own row by layer index and the lean backward pass knows which slots each layer wrote.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from delta_jax.config import ModelConfig
from delta_jax.model.protocol import ScheduleRow


@dataclasses.dataclass(frozen=True)
class Schedule:
    num_slots: int  # S: buffer slots
    first_write: np.ndarray  # [L] first slot layer l may write (slots >= it are zero on entry)
    attn_visible: np.ndarray  # [L] buffer slots the attention site sees
    mlp_visible: np.ndarray  # [L] buffer slots the MLP site sees
    boundary: np.ndarray  # [L] bool: layer l starts a block (all True without blocks)
    final_visible: int  # buffer slots the final site sees (block, full)
    embedding_in_slot0: bool  # delta: the embedding is source 0, written before the loop
    has_live: bool  # replacement modes route over the buffer plus the live partial state

    def site_sources(self, cfg: ModelConfig) -> np.ndarray:
        """[L, 2] number of sources each (attention, MLP) site sees; 0 = the site is unused."""
        extra = int(self.has_live) + int(cfg.null_source)
        counts = np.stack([self.attn_visible, self.mlp_visible], axis=1) + extra
        if cfg.residual == "baseline":
            return np.zeros_like(counts)
        return counts

    def final_sources(self) -> int:
        return self.final_visible + 1 if self.has_live else 0

    def rows(self) -> ScheduleRow:
        """The per-layer columns the layers read, [L] each."""
        return ScheduleRow(first_write=self.first_write, attn_visible=self.attn_visible,
                           boundary=self.boundary)


def schedule(cfg: ModelConfig) -> Schedule:
    num_layers, lpb = cfg.num_layers, cfg.layers_per_block
    layer = np.arange(num_layers)
    boundary = layer % lpb == 0
    committed_before = np.concatenate([[0], np.cumsum(boundary)[:-1]]).astype(np.int32)
    # Only the block variants have blocks; the others write at every layer, as if each started
    # one (so the lean driver never splits their loops, drivers.block_runs).
    every_layer = np.ones(num_layers, bool)
    common = dict(boundary=every_layer, embedding_in_slot0=False)
    if cfg.residual == "baseline":
        zeros = np.zeros(num_layers, np.int32)
        return Schedule(num_slots=0, first_write=zeros, attn_visible=zeros, mlp_visible=zeros,
                        final_visible=0, has_live=False, **common)
    if cfg.residual == "full":
        # Every sublayer commits its input state: slots 2l (attn) and 2l+1 (MLP).
        return Schedule(num_slots=2 * num_layers, first_write=2 * layer,
                        attn_visible=2 * layer, mlp_visible=2 * layer + 1,
                        final_visible=2 * num_layers, has_live=True, **common)
    if cfg.residual == "delta":
        # Slot 0 the embedding, then a_l at 2l+1 and m_l at 2l+2.
        return Schedule(num_slots=2 * num_layers + 1, first_write=2 * layer + 1,
                        attn_visible=np.where(layer == 0, 0, 2 * layer + 1),
                        mlp_visible=2 * layer + 2, final_visible=0, has_live=False,
                        boundary=every_layer, embedding_in_slot0=True)
    if cfg.residual in ("block", "delta_block"):
        # One slot per block, committed at its first layer.
        total = int(boundary.sum())
        block = cfg.residual == "block"
        return Schedule(num_slots=total, first_write=committed_before,
                        attn_visible=committed_before, mlp_visible=committed_before + boundary,
                        final_visible=total if block else 0, has_live=block,
                        boundary=boundary, embedding_in_slot0=False)
    raise ValueError(f"unknown residual variant {cfg.residual!r}")


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """One of the lean driver's loops (lean.py): layers [start, end), which read and write only
    the buffer's first `prefix` slots. `hoisted`: the loop is one block's first layers (a block
    starts at `start` and no other before `end`; delta_block), so the driver commits that
    block's source before the loop and no layer inside it writes (ScheduleRow.write_hoisted)."""
    start: int
    end: int
    prefix: int
    hoisted: bool = False


def layer_loops(cfg: ModelConfig, plan: Schedule) -> tuple[LayerLoop, ...]:
    """cfg.layer_loops runs of consecutive layers (one without a buffer), each with the buffer
    prefix its layers touch. A layer reads and writes only the slots written before the next
    layer, so the loop ending at layer b needs first_write[b] slots (all S for the last): a
    site then reads about (n + 1) / (2n) of the slots with n loops, for one copy of the prefix
    between loops and one loop body to compile per loop."""
    num_layers, num_slots = cfg.num_layers, plan.num_slots
    count = max(1, min(cfg.layer_loops, num_layers)) if num_slots else 1
    edges = [round(k * num_layers / count) for k in range(count + 1)]
    loops = []
    for start, end in zip(edges, edges[1:]):
        prefix = num_slots if end == num_layers else int(plan.first_write[end])
        one_block = bool(plan.boundary[start]) and not plan.boundary[start + 1:end].any()
        loops.append(LayerLoop(start, end, prefix,
                               hoisted=cfg.residual == "delta_block" and one_block))
    return tuple(loops)
