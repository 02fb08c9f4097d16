"""What a compiled StepPlan means for a run: does it fit, how fast would it be, and the tables.

Fits: the compiler accepted the program and the bytes counted (`by`) are within what a device
may hold: the compiler's own limit for one program where it was read (topology.py; v5e: 15.75
of its 16 GiB), else the chip's HBM. Counted "total" (the default): StepPlan.total_bytes,
memory_analysis's arguments, temporaries, outputs and code. "live": the bytes live at the peak
(live_peak_bytes). The TPU compiler checks that count, then the heap it assigns for it
(fragmentation included) with the arguments, and refuses the program if either is over its
limit: against that limit a program it accepts fits by "live". temp_size_in_bytes counts more
than the heap (BENCHMARKS.md), so "total" errs on the safe side until a TPU run shows what its
runtime needs (the trainer logs both counts beside the device's peak). Both are printed.

On GPU the compiler accepts a program of any size: the fit is the planner's judgement alone,
against the memory the device reports (chips.py).

Speed: an estimate from the compiled program, never a measurement: on TPU XLA's cost model
("optimal_seconds"), on GPU a roofline over XLA's cost analysis (compile.py); tokens/s and MFU
follow from it and the chip's peak FLOP/s.
"""
from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from delta_jax.plan.compile import XLA_COST_MODEL, StepPlan
from delta_jax.plan.floors import RoutingFloor

GiB = 2**30
# The columns the default output fits in: its lines wrap, its tables leave the rarer columns to
# --wide, which prints them all under their long names.
WIDTH = 100


FIT_COUNTS = ("total", "live")
FIT_BY_HELP = ("judge by memory_analysis's total (an upper bound; the default) or by the bytes "
               "live at the peak (what the TPU compiler checks)")


def counted_bytes(plan: StepPlan, by: str = "total") -> int:
    """The bytes a step is judged by: memory_analysis's total, or its live peak ("live"; the
    total where the compiler gave no live peak, as on CPU)."""
    if by not in FIT_COUNTS:
        raise ValueError(f"fit count {by!r} is unknown: expected one of {', '.join(FIT_COUNTS)}")
    return (plan.live_peak_bytes or plan.total_bytes) if by == "live" else plan.total_bytes


def fits(plan: StepPlan, hbm_bytes: int | None, by: str = "total") -> bool | None:
    """True/False for the bytes counted `by` against `hbm_bytes` per device; None when there is
    no limit to judge by. A program the compiler refused never fits."""
    if plan.oom is not None:
        return False
    return None if hbm_bytes is None else counted_bytes(plan, by) <= hbm_bytes


def tokens_per_s(plan: StepPlan) -> float | None:
    s = plan.estimated_step_s
    return None if not s else plan.tokens / s


def mfu(plan: StepPlan, peak_flops_per_device: float | None) -> float | None:
    """Model FLOPs (delta_jax.train.metrics, no remat recompute) over the estimated step."""
    s = plan.estimated_step_s
    if not s or not peak_flops_per_device:
        return None
    return plan.analytic_flops / s / (peak_flops_per_device * plan.num_devices)


def to_dict(plan: StepPlan, hbm_bytes: int | None, peak: float | None,
            by: str = "total") -> dict[str, Any]:
    """The plan's fields and what follows from them (JSON-ready)."""
    return {**dataclasses.asdict(plan), "hbm_bytes": hbm_bytes, "fit_by": by,
            "fits": fits(plan, hbm_bytes, by),
            "estimated_tokens_per_s": tokens_per_s(plan), "estimated_mfu": mfu(plan, peak)}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _verdict(plan: StepPlan, hbm: int | None, by: str) -> str:
    ok = fits(plan, hbm, by)
    if ok is None:
        return "not judged (no HBM figure for this device; pass --hbm-gib)"
    count = "the live peak" if by == "live" else "the total"
    over = counted_bytes(plan, by) - hbm
    if ok:
        return f"fits by {count} ({_gib(-over)} to spare)"
    if plan.oom:
        return f"does NOT fit (the compiler refused it; {_gib(over)} over)"
    text = f"does NOT fit by {count} ({_gib(over)} over)"
    if plan.live_peak_bytes and plan.live_peak_bytes <= hbm:
        text += (f"; the compiler accepts it: live at the peak {_gib(plan.live_peak_bytes)}, "
                 f"{_gib(hbm - plan.live_peak_bytes)} under (--fit-by live judges by that)")
    return text


