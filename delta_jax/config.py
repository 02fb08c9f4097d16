"""Model configuration: every Qwen3 field, the residual variant, and named presets.

Conventions: d hidden_size, L num_layers, H num_heads, KV num_kv_heads, hd head_dim (not always
d/H), I intermediate_size, V vocab_size.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

RESIDUALS = ("baseline", "block", "full", "delta", "delta_block")
BLOCK_SOURCES = ("reference", "paper")
ROUTER_INITS = ("normal", "zeros")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_dots", "save_sublayer_outputs")
LAYER_DRIVERS = ("lean", "scan", "unrolled")
GATE_BASES = ("live", "stream")
ATTENTION_KINDS = ("auto", "xla", "splash", "cudnn")

# Fields that change the function or the parameter shapes. The rest (dtypes, remat, layer_driver,
# unroll_layers, layer_loops, rebuild_states, attention) only change how the same function is
# computed; checkpoints may move between them.
RUNTIME_FIELDS = ("dtype", "param_dtype", "remat", "layer_driver", "unroll_layers",
                  "layer_loops", "rebuild_states", "attention")
# Runtime fields that were removed, with the one way the model now computes what they chose.
# Checkpoints and run configs written before still name them; being runtime fields, any value
# loads as the same function, so they are dropped (git history holds the code they chose).
RETIRED_FIELDS = {"routing_kernel": "xla", "routing_logits": "read", "peel_block_starts": False,
                  "hoist_block_writes": True}
# Fields renamed since, old name -> new: configs and checkpoints with the old name load as the new.
RENAMED_FIELDS = {"buffer_segments": "layer_loops"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 151936
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 3072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e4
    tie_word_embeddings: bool = True
    # Residual variant (docs/spec.md section 3).
    residual: str = "delta_block"
    num_blocks: int = 4
    block_sources: str = "reference"
    router_init: str = "normal"
    # Reference extras: a learned zero-initialised null source per site (delta modes), and a
    # learned scalar gate a per site, initialised to zero: the sublayer reads (1-a)*base + a*routed
    # (the reference's `attnres_gate_type: learnable_alpha`).
    null_source: bool = False
    routing_gate: bool = False
    # What the gate blends the routed input with. "live": the site's live state (the reference:
    # the residual stream in the delta modes, but the block partial sum or the last sublayer
    # output in block/full). "stream" (block/full only, a delta_jax extension): the standard
    # residual stream, carried alongside, and the final site is gated too; at a = 0 the model is
    # exactly the plain Qwen3, at a = 1 exactly AttnRes, which makes conversions exact.
    gate_base: str = "live"
    init_std: float = 0.02
    # Numerics and execution.
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of the parameters (master weights)
    remat: str = "none"
    layer_driver: str = "lean"
    # Write the lean and scan drivers' layer loops out layer by layer: the same program without
    # while loops, whose cost analysis then counts every layer (the planner's cost twin,
    # delta_jax/plan/compile.py). Compiles in time linear in the depth.
    unroll_layers: bool = False
    # The lean driver runs the layers as this many consecutive loops, each over only the buffer
    # slots its layers can touch (delta_jax/model/schedule.py: layer_loops): fewer slots read per
    # site, one more loop body to compile per loop. 1 = one loop over the whole buffer.
    layer_loops: int = 1
    # delta with the lean driver: keep only each layer loop's input state (layer_loops loops)
    # and rebuild each layer's input state from the buffer in the backward pass, as the
    # running sum of the sources written before it (delta_jax/model/decoder.py
    # DeltaStateRebuild): HBM for step time (BENCHMARKS.md, "Tried, not kept"). Off unless HBM
    # is short: the planner offers it to a delta run that does not fit (delta_jax/plan/knobs.py).
    rebuild_states: bool = False
    # Causal attention kernel for training and prefill (delta_jax/model/attention_kernels.py):
    # "auto" the platform's kernel where the inputs allow it (splash on TPU, cudnn on NVIDIA
    # GPUs, xla otherwise); "xla" anywhere; "splash" the Pallas TPU kernel (interpret mode
    # elsewhere: tests only, slow; T a multiple of 128); "cudnn" NVIDIA GPUs with dtype
    # bfloat16/float16. Decoding with a KV cache always takes the XLA masked path.
    attention: str = "auto"

    def __post_init__(self):
        def fail(field: str, allowed: str):
            raise ValueError(
                f"ModelConfig.{field}={getattr(self, field)!r} is invalid: expected {allowed}")

        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(field, "a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is invalid: expected a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        for field in ("num_blocks", "layer_loops"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(field, "an integer >= 1")
        for field, allowed in (("residual", RESIDUALS), ("block_sources", BLOCK_SOURCES),
                               ("router_init", ROUTER_INITS), ("dtype", DTYPES),
                               ("param_dtype", DTYPES), ("remat", REMAT_POLICIES),
                               ("layer_driver", LAYER_DRIVERS), ("gate_base", GATE_BASES),
                               ("attention", ATTENTION_KINDS)):
            if getattr(self, field) not in allowed:
                fail(field, "one of " + ", ".join(allowed))
        if self.attention == "cudnn" and self.dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"ModelConfig.attention='cudnn' is invalid with dtype={self.dtype!r}: cuDNN's "
                "fused attention takes only bfloat16 or float16; set dtype or use attention='xla'")
        for field in ("tie_word_embeddings", "null_source", "routing_gate", "unroll_layers",
                      "rebuild_states"):
            if not isinstance(getattr(self, field), bool):
                fail(field, "true or false")
        if not self.rms_norm_eps > 0:
            fail("rms_norm_eps", "a positive float")
        if not self.rope_theta > 0:
            fail("rope_theta", "a positive float")
        if not self.init_std >= 0:
            fail("init_std", "a float >= 0")
        if self.null_source and self.residual not in ("delta", "delta_block"):
            raise ValueError(
                f"ModelConfig.null_source=True is invalid with residual={self.residual!r}: "
                "the null source exists only in the additive modes delta and delta_block")
        if self.routing_gate and self.residual == "baseline":
            raise ValueError("ModelConfig.routing_gate=True is invalid with residual='baseline': "
                             "the baseline has no routing sites")
        if self.gate_base == "stream" and not (self.routing_gate
                                               and self.residual in ("block", "full")):
            raise ValueError(
                f"ModelConfig.gate_base='stream' is invalid with residual={self.residual!r}, "
                f"routing_gate={self.routing_gate}: it needs routing_gate=True and residual "
                "'block' or 'full' (in the delta modes the live state is the stream already)")

    # Derived geometry -----------------------------------------------------------------------
    @property
    def layers_per_block(self) -> int:
        return max(1, math.ceil(self.num_layers / self.num_blocks))

    @property
    def has_routing(self) -> bool:
        return self.residual != "baseline"

    @property
    def has_final_site(self) -> bool:
        return self.residual in ("block", "full")

    @property
    def carries_stream(self) -> bool:
        """block/full gated against the residual stream, which then travels in the carry."""
        return self.gate_base == "stream"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def architecture(self) -> dict[str, Any]:
        """The fields that define the function and the parameter shapes."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}

    # Presets (docs/spec.md section 5) -------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """The golden files' shape: fast enough for tests on two CPU cores."""
        base = dict(vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=64, num_blocks=2)
        return cls(**{**base, **overrides})

    @classmethod
    def paper_220m(cls, **overrides: Any) -> ModelConfig:
        return cls(**{**dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                             head_dim=64, intermediate_size=3072), **overrides})

    @classmethod
    def paper_533m(cls, **overrides: Any) -> ModelConfig:
        return cls(**{**dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8,
                             head_dim=64, intermediate_size=4096), **overrides})

    @classmethod
    def paper_1044m(cls, **overrides: Any) -> ModelConfig:
        return cls(**{**dict(hidden_size=1280, num_layers=36, num_heads=20, num_kv_heads=4,
                             head_dim=64, intermediate_size=5120), **overrides})

    @classmethod
    def qwen3_0_6b(cls, **overrides: Any) -> ModelConfig:
        return cls(**{**dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                             head_dim=128, intermediate_size=3072, rope_theta=1e6), **overrides})

    @classmethod
    def paper_8b(cls, **overrides: Any) -> ModelConfig:
        return cls(**{**dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                             head_dim=128, intermediate_size=12288), **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}")
        return getattr(cls, PRESETS[name])(**overrides)


PRESETS = {
    "tiny": "tiny",
    "220m": "paper_220m",
    "533m": "paper_533m",
    "1044m": "paper_1044m",
    "qwen3-0.6b": "qwen3_0_6b",
    "8b": "paper_8b",
}


def current_fields(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig `fields` as a checkpoint or run config at `where` wrote them, in today's
    names (RENAMED_FIELDS) and less the retired runtime fields (RETIRED_FIELDS). A retired one
    set to another way of running than the model's one way is reported: the run goes on
    computing the same function the one way."""
    for name, now in RETIRED_FIELDS.items():
        if name in fields and fields[name] != now:
            logger.warning("%s: model.%s=%r is retired; the model runs as %s=%r (the same "
                           "function)", where, name, fields[name], name, now)
    for old, new in RENAMED_FIELDS.items():
        if old in fields and new in fields:
            raise ValueError(f"{where}: model.{old} and model.{new} both set; {old} is the "
                             f"old name of {new}: keep {new} alone")
    return {RENAMED_FIELDS.get(k, k): v for k, v in fields.items() if k not in RETIRED_FIELDS}
