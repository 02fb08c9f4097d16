"""What routing cannot avoid, counted from the schedule without compiling: the source buffer a
device holds, and the HBM traffic of the sites reading it.

A routing site reads every buffer slot it sees (docs/spec.md section 2): the softmax needs each
slot's logit, the mix each slot's value. However it is fused, a step of the lean driver then
passes over each (site, visible slot) pair at least

- once in the forward pass (logits and mix in one read),
- once more when the backward pass recomputes the layer (the driver keeps no per-site output),
- once in the backward pass (the logits' gradient needs each slot's product with the mix's
  cotangent),
- and reads and writes that slot's cotangent once (the site's share of it is added in place),

five [B,T,D] passes with the lean driver, four with the others (which keep the layer's
activations instead of recomputing them). Every slot is also written once and its cotangent
read once.

The HBM floor is one buffer on top of the baseline's: the buffer is live from the forward pass
to the end of the backward pass, so also wherever the baseline's step peaks. Its cotangent, a
second [S,B,T,D] array, is live only while the backward pass runs through the layers, all S
slots of it in the last layers (whose sites see every slot; each slot's cotangent waits for the
backward pass to reach the layer that wrote it). It adds to the floor only where the step
peaks there, which cannot be counted without compiling, so the planner prints both floors.
Which one holds is read from the compiler's live ranges (BENCHMARKS.md):

- with whole logits the steps peaked in the head: delta's bytes live at the peak on v5p were
  one buffer above the baseline's at 1044M and 220M;
- with the loss in vocabulary chunks, as the configs run, the baseline and delta_block at
  220M both peak in the layers' backward pass, at the attention's temporaries, which every
  layer's backward holds alike: delta_block's bytes live there are its buffer and its
  cotangent above the baseline's (and 0.06 GiB more), so at 220M the second floor holds;
- at 1044M delta's bytes live at the peak are 5.57 GiB above the baseline's, about the buffer
  and its cotangent (2 x 2.86 GiB), while delta_block's are 0.03 GiB above the baseline's.

These are floors for the lean driver's O(S) memory with each site's share of the cotangent
added as the backward pass reaches it, for any form that keeps every source in HBM and reads it
at every site that sees it, kernels included. Trading HBM lowers the traffic: keeping each
site's mix (one more [S,B,T,D] array, live from the forward pass on, so it adds to the HBM floor)
saves the recompute's pass; gathering each source's cotangent from the later sites' mix
cotangents (kept, one more array) replaces the three backward passes with one (BENCHMARKS.md,
"Routing against its floor").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from delta_jax.config import ModelConfig
from delta_jax.model.layers import dtype_of
from delta_jax.model.schedule import Schedule, schedule

# Slot-sized passes per (site, visible slot) pair; see the module docstring.
LEAN_PASSES = 5
SAVING_PASSES = 4


@dataclasses.dataclass(frozen=True)
class RoutingFloor:
    """Per device and per step (all microbatches). slot_reads: the (site, visible slot) pairs
    of one forward pass, the final site's included."""
    num_slots: int
    slot_bytes: int  # one source [B,T,D] of one microbatch on one device
    buffer_bytes: int  # the values [S,B,T,D] and their inverse RMS [S,B,T] float32
    cotangent_bytes: int  # the values' cotangent [S,B,T,D], live in the layers' backward pass
    slot_reads: int
    passes: int
    traffic_bytes: int  # passes * slot_reads + the slots' writes and their cotangents' reads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def visible_slot_reads(cfg: ModelConfig, plan: Schedule | None = None) -> int:
    """(site, buffer slot) pairs a forward pass reads: each layer's attention site sees
    attn_visible slots, its MLP site the slots before its layer's first write (a source the
    layer itself writes reaches that site directly, not from the buffer), the final site
    final_visible. `plan`: cfg's schedule, when the caller has it."""
    plan = schedule(cfg) if plan is None else plan
    if plan.num_slots == 0:
        return 0
    return int(np.sum(plan.attn_visible) + np.sum(plan.first_write) + plan.final_visible)


def routing_floor(cfg: ModelConfig, rows_per_device: int, seq_len: int,
                  grad_accum: int = 1) -> RoutingFloor | None:
    """The floor of `cfg`'s routing on a device that holds `rows_per_device` sequences of a
    microbatch; None for the baseline (no buffer)."""
    plan = schedule(cfg)
    num_slots = plan.num_slots
    if num_slots == 0:
        return None
    tokens = rows_per_device * seq_len
    slot_bytes = tokens * cfg.hidden_size * np.dtype(dtype_of(cfg.dtype)).itemsize
    passes = LEAN_PASSES if cfg.layer_driver == "lean" else SAVING_PASSES
    reads = visible_slot_reads(cfg, plan)
    per_microbatch = (passes * reads + 2 * num_slots) * slot_bytes
    return RoutingFloor(num_slots=num_slots, slot_bytes=slot_bytes,
                        buffer_bytes=num_slots * (slot_bytes + tokens * 4),
                        cotangent_bytes=num_slots * slot_bytes, slot_reads=reads,
                        passes=passes, traffic_bytes=grad_accum * per_microbatch)


def floor_for_plan(cfg: ModelConfig, batch_size: int, seq_len: int, grad_accum: int,
                   mesh: dict) -> RoutingFloor | None:
    """routing_floor for a planned run: its microbatch split over mesh data x fsdp (the batch
    axes; the sequence and the hidden size are not sharded, delta_jax.sharding)."""
    shards = math.prod(mesh[axis] for axis in ("data", "fsdp"))
    return routing_floor(cfg, batch_size // grad_accum // shards, seq_len, grad_accum)
