"""Build a model from Hugging Face tensors (torch layout) and back, through the key table."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax.config import ModelConfig
from delta_jax.hf.keymap import (ConversionError, KeyRule, active_rules, config_from_hf,
                                 expected_hf_keys, hf_names)
from delta_jax.model.causal_lm import CausalLM


def _get_path(tree, path: tuple[str, ...]):
    for part in path:
        tree = tree[part]
    return tree


def abstract_model(cfg: ModelConfig) -> CausalLM:
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def check_keys(cfg: ModelConfig, available, *, source: str) -> None:
    """Missing or unexpected tensors raise one clear error naming them."""
    expected = set(expected_hf_keys(cfg))
    available = set(available)
    if cfg.tie_word_embeddings:
        available.discard("lm_head.weight")  # tied checkpoints may still carry a copy
    missing = sorted(expected - available)
    unexpected = sorted(available - expected)
    if missing:
        raise ConversionError(f"{source}: missing tensor(s) {_names(missing)} for "
                              f"residual={cfg.residual!r}")
    if unexpected:
        raise ConversionError(f"{source}: unexpected tensor(s) {_names(unexpected)} for "
                              f"residual={cfg.residual!r} (does the config match the file?)")


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def converted_tensors(cfg: ModelConfig, read: Callable[[str], np.ndarray], *,
                      source: str) -> Iterator[tuple[KeyRule, np.ndarray]]:
    """Yield (rule, array in our layout, stacked over layers) reading one HF tensor at a time.

    `read(name)` returns a numpy array in torch layout; shapes are checked against the config.
    """
    model = abstract_model(cfg)
    state = nnx.state(model, nnx.Param)
    for rule in active_rules(cfg):
        target = _get_path(state, rule.ours)
        want_shape = tuple(target.shape[1:] if rule.per_layer else target.shape)
        parts = []
        for name in hf_names(rule, cfg):
            tensor = read(name)
            converted = None
            try:
                converted = rule.to_ours(np.asarray(tensor), cfg)
            except ValueError:
                pass
            if converted is None or converted.shape != want_shape:
                expected_hf = rule.to_hf(np.zeros(want_shape, np.float32), cfg).shape
                raise ConversionError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(expected_hf)} for this config")
            parts.append(converted)
        yield rule, (np.stack(parts) if rule.per_layer else parts[0])


def from_converted(cfg: ModelConfig, tensors: Iterator[tuple[KeyRule, np.ndarray]], *,
                   place: Callable[[np.ndarray, Any], jax.Array] | None = None) -> CausalLM:
    """Assemble a model from converted tensors. `place(array, abstract_variable)` puts each on
    its device/sharding (default: jnp.asarray in the config's param dtype)."""
    model = abstract_model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    dtype = jnp.dtype(cfg.param_dtype)
    place = place or (lambda array, variable: jnp.asarray(array, dtype))
    filled = set()
    for rule, array in tensors:
        variable = _get_path(params, rule.ours)
        variable.set_value(place(array, variable))
        filled.add(rule.ours)
    # Parameters the checkpoint does not hold (a conversion adding routing) get their init.
    missing = [rule for rule in active_rules(cfg) if rule.ours not in filled]
    if missing:
        fresh = nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        for rule in missing:
            variable = _get_path(params, rule.ours)
            variable.set_value(place(np.asarray(_get_path(fresh, rule.ours)[...]), variable))
    return nnx.merge(graphdef, params, rest)


def from_state_dict(hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                    **overrides: Any) -> CausalLM:
    """A Hugging Face config dict and tensors under HF names (torch layout) -> CausalLM."""
    cfg = config_from_hf(hf_config, **overrides)
    check_keys(cfg, state_dict.keys(), source="state_dict")
    _check_tied_copy(cfg, state_dict, source="state_dict")
    return from_converted(cfg, converted_tensors(cfg, lambda k: np.asarray(state_dict[k]),
                                                 source="state_dict"))


def _check_tied_copy(cfg: ModelConfig, state_dict, *, source: str) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" in state_dict:
        if not np.array_equal(np.asarray(state_dict["lm_head.weight"]),
                              np.asarray(state_dict["model.embed_tokens.weight"])):
            raise ConversionError(f"{source}: tie_word_embeddings=True but lm_head.weight "
                                  "differs from model.embed_tokens.weight")


def to_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
    """CausalLM -> {HF name: numpy array in torch layout, the param dtype}."""
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    out = {}
    for rule in active_rules(cfg):
        array = np.asarray(jax.device_get(_get_path(state, rule.ours)[...]))
        names = hf_names(rule, cfg)
        parts = array if rule.per_layer else [array]
        for name, part in zip(names, parts):
            out[name] = np.ascontiguousarray(rule.to_hf(part, cfg))
    return out
