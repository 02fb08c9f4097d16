"""The flops of the attention kernels that XLA's cost analysis cannot see.

Both kernels are custom calls in the compiled program, and the analysis counts a custom call as
next to no work: cuDNN's fused attention on GPU (`__cudnn$fmha...`) and splash's Mosaic calls on
TPU (`splash_mha_fwd...`, `splash_mha_dq...`, `splash_mha_dkv...`). The planner counts their
calls in the optimized HLO, so that a remat policy's recomputed forward counts too, and adds
each call's matmuls by formula.

A causal attention's [T,T] matmul is T^2/2 * hd multiply-adds a head at most: 2 flops times
half the square. `rows` sequences of `seq_len` with `heads` query heads of `head_dim` are what
one device computes (attention_heads_per_device).
"""
from __future__ import annotations

import re

# cuDNN: a forward call, and a backward one that recomputes the scores from the saved softmax
# statistics.
_CUDNN_CALL = re.compile(r'custom_call_target="__cudnn\$fmha[A-Za-z]*?(Backward)?"')
# splash: one instruction per call, named for its kernel; its operands elsewhere in the text
# repeat the name, so only definitions ("%name.N = ") count.
_SPLASH_CALL = re.compile(r"%splash_m[hq]a_(fwd|dq|dkv)[\w.]* = ")
# The [T,T] matmuls of each splash kernel: forward QK^T and PV; dq recomputes QK^T, then dP and
# dQ; dkv recomputes QK^T, then dP, dV and dK.
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def attention_heads_per_device(num_heads: int, tensor: int) -> int:
    """Query heads one device attends over: split over the tensor axis where it divides them,
    else whole (sharding.logical_to_spec's rule)."""
    return num_heads // tensor if num_heads % tensor == 0 else num_heads


def cudnn_attention_flops(hlo_text: str, rows: int, seq_len: int, heads: int,
                          head_dim: int) -> float:
    """The flops of the cuDNN attention calls in `hlo_text`: the forward pass does two [T,T]
    matmuls (scores, values), the backward five (the scores again, and the gradients of the
    values, the probabilities, the queries and the keys)."""
    matmul = rows * heads * seq_len * seq_len * head_dim  # 2 flops x half the [T,T] entries
    calls = _CUDNN_CALL.findall(hlo_text)
    backward = sum(1 for is_backward in calls if is_backward)
    return float(matmul * (2 * (len(calls) - backward) + 5 * backward))


def splash_attention_flops(hlo_text: str, rows: int, seq_len: int, heads: int, head_dim: int,
                           block: int) -> float:
    """The flops of the splash calls in `hlo_text`. Splash skips the kv blocks wholly above the
    diagonal, so a matmul covers (1 + block/T) / 2 of the square, not half of it."""
    square = 2 * rows * heads * seq_len * seq_len * head_dim
    matmuls = sum(_SPLASH_MATMULS[kind] for kind in _SPLASH_CALL.findall(hlo_text))
    return matmuls * square * (1 + block / seq_len) / 2


def attention_kernel_in(hlo_text: str) -> str:
    """Which attention the compiled program runs: "splash", "cudnn" or "xla" (no kernel call),
    what model.attention=auto resolved to when the step was traced."""
    if _SPLASH_CALL.search(hlo_text):
        return "splash"
    return "cudnn" if _CUDNN_CALL.search(hlo_text) else "xla"
