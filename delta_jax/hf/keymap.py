"""Hugging Face <-> delta_jax: the config mapping and the parameter key table.

Conversion is data: `KEY_TABLE` lists, for every parameter, its Hugging Face name (torch layout,
`{i}` for the layer), its path in the model's nnx.State, and the layout change between the two.
Per-layer tensors are stacked on a leading layer axis on our side. The reference implementation's
`qwen3_attnres` checkpoints add the routing keys (*_res_proj, *_res_norm, *_null_source,
*_res_alpha and model.final_res_*).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from delta_jax.config import ModelConfig

QWEN3 = "qwen3"
ATTNRES = "qwen3_attnres"
# attnres_gate_type -> gate_base. "bias" (no gate) and "learnable_alpha" are the reference's;
# "learnable_alpha_stream" is delta_jax's block/full gate against the residual stream, which the
# reference code does not implement (it would run such a folder without its gates).
GATE_TYPES = {"bias": "live", "learnable_alpha": "live", "learnable_alpha_stream": "stream"}


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the key or file."""


# Layout changes: torch [out, in] linears <-> our [in, heads, head_dim] / [in, out] kernels.
def _identity(x, cfg):
    return x


def _t(x, tile: int = 64):
    """x.T. A 2-D numpy array gets a C-contiguous copy made tile by tile: about 4x faster than
    numpy's copy of the strided view, and converting checkpoints is mostly transposing."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        return x.T
    rows, cols = x.shape
    out = np.empty((cols, rows), x.dtype)
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j:j + tile, i:i + tile] = x[i:i + tile, j:j + tile].T
    return out


def _transpose(x, cfg):
    return _t(x)


def _heads_in(n_heads: Callable[[ModelConfig], int]):
    def to_ours(x, cfg):  # [N*hd, D] -> [D, N, hd]
        return _t(x).reshape(cfg.hidden_size, n_heads(cfg), cfg.head_dim)

    def to_hf(x, cfg):
        return _t(x.reshape(cfg.hidden_size, -1))
    return to_ours, to_hf


def _heads_out(x, cfg):  # [D, H*hd] -> [H, hd, D]
    return _t(x).reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _heads_out_hf(x, cfg):
    return _t(x.reshape(-1, cfg.hidden_size))


def _query_ours(x, cfg):  # nn.Linear(D, 1).weight [1, D] -> [D]
    return x.reshape(-1)


def _query_hf(x, cfg):
    return x.reshape(1, -1)


_Q = _heads_in(lambda c: c.num_heads)
_KV = _heads_in(lambda c: c.num_kv_heads)


@dataclasses.dataclass(frozen=True)
class KeyRule:
    hf: str  # Hugging Face name; '{i}' marks a per-layer tensor
    ours: tuple[str, ...]  # path in nnx.state(model)
    to_ours: Callable = _identity
    to_hf: Callable = _identity
    when: Callable[[ModelConfig], bool] = lambda cfg: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _routing(prefix: str, site: str) -> list[KeyRule]:
    """The routing keys of one site; prefix 'model.layers.{i}.' or 'model.'."""
    layers = ("layers",) if "{i}" in prefix else ()
    routed = lambda cfg: cfg.has_routing
    return [
        KeyRule(f"{prefix}{site}_res_proj.weight", (*layers, f"{site}_site", "query"),
                _query_ours, _query_hf, routed),
        KeyRule(f"{prefix}{site}_res_norm.weight", (*layers, f"{site}_site", "norm"),
                when=routed),
        KeyRule(f"{prefix}{site}_null_source", (*layers, f"{site}_site", "null"),
                when=lambda cfg: cfg.null_source),
        KeyRule(f"{prefix}{site}_res_alpha", (*layers, f"{site}_site", "gate"),
                when=lambda cfg: cfg.routing_gate),
    ]


_LAYER = "model.layers.{i}."
_FINAL_QUERY, _FINAL_NORM, _, _FINAL_GATE = _routing("model.", "final")  # it has no null source
KEY_TABLE: list[KeyRule] = [
    KeyRule("model.embed_tokens.weight", ("embed_tokens",)),
    KeyRule("model.norm.weight", ("norm", "scale")),
    KeyRule("lm_head.weight", ("lm_head",), _transpose, _transpose,
            lambda cfg: not cfg.tie_word_embeddings),
    KeyRule(_LAYER + "input_layernorm.weight", ("layers", "input_layernorm", "scale")),
    KeyRule(_LAYER + "post_attention_layernorm.weight",
            ("layers", "post_attention_layernorm", "scale")),
    KeyRule(_LAYER + "self_attn.q_proj.weight", ("layers", "self_attn", "q_proj"), *_Q),
    KeyRule(_LAYER + "self_attn.k_proj.weight", ("layers", "self_attn", "k_proj"), *_KV),
    KeyRule(_LAYER + "self_attn.v_proj.weight", ("layers", "self_attn", "v_proj"), *_KV),
    KeyRule(_LAYER + "self_attn.o_proj.weight", ("layers", "self_attn", "o_proj"),
            _heads_out, _heads_out_hf),
    KeyRule(_LAYER + "self_attn.q_norm.weight", ("layers", "self_attn", "q_norm", "scale")),
    KeyRule(_LAYER + "self_attn.k_norm.weight", ("layers", "self_attn", "k_norm", "scale")),
    KeyRule(_LAYER + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), _transpose,
            _transpose),
    KeyRule(_LAYER + "mlp.up_proj.weight", ("layers", "mlp", "up_proj"), _transpose, _transpose),
    KeyRule(_LAYER + "mlp.down_proj.weight", ("layers", "mlp", "down_proj"), _transpose,
            _transpose),
    *_routing(_LAYER, "attn"),
    *_routing(_LAYER, "mlp"),
    *[dataclasses.replace(rule, when=lambda cfg: cfg.has_final_site)
      for rule in (_FINAL_QUERY, _FINAL_NORM)],
    # delta_jax's stream-gated block/full also gate the final site (model.final_res_alpha).
    dataclasses.replace(_FINAL_GATE, when=lambda cfg: cfg.carries_stream),
]


def active_rules(cfg: ModelConfig) -> list[KeyRule]:
    return [rule for rule in KEY_TABLE if rule.when(cfg)]


def hf_names(rule: KeyRule, cfg: ModelConfig) -> list[str]:
    if rule.per_layer:
        return [rule.hf.format(i=i) for i in range(cfg.num_layers)]
    return [rule.hf]


def expected_hf_keys(cfg: ModelConfig) -> list[str]:
    return [name for rule in active_rules(cfg) for name in hf_names(rule, cfg)]


# Config mapping ------------------------------------------------------------------------------
_HF_FIELDS = {  # ours: Hugging Face
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
}


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A config.json dict (model_type qwen3 or qwen3_attnres) -> ModelConfig (+ overrides)."""
    model_type = hf.get("model_type")
    if model_type not in (QWEN3, ATTNRES):
        raise ConversionError(f"config.json: model_type={model_type!r} is not supported: "
                              f"expected {QWEN3!r} or {ATTNRES!r}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in hf]
    if missing:
        raise ConversionError(f"config.json: missing required field(s) {', '.join(missing)}")
    fields = {ours: hf[theirs] for ours, theirs in _HF_FIELDS.items() if theirs in hf}
    fields.setdefault("num_kv_heads", hf["num_attention_heads"])
    fields["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    fields["rope_theta"] = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ConversionError("config.json: RoPE scaling is not supported (rope_type "
                              f"{rope.get('rope_type') or hf.get('rope_scaling')!r})")
    if "initializer_range" in hf:
        fields["init_std"] = float(hf["initializer_range"])
    # transformers' Qwen3Config defaults to untied: a config.json without the field is untied.
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if model_type == ATTNRES:
        mode = hf.get("attnres_mode", "block")
        gate = hf.get("attnres_gate_type", "bias")
        if gate not in GATE_TYPES:
            raise ConversionError(f"config.json: attnres_gate_type={gate!r} is not supported: "
                                  f"expected one of {', '.join(map(repr, GATE_TYPES))}")
        fields.update(residual=mode, num_blocks=int(hf.get("attnres_num_blocks", 8)),
                      null_source=bool(hf.get("attnres_use_null_source", False)),
                      routing_gate=gate != "bias", gate_base=GATE_TYPES[gate],
                      block_sources=hf.get("attnres_block_sources", "reference"))
    else:
        fields["residual"] = "baseline"
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json: {err}") from None


def gate_type(cfg: ModelConfig) -> str:
    """The config.json `attnres_gate_type` of a routing config."""
    if not cfg.routing_gate:
        return "bias"
    return "learnable_alpha_stream" if cfg.carries_stream else "learnable_alpha"


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> config.json dict that transformers (baseline) or the reference loads."""
    out = {theirs: getattr(cfg, ours) for ours, theirs in _HF_FIELDS.items()}
    out.update(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, hidden_act="silu",
               initializer_range=cfg.init_std, attention_bias=False, attention_dropout=0.0,
               max_position_embeddings=40960, dtype=cfg.param_dtype,
               use_sliding_window=False, bos_token_id=151643, eos_token_id=151645,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.residual == "baseline":
        out.update(model_type=QWEN3, architectures=["Qwen3ForCausalLM"])
    else:
        out.update(model_type=ATTNRES, architectures=["Qwen3AttnResForCausalLM"],
                   attnres_mode=cfg.residual, attnres_num_blocks=cfg.num_blocks,
                   attnres_use_null_source=cfg.null_source,
                   attnres_gate_type=gate_type(cfg))
        if cfg.block_sources != "reference":
            out["attnres_block_sources"] = cfg.block_sources
    return out


def hf_shape(rule: KeyRule, cfg: ModelConfig, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of one tensor (one layer's slice for per-layer rules), computed
    from our shape without allocating it."""
    out = jax.eval_shape(lambda x: rule.to_hf(x, cfg), jax.ShapeDtypeStruct(our_shape, np.float32))
    return tuple(out.shape)
