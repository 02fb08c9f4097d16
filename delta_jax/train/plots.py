"""End-of-run PNGs: the loss curve and the routing heatmap (sources x sites)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on clusters
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from delta_jax.config import ModelConfig  # noqa: E402
from delta_jax.model.schedule import schedule  # noqa: E402


def site_labels(cfg: ModelConfig) -> list[str]:
    """Names of the used routing sites in call order: "L0 attn", "L0 mlp", ..., "final"."""
    counts = schedule(cfg).site_sources(cfg)
    labels = [f"L{layer} {name}" for layer in range(cfg.num_layers)
              for site, name in enumerate(("attn", "mlp")) if counts[layer, site] > 0]
    return labels + (["final"] if cfg.has_final_site else [])


def plot_loss(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Training loss (and validation loss where logged) against the step."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_routing(mean_weights: Sequence[np.ndarray], labels: Sequence[str], path: Path,
                 title: str) -> Path:
    """Heatmap of token-averaged routing weights: one column per site, one row per source in the
    site's order (null source first if any, oldest source next, the live state last); blank
    where a site has fewer sources."""
    if len(mean_weights) != len(labels):
        raise ValueError(f"{len(mean_weights)} routing sites but {len(labels)} labels")
    rows = max(len(w) for w in mean_weights)
    grid = np.full((rows, len(mean_weights)), np.nan)
    for column, weights in enumerate(mean_weights):
        grid[:len(weights), column] = weights
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(labels) + 2), max(3.5, 0.25 * rows + 2)))
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(rows))
    ax.set_xlabel("routing site")
    ax.set_ylabel("source (oldest first)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="mean routing weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
