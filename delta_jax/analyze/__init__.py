"""What the routing learned: routing_statistics, format_table and the figures.

The command line `python -m delta_jax.analyze --model PATH [...] --data ...` is in __main__.py.

For every routing site (attention and MLP site of each layer, and the final site of block/full)
over the tokens of the data: mean max weight, entropy and normalised entropy (docs/spec.md section
5), and the mean weight of each source. The command writes routing.json and two kinds of PNG
figure to --out: max_weight.png (mean max weight versus depth, one panel per model, with 1/N,
the value of uniform routing, dashed) and heatmap_<label>.png (sources x sites, mean weights),
and prints a table.

Source names, in the order a site sees them: "null" (a learned null source, if any), then
  delta, full         emb, a0, m0, a1, m1, ...   (embedding, attention / MLP output of layer l)
  block, delta_block  emb, b0, b1, ...           (block k: its partial sum in block, its delta
                                                  in delta_block, telescoped under
                                                  block_sources="reference": docs/spec.md section 3)
The last source of a block/full site is the live state (the current partial sum / output).

Conventions: L layers, N_pad padded sources per site (see Routing), W windows of T tokens.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure  # no pyplot: figures render with Agg, headless
from matplotlib.ticker import MaxNLocator

from delta_jax.config import ModelConfig
from delta_jax.data.tokenizers import check_token_ids
from delta_jax.eval import TokenStream
from delta_jax.model import CausalLM, Routing
from delta_jax.model.schedule import schedule
from delta_jax.sharding import mesh_of, on_mesh, put_batch, replicated

SUBLAYERS = ("attn", "mlp")
STATISTICS = ("max_weight", "entropy", "normalized_entropy")


def source_names(cfg: ModelConfig, count: int) -> list[str]:
    """Names of the first `count` sources a site of `cfg` sees (module doc)."""
    null = ["null"] if cfg.null_source else []
    if cfg.residual in ("delta", "full"):
        names = ["emb"] + [f"{s[0]}{l}" for l in range(cfg.num_layers) for s in SUBLAYERS]
    else:
        names = ["emb"] + [f"b{k}" for k in range(cfg.num_layers)]
    return (null + names)[:count]


@functools.partial(jax.jit, static_argnums=0)
def _batch_routing(graphdef, state, input_ids):
    """[B,T] ids -> (Routing whose weights are the batch means [L,2,N_pad,1,1], statistics)."""
    routing = nnx.merge(graphdef, state).forward(input_ids, return_routing=True).routing
    mean = lambda w: None if w is None else w.mean(axis=(-2, -1), keepdims=True)
    return replicated((routing.replace(weights=mean(routing.weights), final=mean(routing.final)),
                       routing.statistics()))


def routing_statistics(model: CausalLM, stream: TokenStream, *, seq_len: int = 512,
                       max_windows: int = 16, batch_size: int = 4) -> dict:
    """Statistics of every used site over up to `max_windows` non-overlapping windows of
    `seq_len` tokens of the stream (the tail shorter than a window is left out). A model
    loaded onto a mesh runs there."""
    cfg = model.config
    if not cfg.has_routing:
        raise ValueError(f"residual={cfg.residual!r} has no routing sites to analyze")
    tokens = stream.tokens
    check_token_ids(tokens, cfg.vocab_size, where=stream.source)
    seq_len = min(seq_len, len(tokens))
    windows = min(max_windows, len(tokens) // seq_len)
    ids = tokens[:windows * seq_len].reshape(windows, seq_len)
    graphdef, state = nnx.split(model)
    mesh = mesh_of(state)
    total = None
    for first in range(0, windows, batch_size):
        batch = ids[first:first + batch_size]
        with on_mesh(mesh):
            means, stats = _batch_routing(graphdef, state, put_batch(batch, mesh))
        # Batch means weighted by the batch's tokens give the mean over all tokens.
        weighted = jax.tree.map(lambda x: np.asarray(x, np.float64) * batch.size, (means, stats))
        total = weighted if total is None else jax.tree.map(np.add, total, weighted)
    means, stats = jax.tree.map(lambda x: x / ids.size, total)
    return {"residual": cfg.residual, "num_layers": cfg.num_layers, "data": stream.source,
            "tokens": int(ids.size), "windows": windows, "seq_len": seq_len,
            "sites": _site_records(cfg, means, stats, _gates(model))}


def _gates(model: CausalLM) -> dict[str, np.ndarray] | None:
    """Gate values {"layers": [L,2], "final": [] or None}, or None without routing gates."""
    if model.layers.attn_site.gate is None:
        return None
    final = model.final_site.gate if model.final_site is not None else None
    return {"layers": np.stack([np.asarray(model.layers.attn_site.gate[...], np.float64),
                                np.asarray(model.layers.mlp_site.gate[...], np.float64)], 1),
            "final": None if final is None else float(final[...])}


def _site_records(cfg: ModelConfig, means: Routing, stats: dict, gates: dict | None
                  ) -> list[dict]:
    records = []
    for layer in range(cfg.num_layers):
        for s, sublayer in enumerate(SUBLAYERS):
            count = int(means.num_sources[layer, s])
            if count:
                gate = None if gates is None else float(gates["layers"][layer, s])
                records.append(_record(cfg, f"L{layer}.{sublayer}", layer, count,
                                       means.site_weights(layer, s),
                                       {k: stats[k][layer, s] for k in STATISTICS}, gate))
    if means.final is not None:
        records.append(_record(cfg, "final", cfg.num_layers, means.final_sources,
                               means.final_weights(), {k: stats["final_" + k]
                                                       for k in STATISTICS},
                               None if gates is None else gates["final"]))
    return records


def _record(cfg, name, layer, count, weights, stats, gate) -> dict:
    record = {"site": name, "layer": layer, "num_sources": count,
              **{k: float(v) + 0.0 for k, v in stats.items()},  # + 0.0: no -0.0 entropies
              "sources": source_names(cfg, count),
              "mean_weights": [float(w) for w in np.asarray(weights).reshape(-1)]}
    if gate is not None:  # the site reads (1-gate)*base + gate*routed
        record["gate"] = gate
    return record


# Output -----------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    gated = any("gate" in r for r in result["sites"])
    lines = [f"{result['label']} ({result['residual']}): {result['tokens']} tokens of "
             f"{result['data']}",
             f"{'site':<10}{'N':>4}{'max w':>8}{'entropy':>9}{'norm H':>8}"
             + (f"{'gate':>8}" if gated else "") + "  top sources"]
    for r in result["sites"]:
        top = sorted(zip(r["mean_weights"], r["sources"]), reverse=True)[:3]
        gate = (f"{r['gate']:>8.3f}" if "gate" in r else " " * 8) if gated else ""
        lines.append(f"{r['site']:<10}{r['num_sources']:>4}{r['max_weight']:>8.3f}"
                     f"{r['entropy']:>9.3f}{r['normalized_entropy']:>8.3f}{gate}  "
                     + " ".join(f"{name}:{w:.2f}" for w, name in top))
    return "\n".join(lines)


def plot_max_weight(results: Sequence[dict], path: Path) -> None:
    """Mean max weight per site versus layer, one panel per model, 1/N dashed."""
    fig = Figure(figsize=(4.2 * len(results), 3.4))
    axes = fig.subplots(1, len(results), sharey=True, squeeze=False)
    for ax, result in zip(axes[0], results):
        for sublayer, color in zip(SUBLAYERS + ("final",), ("C0", "C1", "C3")):
            sites = [r for r in result["sites"] if r["site"].endswith(sublayer)]
            if not sites:
                continue
            layers = [r["layer"] for r in sites]
            ax.plot(layers, [r["max_weight"] for r in sites], "o-", color=color, label=sublayer)
            ax.plot(layers, [1 / r["num_sources"] for r in sites], "--", color=color, alpha=0.5)
        ax.set_title(_title(result))
        ax.set_xlabel("layer (final site at L)" if result["sites"][-1]["site"] == "final"
                      else "layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("mean max routing weight")
    axes[0, 0].legend(title="site (dashed: 1/N)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_heatmap(result: dict, path: Path) -> Figure:
    """Mean weight of each source (rows, oldest first) at each site (columns); blank where a site
    does not see the source, grey where it sees only one (its weight is 1 by construction, and
    would otherwise set the colour scale's reading)."""
    sites = result["sites"]
    rows = max(r["num_sources"] for r in sites)
    names = max((r["sources"] for r in sites), key=len)
    grid, single = np.full((rows, len(sites)), np.nan), np.full((rows, len(sites)), np.nan)
    for col, r in enumerate(sites):
        (single if r["num_sources"] == 1 else grid)[:r["num_sources"], col] = r["mean_weights"]
    fig = Figure(figsize=(max(4.0, 0.32 * len(sites) + 2), max(3.0, 0.28 * rows + 1.5)))
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                      interpolation="nearest")
    if not np.isnan(single).all():
        ax.imshow(np.ma.masked_invalid(single), aspect="auto", interpolation="nearest",
                  cmap=ListedColormap(["0.75"]))
    ax.set_xticks(range(len(sites)), [r["site"] for r in sites], rotation=90, fontsize=7)
    ax.set_yticks(range(rows), names, fontsize=7)
    ax.set_xlabel("routing site (grey: one source, weight 1)")
    ax.set_ylabel("source")
    ax.set_title(f"{_title(result)}: mean routing weights", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def site_names(cfg: ModelConfig) -> list[str]:
    """The used routing sites in call order, named as in routing_statistics ("L0.attn", ...,
    "final")."""
    counts = schedule(cfg).site_sources(cfg)
    names = [f"L{layer}.{sublayer}" for layer in range(cfg.num_layers)
             for s, sublayer in enumerate(SUBLAYERS) if counts[layer, s] > 0]
    return names + (["final"] if cfg.has_final_site else [])


def heatmap_result(cfg: ModelConfig, mean_weights: Sequence[np.ndarray], label: str) -> dict:
    """What plot_heatmap draws, from per-site mean weights in call order (the trainer's routing
    probe gives them)."""
    names = site_names(cfg)
    if len(mean_weights) != len(names):
        raise ValueError(f"{len(mean_weights)} routing sites' weights for the {len(names)} sites "
                         f"of residual={cfg.residual!r}")
    return {"label": label, "residual": cfg.residual,
            "sites": [{"site": name, "num_sources": len(w), "sources": source_names(cfg, len(w)),
                       "mean_weights": [float(x) for x in np.asarray(w).reshape(-1)]}
                      for name, w in zip(names, mean_weights)]}


def _title(result: dict) -> str:
    label, residual = result["label"], result["residual"]
    return label if label == residual else f"{label} ({residual})"
