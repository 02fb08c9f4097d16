"""Static source-buffer geometry of each residual variant (SPEC.md section 3).

Everything here is plain numpy computed from the config, so the scanned layer body can look up
its own row by layer index and the lean backward pass knows which slots each layer wrote.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from delta_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    num_slots: int  # S: buffer slots
    first_write: np.ndarray  # [L] first slot layer l may write (slots >= it are zero on entry)
    attn_visible: np.ndarray  # [L] buffer slots the attention site sees
    mlp_visible: np.ndarray  # [L] buffer slots the MLP site sees
    boundary: np.ndarray  # [L] bool: layer l starts a block
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


def schedule(cfg: ModelConfig) -> Schedule:
    num_layers, lpb = cfg.num_layers, cfg.layers_per_block
    layer = np.arange(num_layers)
    boundary = layer % lpb == 0
    committed_before = np.concatenate([[0], np.cumsum(boundary)[:-1]]).astype(np.int32)
    zeros = np.zeros(num_layers, np.int32)
    if cfg.residual == "baseline":
        return Schedule(0, zeros, zeros, zeros, boundary, 0, False, False)
    if cfg.residual == "full":
        # Every sublayer commits its input state: slots 2l (attn) and 2l+1 (MLP).
        return Schedule(2 * num_layers, 2 * layer, 2 * layer, 2 * layer + 1, boundary,
                        2 * num_layers, False, True)
    if cfg.residual == "delta":
        # Slot 0 the embedding, then a_l at 2l+1 and m_l at 2l+2.
        attn_visible = np.where(layer == 0, 0, 2 * layer + 1)
        return Schedule(2 * num_layers + 1, 2 * layer + 1, attn_visible, 2 * layer + 2,
                        boundary, 0, True, False)
    total = int(boundary.sum())
    after = committed_before + boundary
    if cfg.residual == "block":
        return Schedule(total, committed_before, committed_before, after, boundary, total,
                        False, True)
    if cfg.residual == "delta_block":
        return Schedule(total, committed_before, committed_before, after, boundary, 0,
                        False, False)
    raise ValueError(f"unknown residual variant {cfg.residual!r}")
