"""The comparison's report: compare.json, compare.md, loss.png and routing.png.

Per variant, over its finished seeds: the final validation loss and perplexity (mean and sample
standard deviation), the loss difference to the reference variant (baseline by default) with a
95% interval, throughput, step time relative to the reference, and the parameter count.

The difference is paired by seed: d_s = loss(variant, s) - loss(reference, s) over the seeds both
finished, reported as mean(d) +- t(0.975, n-1) * sd(d) / sqrt(n). Pairing removes what a seed's
data order and initialisation do to every variant alike, so the interval is tighter than one
built from the two spreads; it needs two seeds or more. An interval that excludes 0 is a
difference larger than the seed noise at this budget, nothing more.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from delta_jax.compare import FINISHED, PlannedRun, run_status
from delta_jax.model.causal_lm import count_params
from delta_jax.train.metrics import read_metrics

logger = logging.getLogger(__name__)

ROUTING_WINDOWS = 64  # validation windows of train.seq_len tokens analyzed per run
COLORS = {"baseline": "C7", "block": "C0", "full": "C2", "delta": "C3", "delta_block": "C1"}


def run_record(run: PlannedRun) -> dict[str, Any]:
    """What one finished run contributes: its final validation numbers, the validation curve,
    throughput (median over the logged windows, which leaves out a slow first window) and the
    parameter count."""
    records = read_metrics(run.output_dir / "metrics.jsonl")
    steps = run.config.train.steps
    final = next(r for r in reversed(records) if r["step"] == steps and "val_loss" in r)
    curve = sorted({r["step"]: r["val_loss"] for r in records
                    if r.get("val_loss") is not None}.items())
    windows = [r for r in records if r.get("tokens_per_s") is not None]
    t = run.config.train
    return {"variant": run.variant, "seed": run.seed, "output_dir": str(run.output_dir),
            "steps": steps, "tokens": steps * t.batch_size * t.seq_len,
            "val_loss": final["val_loss"], "val_ppl": final["val_ppl"],
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in windows])),
            "step_time_s": float(np.median([r["step_time_s"] for r in windows])),
            "params": count_params(run.config.model),
            "val_curve": [[int(s), float(v)] for s, v in curve]}


def t_quantile_975(dof: int) -> float:
    from scipy import stats  # a dependency of jax

    return float(stats.t.ppf(0.975, dof))


def paired_difference(values: dict[int, float], reference: dict[int, float]
                      ) -> dict[str, Any] | None:
    """Mean difference over the seeds both have, with its 95% t interval (None below 2 seeds)."""
    seeds = sorted(set(values) & set(reference))
    if not seeds:
        return None
    diffs = np.array([values[s] - reference[s] for s in seeds])
    result = {"seeds": seeds, "mean": float(diffs.mean()), "low": None, "high": None}
    if len(seeds) >= 2:
        half = t_quantile_975(len(seeds) - 1) * diffs.std(ddof=1) / math.sqrt(len(seeds))
        result.update(low=float(diffs.mean() - half), high=float(diffs.mean() + half))
    return result


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    return {"mean": float(np.mean(values)),
            "std": float(np.std(values, ddof=1)) if len(values) > 1 else None}


def summarize(records: Sequence[dict[str, Any]], variants: Sequence[str],
              reference: str) -> list[dict[str, Any]]:
    """One summary per variant with finished runs, in `variants` order."""
    by_variant = {v: [r for r in records if r["variant"] == v] for v in variants}
    ref = {r["seed"]: r for r in by_variant.get(reference, [])}
    ref_step = float(np.mean([r["step_time_s"] for r in ref.values()])) if ref else None
    summaries = []
    for variant, runs in by_variant.items():
        if not runs:
            continue
        step_time = float(np.mean([r["step_time_s"] for r in runs]))
        summary = {
            "variant": variant, "seeds": [r["seed"] for r in runs], "params": runs[0]["params"],
            "val_loss": _spread([r["val_loss"] for r in runs]),
            "val_ppl": _spread([r["val_ppl"] for r in runs]),
            "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in runs])),
            "step_time_s": step_time,
            "step_time_ratio": None if ref_step is None else step_time / ref_step,
            "loss_vs_reference": None}
        if variant != reference:
            summary["loss_vs_reference"] = paired_difference(
                {r["seed"]: r["val_loss"] for r in runs},
                {s: r["val_loss"] for s, r in ref.items()})
        summaries.append(summary)
    return summaries


def _pm(spread: dict, digits: int) -> str:
    if spread["std"] is None:
        return f"{spread['mean']:.{digits}f}"
    return f"{spread['mean']:.{digits}f} ± {spread['std']:.{digits}f}"


def _difference(diff: dict | None) -> str:
    if diff is None:
        return "—"
    if diff["low"] is None:
        return f"{diff['mean']:+.4f} (1 seed)"
    mark = " *" if diff["low"] > 0 or diff["high"] < 0 else ""
    return f"{diff['mean']:+.4f} [{diff['low']:+.4f}, {diff['high']:+.4f}]{mark}"


def markdown_table(summaries: Sequence[dict[str, Any]], reference: str) -> str:
    """The table of the report, in Markdown (also what the command prints)."""
    head = ("| variant | seeds | params | val loss | val ppl | Δ loss vs "
            f"{reference} (95% CI) | tokens/s | step time |")
    lines = [head, "|" + "---|" * 8]
    for s in summaries:
        ratio = "—" if s["step_time_ratio"] is None else f"{s['step_time_ratio']:.2f}x"
        lines.append(f"| {s['variant']} | {len(s['seeds'])} | {s['params']:,} | "
                     f"{_pm(s['val_loss'], 4)} | {_pm(s['val_ppl'], 3)} | "
                     f"{_difference(s['loss_vs_reference'])} | {s['tokens_per_s']:,.0f} | "
                     f"{ratio} |")
    lines.append("")
    lines.append("Mean ± sample std over seeds; Δ is paired by seed, * where its 95% interval "
                 f"excludes 0; step time relative to {reference}.")
    return "\n".join(lines)


# Routing ----------------------------------------------------------------------------------
def routing_result(run: PlannedRun) -> dict[str, Any]:
    """analyze.routing_statistics of the run's final model on its validation split, cached in
    the run folder as routing.json (rebuilt if the run trained further)."""
    cache = run.output_dir / "routing.json"
    steps = run.config.train.steps
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("step") == steps:
            return cached
    from delta_jax.analyze import routing_statistics
    from delta_jax.eval import read_stream
    from delta_jax.loading import load_model
    from delta_jax.train.loop import data_source

    t = run.config.train
    model = load_model(run.output_dir, step=steps)
    stream = read_stream([str(data_source(run.config))], split=run.config.data.validation_split,
                         max_tokens=t.seq_len * ROUTING_WINDOWS)
    result = {"step": steps, **routing_statistics(model, stream, seq_len=t.seq_len,
                                                  max_windows=ROUTING_WINDOWS,
                                                  batch_size=t.batch_size)}
    cache.write_text(json.dumps(result, indent=1) + "\n")
    return result


def mean_over_seeds(results: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """The seeds' routing results of one variant as one, each site's statistics averaged."""
    first = results[0]
    sites = []
    for i, site in enumerate(first["sites"]):
        merged = dict(site)
        for key in ("max_weight", "entropy", "normalized_entropy"):
            merged[key] = float(np.mean([r["sites"][i][key] for r in results]))
            merged[key + "_std"] = float(np.std([r["sites"][i][key] for r in results]))
        merged["mean_weights"] = np.mean([r["sites"][i]["mean_weights"] for r in results],
                                         axis=0).tolist()
        sites.append(merged)
    return {**first, "label": label, "sites": sites, "seeds": len(results)}


# Figures ----------------------------------------------------------------------------------
def plot_validation(records: Sequence[dict[str, Any]], variants: Sequence[str],
                    path: Path) -> None:
    """Validation loss versus step: one colour per variant, the seeds' mean as a line and their
    range as a band; the right panel zooms into the second half of training."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    full, zoom = fig.subplots(1, 2)
    last = max(r["steps"] for r in records)
    low_high = []
    for variant in variants:
        curves = [dict(map(tuple, r["val_curve"])) for r in records if r["variant"] == variant]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        color = COLORS.get(variant)
        label = f"{variant} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
        for ax in (full, zoom):
            ax.plot(steps, values.mean(0), "o-", ms=3, color=color, label=label)
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
        later = values[:, np.asarray(steps) >= last / 2]
        if later.size:
            low_high.append((later.min(), later.max()))
    for ax in (full, zoom):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    full.set_ylabel("validation loss (nats/token)")
    full.set_title("validation loss (band: min-max over seeds)")
    zoom.set_xlim(last / 2 - last * 0.02, last * 1.02)
    if low_high:
        low, high = min(lo for lo, _ in low_high), max(hi for _, hi in low_high)
        pad = 0.05 * (high - low) or 0.01
        zoom.set_ylim(low - pad, high + pad)
    zoom.set_title("second half of training")
    zoom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_routing(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Mean max routing weight versus depth, one panel per variant (seeds averaged), drawn by
    the analyze command's figure."""
    from delta_jax.analyze import plot_max_weight

    plot_max_weight(results, path)


# The report -------------------------------------------------------------------------------
def build_report(runs: Sequence[PlannedRun], variants: Sequence[str], output: Path,
                 reference: str = "baseline", routing: bool = True) -> dict[str, Any]:
    """Write compare.json, compare.md, loss.png and (with routing variants) routing.png under
    `output` from the finished runs; returns the report. ValueError if none has finished."""
    finished = [run for run in runs if run_status(run) == FINISHED]
    missing = [run.name for run in runs if run not in finished]
    if not finished:
        raise ValueError(f"{output}: none of the {len(runs)} runs has finished; train them "
                         "first (compare without --report-only)")
    if missing:
        logger.warning("report without %d unfinished run(s): %s", len(missing),
                       ", ".join(missing))
    if reference not in {run.variant for run in finished}:
        logger.warning("no finished %s run: differences and step-time ratios are left out",
                       reference)
    records = [run_record(run) for run in finished]
    summaries = summarize(records, variants, reference)
    output.mkdir(parents=True, exist_ok=True)
    plot_validation(records, variants, output / "loss.png")
    report = {"reference": reference, "variants": summaries, "runs": records,
              "missing": missing, "files": {"loss_plot": str(output / "loss.png")}}
    routed = [run for run in finished if run.config.model.has_routing]
    if routing and routed:
        by_variant: dict[str, list] = {}
        for run in routed:
            logger.info("routing statistics of %s", run.name)
            by_variant.setdefault(run.variant, []).append(routing_result(run))
        merged = [mean_over_seeds(by_variant[v], v) for v in variants if v in by_variant]
        plot_routing(merged, output / "routing.png")
        report["routing"] = [{"variant": m["label"], "seeds": m["seeds"],
                              "sites": [{k: site[k] for k in ("site", "layer", "num_sources",
                                                              "max_weight", "max_weight_std",
                                                              "normalized_entropy")}
                                        for site in m["sites"]]} for m in merged]
        report["files"]["routing_plot"] = str(output / "routing.png")
    table = markdown_table(summaries, reference)
    (output / "compare.md").write_text(table + "\n")
    report["files"]["table"] = str(output / "compare.md")
    (output / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
