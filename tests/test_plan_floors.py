"""Routing's floors (delta_jax/plan/floors.py): the site-slot pairs counted from the schedule
against the closed forms of docs/spec.md's source lists, and the bytes that follow."""
import dataclasses

import pytest

from delta_jax.config import ModelConfig
from delta_jax.plan import report
from delta_jax.plan.compile import StepPlan
from delta_jax.plan.floors import (
    LEAN_PASSES,
    SAVING_PASSES,
    floor_for_plan,
    routing_floor,
    visible_slot_reads,
)


def _config(residual: str, num_layers: int = 12, num_blocks: int = 4, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=num_layers, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=64, residual=residual,
                       num_blocks=num_blocks, dtype="bfloat16", **kw)


@pytest.mark.parametrize("num_layers", [1, 2, 12, 36])
def test_delta_and_full_pairs_have_closed_forms(num_layers):
    # delta: layer l's attention site sees the embedding and the 2l earlier deltas (none at
    # layer 0), its MLP site 2l + 1 of them from the buffer (its layer's own attention output
    # comes directly): sum (2l + 1) - 1 + sum (2l + 1) = 2L^2 - 1.
    assert visible_slot_reads(_config("delta", num_layers)) == 2 * num_layers**2 - 1
    # full: 2l and 2l committed inputs at the two sites, all 2L at the final site: 2L^2.
    assert visible_slot_reads(_config("full", num_layers)) == 2 * num_layers**2


@pytest.mark.parametrize("residual,final", [("block", True), ("delta_block", False)])
def test_block_pairs_count_the_blocks_committed_before(residual, final):
    # 12 layers in 4 blocks of 3; the first layer of block k commits slot k (block 0's: the
    # embedding). That layer's two sites read the k slots before it from the buffer (its MLP
    # site gets slot k directly), the block's other two layers read k + 1 at both sites.
    pairs = sum(2 * k + 2 * 2 * (k + 1) for k in range(4)) + (4 if final else 0)
    assert visible_slot_reads(_config(residual)) == pairs


def test_baseline_has_no_floor():
    assert visible_slot_reads(_config("baseline")) == 0
    assert routing_floor(_config("baseline"), 4, 16) is None


def test_floor_bytes_follow_the_pairs_and_the_driver():
    cfg = _config("delta", num_layers=3)
    floor = routing_floor(cfg, rows_per_device=2, seq_len=16, grad_accum=3)
    slot = 2 * 16 * 32 * 2  # bf16 [B,T,D] of one microbatch on one device
    assert floor.slot_bytes == slot and floor.num_slots == 7 and floor.slot_reads == 17
    assert floor.buffer_bytes == 7 * (slot + 2 * 16 * 4)  # values and float32 inverse RMS
    assert floor.cotangent_bytes == 7 * slot  # the values' cotangent, in their dtype
    assert floor.passes == LEAN_PASSES
    assert floor.traffic_bytes == 3 * (LEAN_PASSES * 17 + 2 * 7) * slot
    saving = routing_floor(dataclasses.replace(cfg, layer_driver="scan"), 2, 16)
    assert saving.passes == SAVING_PASSES


def test_floor_for_plan_splits_the_microbatch_over_the_batch_axes_only():
    cfg = _config("delta_block")
    split = floor_for_plan(cfg, batch_size=64, seq_len=16, grad_accum=2,
                           mesh={"data": 2, "fsdp": 4, "tensor": 2})
    assert split == routing_floor(cfg, rows_per_device=4, seq_len=16, grad_accum=2)


def _plan(variant: str, total: int, accessed: float, live: int) -> StepPlan:
    return StepPlan(variant=variant, remat="none", layer_driver="lean",
                    mesh={"data": 1, "fsdp": 1, "tensor": 1}, batch_size=2, seq_len=16,
                    grad_accum=1, num_devices=1, params_bytes=1, opt_state_bytes=1,
                    batch_bytes=1, argument_bytes=3, output_bytes=0, alias_bytes=0,
                    temp_bytes=total - 3, code_bytes=0, total_bytes=total, flops=1.0,
                    bytes_accessed=accessed, estimated_step_s=1.0, analytic_flops=1.0,
                    compile_s=0.0, live_peak_bytes=live)


def test_floors_table_adds_the_floor_to_the_baseline():
    gib = 2**30
    # 4096 rows of 1024 tokens: 7 slots of 0.25 GiB, so the two HBM floors print apart
    floor = routing_floor(_config("delta", num_layers=3), 4096, 1024)
    plans = [_plan("baseline", 10 * gib, 100.0 * gib, live=8 * gib),
             _plan("delta", 14 * gib, 140.0 * gib, live=12 * gib)]
    table = report.floors_table(plans, [None, floor], wide=True)
    hbm_floor = (10 * gib + floor.buffer_bytes) / gib
    backward_floor = hbm_floor + floor.cotangent_bytes / gib
    live_floor = (8 * gib + floor.buffer_bytes) / gib
    live_backward_floor = live_floor + floor.cotangent_bytes / gib
    bytes_floor = (100.0 * gib + floor.traffic_bytes) / gib
    (row,) = [line for line in table.splitlines() if line.startswith("delta")]
    assert "14.00 (1.40x)" in row and "140.0 (1.40x)" in row
    assert f"{hbm_floor:.2f}" == "11.86" and f"{backward_floor:.2f}" == "13.61"
    assert f"{hbm_floor:.2f} ({hbm_floor / 10:.2f}x)" in row
    assert f"{backward_floor:.2f} ({backward_floor / 10:.2f}x)" in row
    assert f"{bytes_floor:.1f} ({bytes_floor / 100:.2f}x)" in row
    # live at the peak, and the baseline's live peak plus the buffer, plus its cotangent too
    assert "12.00 (1.50x)" in row
    assert f"{live_floor:.2f}" == "9.86" and f"{live_backward_floor:.2f}" == "11.61"
    assert f"{live_floor:.2f} ({live_floor / 8:.2f}x)" in row
    assert f"{live_backward_floor:.2f} ({live_backward_floor / 8:.2f}x)" in row
    # By default the live counts are left to --wide
    (narrow,) = [line for line in report.floors_table(plans, [None, floor]).splitlines()
                 if line.startswith("delta")]
    assert narrow.split() == [word for word in row.split() if word not in (
        "12.00", "(1.50x)", f"{live_floor:.2f}", f"({live_floor / 8:.2f}x)",
        f"{live_backward_floor:.2f}", f"({live_backward_floor / 8:.2f}x)")]
    assert report.floors_table(plans[1:], [floor]) is None  # no baseline to add it to
    assert report.floors_table(plans[:1], [None]) is None  # no routing variant