def describe(plan: StepPlan, hbm: int | None, peak: float | None,
             floor: RoutingFloor | None = None, by: str = "total") -> str:
    """The per-device report of one compiled step, several lines; with the routing `floor`
    of its variant (floors.py), what of it no form of routing avoids."""
    est = plan.estimated_step_s
    tps, util = tokens_per_s(plan), mfu(plan, peak)
    hbm_text = f" of {_gib(hbm)}" if hbm else ""
    lines = [
        f"{plan.variant}: {plan.batch_size} x {plan.seq_len} tokens per step, {plan.knobs}, "
        f"{plan.layer_driver} driver, "
        + (f"{plan.attention} attention, " if plan.attention else "")
        + f"{plan.num_devices} devices",
        "  per device:",
        f"    parameters        {_gib(plan.params_bytes)}",
        f"    optimizer state   {_gib(plan.opt_state_bytes)}",
        f"    batch             {_gib(plan.batch_bytes)}",
        f"    temporaries       {_gib(plan.temp_bytes)}",
        f"    total             {_gib(plan.total_bytes)}{hbm_text}: "
        f"{_verdict(plan, hbm, by)}",
    ]
    if plan.live_peak_bytes:
        lines.append(f"    live at the peak  {_gib(plan.live_peak_bytes)}: the compiler's count of "
                     "the bytes live at once, what a TPU compiler checks against its limit "
                     "before the heap it assigns for it (the total above counts at least as "
                     "much, so it is an upper bound)")
    if plan.oom:
        lines.append(f"    compiler: {plan.oom}")
    elif plan.flops is None:
        lines.append("  cost: not estimated (memory only)")
    else:
        flops, accessed = f"{plan.flops / 1e12:.2f} TFLOP", _gib(plan.bytes_accessed)
        lines += [
            f"    XLA cost analysis (unrolled twin): {flops}, {accessed} accessed "
            f"(model count without recompute: "
            f"{plan.analytic_flops / plan.num_devices / 1e12:.2f} TFLOP)",
            f"  estimated by {plan.estimate_method or XLA_COST_MODEL} (not measured): "
            + ("-" if est is None else f"{est:.4f} s/step, {tps:,.0f} tokens/s"
               + ("" if util is None else f", MFU {util:.1%} (an estimate)")),
        ]
    if floor is not None:
        lines.append(
            f"  routing floor (counted from the schedule, not compiled): a buffer of "
            f"{floor.num_slots} sources, {_gib(floor.buffer_bytes)} above the baseline's HBM "
            f"(and its cotangent, {_gib(floor.cotangent_bytes)} more, where the step peaks in "
            f"the layers' backward pass); reading it at least {_gib(floor.traffic_bytes)} a "
            f"step ({floor.passes} passes over {floor.slot_reads} site-slot pairs)")
    lines.append(f"  compile time {plan.compile_s:.1f} s")
    return wrap("\n".join(lines))


def wrap(text: str, width: int = WIDTH) -> str:
    """Each line of `text` longer than `width` broken between words, its continuations
    indented four spaces more than it."""
    out = []
    for line in text.splitlines():
        indent = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line, width, subsequent_indent=indent + "    ",
                                 break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


def _baseline(plans: Sequence[StepPlan]) -> StepPlan | None:
    """The plan the ratios are to: the baseline among `plans`, if compiled."""
    return next((p for p in plans if p.variant == "baseline"), None)


