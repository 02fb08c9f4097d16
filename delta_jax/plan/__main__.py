"""python -m delta_jax.plan: will this run fit on that slice, and how fast would it be?

    python -m delta_jax.plan --config configs/8b.yaml --topology v5p:4x4x4 \
        [--num-slices K] [--variants all|baseline,delta,...] [--markdown] [--wide] [--json OUT] \
        [--hbm-gib X] [--fit-by total|live] [--peak-tflops X] [--no-suggest] \
        [section.key=value ...]

Compiles the trainer's train step (same shardings, donation, gradient accumulation, remat) for
the named topology on this host: a TPU slice needs libtpu (`pip install "jax[tpu]==<jax
version>"`) but no TPU; GPU nodes (h100:2x8, h200:1x8: NODESxGPUS_PER_NODE) need the GPU
compiler (`make gpu-compiler`) but no GPU, and are judged against the memory the GPU reports
with a roofline step estimate (plan/gpus.py); `cpu:N` uses N (fake) CPU devices. Prints per
device the parameters, optimizer state, batch, temporaries, total and the bytes live at the
peak against what the TPU compiler lets a program hold (its own limit, read from it: v5e 15.75
of 16 GiB) or the GPU's memory, fits or not (by the total, or with --fit-by live by the live
peak, all the TPU compiler checks); XLA's FLOPs, bytes accessed and the step time they give
(an estimate, not a measurement) with the tokens/s and MFU that follow. A run that does not fit
is compiled again with each knob turned one notch (remat, grad_accum, all-fsdp, the loss's
vocabulary chunks, delta's rebuilt states) to show which helps and by how much. Each compile
runs in a child process (plan/isolated.py): a compiler crash is reported for its variant and
the others go on. A compile takes minutes at the configs' sizes: each one is logged to stderr
as it starts and with its seconds as it ends; stdout is the report alone (`> plan.txt`).

Exit status: 0 all fit (or nothing to judge by), 1 some variant does not fit, 2 bad input,
3 the compiler crashed on some variant (and the rest fit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The planner only compiles: keep jax off any attached accelerator (and, with libtpu installed,
# off probing for one); TPU and GPU topologies are reached through compile-only devices, and the
# GPU ones need jax on the CPU alone. Set whatever the environment (or importing delta_jax, on a
# host without a TPU) said.
os.environ["JAX_PLATFORMS"] = "cpu"

from delta_jax.cli import setup_logging  # noqa: E402
from delta_jax.config import RESIDUALS  # noqa: E402
from delta_jax.plan import knobs, progress, report  # noqa: E402
from delta_jax.plan.compile import (  # noqa: E402
    StepPlan,
    compile_named,
    cost_named,
    mesh_sizes,
    with_variant,
)
from delta_jax.plan.floors import floor_for_plan  # noqa: E402
from delta_jax.plan.isolated import CompilerCrash, Worker  # noqa: E402
from delta_jax.plan.topology import PlanError, Topology, resolve  # noqa: E402
from delta_jax.train.config import RunConfig, load_config  # noqa: E402

GiB = 2**30


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m delta_jax.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a run YAML (configs/8b.yaml)")
    p.add_argument("--topology", required=True,
                   help="v5p:4x4x4, v5e:4x4, v6e:2x4, v4:2x2x1, ..., h100:2x8, h200:1x8 "
                        "(GPU nodes x GPUs per node), or cpu:N")
    p.add_argument("--num-slices", type=int, default=1,
                   help="slices joined over DCN (Multislice); by default mesh.data spans them "
                        "(mesh.dcn_data/dcn_fsdp/dcn_tensor say otherwise)")
    p.add_argument("--variants", default=None,
                   help="'all' or residual variants, comma-separated (default: the config's)")
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="HBM per device to judge against (default: the compiler's limit for a "
                        "program, read from it; the chip's HBM where it says none)")
    p.add_argument("--fit-by", choices=report.FIT_COUNTS, default="total",
                   help=report.FIT_BY_HELP)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak bf16 TFLOP/s per device for MFU (default: the chip's)")
    p.add_argument("--no-estimate", action="store_true",
                   help="memory only: skip the unrolled twin compiled for the cost numbers")
    p.add_argument("--no-suggest", action="store_true",
                   help="do not compile alternatives for a run that does not fit")
    p.add_argument("--markdown", action="store_true", help="print the variants table as Markdown")
    p.add_argument("--wide", action="store_true",
                   help="the tables with every column under its long name (about 160 columns; "
                        "by default they fit in 100, the rarer columns left out)")
    p.add_argument("--json", type=Path, help="write every compiled plan here (a JSON list)")
    p.add_argument("overrides", nargs="*", help="section.key=value, as for the trainer")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the flags


def variant_names(text: str | None, default: str) -> list[str]:
    """"all" / "a,b" / None -> variants, baseline first (the ratios' reference)."""
    names = list(RESIDUALS) if text == "all" else [default] if text is None else [
        n for n in text.split(",") if n]
    unknown = [n for n in names if n not in RESIDUALS]
    if unknown or not names:
        raise PlanError(f"--variants {text!r}: unknown {unknown or text!r}; expected 'all' or "
                        f"some of {', '.join(RESIDUALS)}")
    return sorted(names, key=lambda n: n != "baseline")


def compile_plan(compile_: Worker, run: RunConfig, topology: Topology, estimate: bool,
                 label: str) -> StepPlan:
    """run's step compiled in compile_'s child process: the step itself, then with `estimate`
    its cost twin (compile.py), each logged with its seconds under `label`."""
    with progress.timed(f"{label}: compiling the train step (memory)"):
        plan = compile_(run, topology.name, topology.num_slices, False)
    if not estimate or plan.oom is not None:
        return plan
    with progress.timed(f"{label}: compiling the cost twin (layers unrolled: FLOPs, time)"):
        return compile_.call(cost_named, run, topology.name, topology.num_slices, plan)


def suggest(run: RunConfig, plan: StepPlan, topology: Topology, hbm: int | None,
            peak: float | None, compile_: Worker, by: str = "total") -> list[dict[str, Any]]:
    """Compile each one-notch alternative to `run`; print and return how each does."""
    rows, out = [], []  # memory only: the question is whether it fits
    alternatives = knobs.alternatives(run, plan.mesh)
    for number, (change, alt_run) in enumerate(alternatives, 1):
        label = f"{plan.variant}, alternative {number} of {len(alternatives)} ({change})"
        try:
            alt = compile_plan(compile_, alt_run, topology, False, label)
        except CompilerCrash as crash:
            rows.append([change, f"compiler crashed: {crash}", "", "-"])
            out.append({"change": change, "compiler_crash": str(crash)})
            continue
        ok = report.fits(alt, hbm, by)
        counted, before = report.counted_bytes(alt, by), report.counted_bytes(plan, by)
        rows.append([change, f"{counted / GiB:.2f}", f"{(counted - before) / GiB:+.2f}",
                     "-" if ok is None else ("yes" if ok else "no")])
        out.append({"change": change, **report.to_dict(alt, hbm, peak, by)})
    if rows:
        print("  alternatives, each one change from the above (compiled):")
        counted = "HBM/device GiB" if by == "total" else "live at peak GiB"
        table = report.format_rows(["change", counted, "vs above GiB", "fits"], rows,
                                   markdown=False)
        print("\n".join("    " + line for line in table.splitlines()))
    return out


def header(topology: Topology, config: str, hbm_gib: float | None) -> str:
    """The report's first lines: the topology, a device's memory figures (each named for what
    it is) and the one a step's fit is judged against."""
    judged = (f"--hbm-gib, {hbm_gib:.2f} GiB" if hbm_gib is not None
              else topology.judged_against())
    memory = topology.memory()
    return "\n".join([f"topology {topology.describe()}; config {config}",
                      *([report.wrap(f"  per device: {memory}")] if memory else []),
                      f"  fit judged against {judged}"])


def plan(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The command; returns what --json writes. Raises PlanError/ValueError on bad input."""
    args = parse_args(argv)
    base = load_config(args.config, args.overrides)
    topology = resolve(args.topology, args.num_slices)
    mesh_sizes(base, topology)  # a mesh that cannot cover it fails before compiling
    hbm = (int(args.hbm_gib * GiB) if args.hbm_gib is not None else topology.hbm_per_device)
    peak = (args.peak_tflops * 1e12 if args.peak_tflops is not None
            else topology.peak_flops_per_device
            or (base.train.peak_tflops and base.train.peak_tflops * 1e12))
    print(header(topology, args.config, args.hbm_gib))
    results, plans, floors = [], [], []
    variants, start = variant_names(args.variants, base.model.residual), time.perf_counter()
    with Worker(compile_named) as compile_:
        for number, variant in enumerate(variants, 1):
            run = RunConfig(**{**vars(base), "model": with_variant(base.model, variant)})
            entry = {"topology": topology.name, "num_slices": topology.num_slices}
            try:
                step_plan = compile_plan(compile_, run, topology, not args.no_estimate,
                                         f"{variant} (variant {number} of {len(variants)})")
            except CompilerCrash as crash:
                print(report.wrap(f"{variant}: not planned, the compiler crashed ({crash}); "
                                  "the same step may compile with other settings (remat, "
                                  "grad_accum, train.loss_vocab_chunks)"), flush=True)
                results.append({**entry, "variant": variant, "fits": None,
                                "compiler_crash": str(crash)})
                continue
            floor = floor_for_plan(run.model, run.train.batch_size, run.train.seq_len,
                                   run.train.grad_accum, step_plan.mesh)
            plans.append(step_plan)
            floors.append(floor)
            print(report.describe(step_plan, hbm, peak, floor, args.fit_by), flush=True)
            entry.update(**report.to_dict(step_plan, hbm, peak, args.fit_by),
                         routing_floor=None if floor is None else floor.to_dict())
            if report.fits(step_plan, hbm, args.fit_by) is False and not args.no_suggest:
                entry["alternatives"] = suggest(run, step_plan, topology, hbm, peak, compile_,
                                                args.fit_by)
            results.append(entry)
    progress.logger.info("planned %d variant(s) in %.1f s", len(variants),
                         time.perf_counter() - start)
    print_tables(plans, floors, hbm, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


def print_tables(plans: list[StepPlan], floors: list, hbm: int | None,
                 args: argparse.Namespace) -> None:
    """The variants side by side, and the routing variants against their floors (floors.py),
    each after a key to its short column names unless --wide."""
    if len(plans) > 1 or (plans and args.markdown):
        print()
        if not args.wide:
            print(report.wrap(report.VARIANTS_KEY))
        print(report.variants_table(plans, hbm, markdown=args.markdown, by=args.fit_by,
                                    wide=args.wide))
    floor_table = report.floors_table(plans, floors, markdown=args.markdown, wide=args.wide)
    if floor_table is not None:
        print()
        print(report.wrap("routing against its floor (the baseline plus what no form of routing "
                          "avoids; delta_jax/plan/floors.py)"
                          + ("" if args.wide else f"; {report.FLOORS_KEY}") + ":"))
        print(floor_table)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    try:
        results = plan(argv)
    except (PlanError, ValueError, FileNotFoundError) as err:
        print(f"python -m delta_jax.plan: error: {err}", file=sys.stderr)
        return 2
    if any(r["fits"] is False for r in results):
        return 1
    return 3 if any("compiler_crash" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
