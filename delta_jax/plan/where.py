"""What fits where: the smallest slice of each TPU chip (or GPU node count) that each config
trains on.

    python -m delta_jax.plan.where --configs configs/220m.yaml,configs/8b.yaml \
        --chips v5e,v5p,v6e,h100 [--fit-by total|live] [--markdown] [--wide] [--json OUT] \
        [section.key=value ...]

For each config and chip, slices are tried smallest first (chips.SLICES; GPUs as nodes of 8:
h100:1x8, 2x8, 4x8, ...); on each, every
device goes to fsdp (to tensor what the batch cannot split over), and the knobs are turned
until the step fits: remat none, save_dots, full, then full with 2, 4, 8, ... microbatches
(as many as the batch allows). The first that fits is reported: by memory_analysis's total
against the compiler's limit for a program (report.fits), or with --fit-by live by the bytes
live at the peak, all the TPU compiler checks. A slice whose parameters and
optimizer state alone exceed HBM is skipped without compiling. Memory only: each candidate is
the real train step compiled for that slice (compile.compile_step, estimate=False), in a child
process (plan/isolated.py): a candidate on which the compiler crashes is reported and skipped.
Each candidate is logged to stderr as its compile starts and with its bytes and seconds as it
ends; stdout is the table alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ["JAX_PLATFORMS"] = "cpu"  # compile only (see __main__)

from delta_jax.cli import setup_logging  # noqa: E402
from delta_jax.plan import knobs, report  # noqa: E402
from delta_jax.plan.chips import SLICES, chip  # noqa: E402
from delta_jax.plan.compile import (  # noqa: E402
    StepPlan,
    compile_named,
    knobs_text,
    mesh_sizes,
    resolved,
    state_bytes,
)
from delta_jax.plan.isolated import CompilerCrash, Worker  # noqa: E402
from delta_jax.plan.progress import logger  # noqa: E402
from delta_jax.plan.topology import PlanError  # noqa: E402
from delta_jax.sharding import slice_groups  # noqa: E402
from delta_jax.train.config import RunConfig, load_config  # noqa: E402

GiB = 2**30
REMATS = ("none", "save_dots", "full")


def candidates(run: RunConfig, devices_per_slice: int, num_slices: int = 1
               ) -> Iterator[RunConfig]:
    """The knob settings tried on `num_slices` slices (or GPU nodes) of `devices_per_slice`,
    least recompute first: a slice's devices on fsdp (to tensor what its share of the batch
    cannot split over), the slices on data."""
    batch = run.train.batch_size
    if batch % num_slices:
        return
    fsdp = devices_per_slice if (batch // num_slices) % devices_per_slice == 0 else (
        batch // num_slices)
    if devices_per_slice % fsdp:
        return
    placed = knobs.with_grad_accum(
        knobs.with_mesh(run, 1, fsdp, devices_per_slice // fsdp), 1)
    for policy in REMATS:
        yield knobs.with_remat(placed, policy)
    shards = fsdp * num_slices
    most = knobs.max_grad_accum(batch, shards)
    accum = 2
    while accum <= most:  # (the loss's logits grow with the microbatch: remat cannot help)
        if batch % accum == 0 and (batch // accum) % shards == 0:
            yield knobs.with_grad_accum(knobs.with_remat(placed, "full"), accum)
        accum *= 2


def memory_plan(run: RunConfig, topology_name: str) -> StepPlan:
    """The candidate's compiled memory (what a Worker runs in its child process)."""
    return compile_named(run, topology_name, estimate=False)