def _ratio(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f" ({value / base:.2f}x)"


# The default tables' columns, {long name (--wide): short name}; the others are --wide's alone.
VARIANT_COLUMNS = {"variant": "variant", "HBM/device GiB": "HBM GiB",
                   "live at peak GiB": "live GiB", "fits": "fits", "fits (live)": "fits (live)",
                   "est. step s": "est. step s", "est. tokens/s": "est. tokens/s"}
VARIANTS_KEY = ("per device: HBM, memory_analysis's total (an upper bound); live, the bytes live "
                "at the peak; est., estimates, not measurements; (x), to the baseline:")
FLOOR_COLUMNS = {"variant": "variant", "HBM/device GiB": "HBM GiB", "HBM floor GiB": "floor",
                 "peak in backward: floor GiB": "floor+cot.",
                 "bytes accessed GiB": "accessed GiB", "bytes floor GiB": "floor"}
FLOORS_KEY = ("floor, the baseline's plus the source buffer; floor+cot., plus its cotangent "
              "too, where the step peaks in the layers' backward pass; accessed, the bytes a "
              "step reads and writes (--wide adds the live counts)")


def variants_table(plans: Sequence[StepPlan], hbm: int | None, markdown: bool = False,
                   by: str = "total", wide: bool = False) -> str:
    """One row per plan, ratios to the baseline among them (compiled in the same process);
    VARIANT_COLUMNS unless `wide`."""
    base = _baseline(plans)
    header = ["variant", "HBM/device GiB", "live at peak GiB",
              "fits" if by == "total" else "fits (live)", "est. step s",
              "bytes accessed GiB", "est. tokens/s", "compile s"]
    rows = []
    for p in plans:
        step = "-" if p.estimated_step_s is None else f"{p.estimated_step_s:.4f}"
        accessed = "-" if p.bytes_accessed is None else f"{p.bytes_accessed / GiB:.1f}"
        tps = tokens_per_s(p)
        ok = fits(p, hbm, by)
        rows.append([
            p.variant,
            f"{p.total_bytes / GiB:.2f}{_ratio(p.total_bytes, base and base.total_bytes)}",
            _live(p, base),
            "-" if ok is None else ("yes" if ok else "NO"),
            step + _ratio(p.estimated_step_s, base and base.estimated_step_s),
            accessed + _ratio(p.bytes_accessed, base and base.bytes_accessed),
            "-" if tps is None else f"{tps:,.0f}",
            f"{p.compile_s:.0f}"])
    return format_rows(*columns(header, rows, None if wide else VARIANT_COLUMNS), markdown)


def columns(header: list[str], rows: list[list[str]], short: dict[str, str] | None
             ) -> tuple[list[str], list[list[str]]]:
    """The columns of (header, rows) that `short` names, under its short names; all of them,
    as they are, where `short` is None."""
    if short is None:
        return header, rows
    keep = [i for i, name in enumerate(header) if name in short]
    return [short[header[i]] for i in keep], [[row[i] for i in keep] for row in rows]


def _live(plan: StepPlan, base: StepPlan | None, extra: int = 0) -> str:
    """plan's live peak plus `extra`, with its ratio to the baseline's live peak."""
    if not plan.live_peak_bytes:
        return "-"
    live = plan.live_peak_bytes + extra
    return f"{live / GiB:.2f}{_ratio(live, base and base.live_peak_bytes)}"


def floors_table(plans: Sequence[StepPlan], floors: Sequence[RoutingFloor | None],
                 markdown: bool = False, wide: bool = False) -> str | None:
    """The routing variants against their floors, as ratios to the baseline among `plans`:
    HBM against the baseline's plus the buffer, and plus its cotangent too (the floor where the
    step peaks in the layers' backward pass; floors.py), bytes accessed against the baseline's
    plus the floor's traffic. The bytes live at the peak (what the TPU compiler checks) against
    the baseline's plus the buffer, and plus its cotangent too (those three with `wide` alone:
    FLOOR_COLUMNS). None without a baseline or a routing variant."""
    base = _baseline(plans)
    pairs = [(p, f) for p, f in zip(plans, floors) if f is not None]
    if base is None or not pairs:
        return None
    header = ["variant", "HBM/device GiB", "HBM floor GiB", "peak in backward: floor GiB",
              "live at peak GiB", "live floor GiB", "peak in backward: live floor GiB",
              "bytes accessed GiB", "bytes floor GiB"]
    rows = []
    for p, f in pairs:
        hbm_floor = base.total_bytes + f.buffer_bytes
        backward_floor = hbm_floor + f.cotangent_bytes
        bytes_floor = (None if base.bytes_accessed is None
                       else base.bytes_accessed + f.traffic_bytes)
        rows.append([
            p.variant,
            f"{p.total_bytes / GiB:.2f}{_ratio(p.total_bytes, base.total_bytes)}",
            f"{hbm_floor / GiB:.2f}{_ratio(hbm_floor, base.total_bytes)}",
            f"{backward_floor / GiB:.2f}{_ratio(backward_floor, base.total_bytes)}",
            _live(p, base),
            _live(base, base, f.buffer_bytes),
            _live(base, base, f.buffer_bytes + f.cotangent_bytes),
            "-" if p.bytes_accessed is None else
            f"{p.bytes_accessed / GiB:.1f}{_ratio(p.bytes_accessed, base.bytes_accessed)}",
            "-" if bytes_floor is None else
            f"{bytes_floor / GiB:.1f}{_ratio(bytes_floor, base.bytes_accessed)}"])
    return format_rows(*columns(header, rows, None if wide else FLOOR_COLUMNS), markdown)


def format_rows(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |"
                         for r in [header, ["---"] * len(header), *rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