def smallest_fit(run: RunConfig, chip_name: str,
                 compile_memory: Callable[[RunConfig, str], StepPlan] = memory_plan,
                 by: str = "total") -> dict[str, Any]:
    """The first (slice, knobs) on which `run` fits, with its memory; or the largest tried.
    Candidates on which `compile_memory` raises CompilerCrash are listed under "crashed"."""
    crashed = []
    for shape in SLICES[chip_name]:
        topology = resolved(f"{chip_name}:{shape}")
        hbm = topology.hbm_per_device
        num_slices = len(slice_groups(topology.devices)[1])  # GPU nodes; a TPU slice is one
        tried = list(candidates(run, topology.num_devices // num_slices, num_slices))
        if not tried:
            continue
        state = state_bytes(tried[0], topology)
        if state > hbm:
            logger.info("%s: skipped, parameters and optimizer state alone take %.2f of "
                        "%.2f GiB", topology.name, state / GiB, hbm / GiB)
            continue
        for number, candidate in enumerate(tried, 1):
            tried_knobs = knobs_text(candidate.model.remat, candidate.train.grad_accum,
                                     mesh_sizes(candidate, topology))
            label = f"{topology.name} {tried_knobs} (candidate {number} of {len(tried)})"
            logger.info("%s: compiling the train step (memory) ...", label)
            start = time.perf_counter()
            try:
                plan = compile_memory(candidate, topology.name)
            except CompilerCrash as crash:
                logger.warning("%s: skipped, the compiler crashed (%s)", label, crash)
                crashed.append(f"{topology.name} {tried_knobs}")
                continue
            counts = (f"refused by the compiler, needs {plan.total_bytes / GiB:.2f} GiB"
                      if plan.oom else f"{plan.total_bytes / GiB:.2f} GiB (live at the peak "
                      f"{_gib_or_dash(plan.live_peak_bytes)})")
            logger.info("%s: %s of %.2f, done in %.1f s", label, counts, hbm / GiB,
                        time.perf_counter() - start)
            if report.fits(plan, hbm, by):
                return {"chip": chip_name, "slice": shape, "devices": topology.num_devices,
                        "mesh": plan.mesh, "remat": plan.remat, "grad_accum": plan.grad_accum,
                        "hbm_bytes": plan.total_bytes, "live_peak_bytes": plan.live_peak_bytes,
                        "hbm_per_device": hbm, "fit_by": by, "crashed": crashed}
    return {"chip": chip_name, "slice": None, "largest_tried": SLICES[chip_name][-1],
            "crashed": crashed}


def _gib_or_dash(n: int | None) -> str:
    return "-" if not n else f"{n / GiB:.2f}"


# The default table's columns, {long name (--wide): short name}: the slice names its chip.
COLUMNS = {"config": "config", "smallest slice": "slice (devices)",
           "mesh (data/fsdp/tensor)": "mesh d/f/t", "remat": "remat",
           "grad_accum": "accum", "HBM/device GiB": "HBM GiB", "live at peak GiB": "live GiB",
           "compiler's limit GiB": "limit GiB"}
KEY = ("per device: HBM, memory_analysis's total (an upper bound); live, the bytes live at the "
       "peak; limit, what the compiler lets a program hold (a GPU's memory):")


def table(rows: list[dict[str, Any]], markdown: bool, wide: bool = False) -> str:
    """One row per config and chip; COLUMNS unless `wide`."""
    header = ["config", "chip", "smallest slice", "mesh (data/fsdp/tensor)", "remat",
              "grad_accum", "HBM/device GiB", "live at peak GiB", "compiler's limit GiB"]
    body = []
    for r in rows:
        if r["slice"] is None:
            body.append([r["config"], r["chip"], f"none up to {r['chip']}:{r['largest_tried']}",
                         "", "", "", "", "", ""])
            continue
        m = r["mesh"]
        body.append([r["config"], r["chip"], f"{r['chip']}:{r['slice']} ({r['devices']})",
                     f"{m['data']}/{m['fsdp']}/{m['tensor']}", r["remat"], str(r["grad_accum"]),
                     f"{r['hbm_bytes'] / GiB:.2f}", _gib_or_dash(r.get("live_peak_bytes")),
                     f"{r['hbm_per_device'] / GiB:.2f}"])
    text = report.format_rows(*report.columns(header, body, None if wide else COLUMNS),
                              markdown)
    crashes = [f"{r['config']} on {c}" for r in rows for c in r.get("crashed", [])]
    if crashes:
        text += ("\n\nskipped, the compiler crashed on them (such a step may compile with "
                 "another setting, e.g. more train.loss_vocab_chunks):\n"
                 + "\n".join(f"- {c}" for c in crashes))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m delta_jax.plan.where", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", required=True, help="run YAMLs, comma-separated")
    p.add_argument("--chips", default="v5e,v5p,v6e", help="comma-separated: " + ", ".join(SLICES))
    p.add_argument("--fit-by", choices=report.FIT_COUNTS, default="total",
                   help=report.FIT_BY_HELP)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--wide", action="store_true",
                   help="the table with every column under its long name (by default it fits "
                        "in 100)")
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", help="section.key=value, applied to every config")
    args = p.parse_intermixed_args(argv)
    setup_logging()
    try:
        chips = [c for c in args.chips.split(",") if c]
        for name in chips:
            chip(name)
            if name not in SLICES:
                raise PlanError(f"--chips {name!r}: no slice list; expected some of "
                                f"{', '.join(SLICES)}")
        rows = []
        with Worker(memory_plan) as compile_memory:
            for path in [c for c in args.configs.split(",") if c]:
                run = load_config(path, args.overrides)
                for name in chips:
                    logger.info("%s on %s: the smallest slice that fits", path, name)
                    rows.append({"config": Path(path).stem,
                                 **smallest_fit(run, name, compile_memory, args.fit_by)})
    except (PlanError, ValueError, FileNotFoundError) as err:
        print(f"python -m delta_jax.plan.where: error: {err}", file=sys.stderr)
        return 2
    if not args.wide:
        print(report.wrap(KEY))
    print(table(rows, args.markdown, args.wide))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
