"""Build a model from Hugging Face tensors (torch layout) and back, through the key table.

Conventions: L layers. "HF layout": one torch-layout tensor per Hugging Face name (per layer);
"our layout": the nnx.State, per-layer tensors stacked on a leading L axis. Tensors are read and
converted one key-table rule at a time, so the host holds one stacked parameter beyond the model;
they are written out one Hugging Face tensor at a time.
A *conversion* turns a plain Qwen3 checkpoint into a routing variant: the backbone comes from the
checkpoint and only the routing parameters it lacks are initialised (`plan_conversion`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from delta_jax.config import ModelConfig
from delta_jax.hf.keymap import (
    ATTNRES,
    ConversionError,
    KeyRule,
    active_rules,
    config_from_hf,
    expected_hf_keys,
    hf_names,
    hf_shape,
)
from delta_jax.model.causal_lm import CausalLM, abstract_model
from delta_jax.model.routing import RoutingSite
from delta_jax.sharding import placement, state_shardings

logger = logging.getLogger(__name__)

# The fields that define a checkpoint's routing; a qwen3_attnres checkpoint fixes them.
ROUTING_FIELDS = ("residual", "num_blocks", "block_sources", "null_source", "routing_gate",
                  "gate_base")


def _get_path(tree, path: tuple[str, ...]):
    for part in path:
        tree = tree[part]
    return tree


def plan_conversion(hf_config: Mapping[str, Any], *, source: str, preserve_function: bool = False,
                    **overrides: Any) -> tuple[ModelConfig, ModelConfig]:
    """config.json dict + overrides -> (target config, config of what the checkpoint holds).

    A plain Qwen3 checkpoint becomes any variant through overrides (residual, num_blocks,
    block_sources, router_init, null_source, routing_gate, gate_base); the routing parameters it
    lacks are initialised. A qwen3_attnres checkpoint keeps the routing it was trained with.

    preserve_function=True picks the initialisation under which the converted model computes the
    plain Qwen3's function exactly (bit for bit) at step 0: every pseudo-query starts at zero
    (router_init='zeros'), so each site starts from uniform weights, and every site gets a
    learned gate a starting at zero (routing_gate=True), its input being (1-a)*base + a*routed:
    - delta, delta_block: base = h, routed = h + mix (the reference's 'learnable_alpha'). Zero
      queries alone keep delta only up to the eps of the sublayer's RMSNorm and change
      delta_block outright (its sources omit the current block, docs/spec.md section 4).
    - block, full: base = the plain residual stream (gate_base='stream'), which then travels in
      the carry, and the final site is gated too. The reference's gate blends with the live
      state (the partial block sum, the last sublayer output), which is not the Qwen3 stream,
      and zero queries alone leave the eps error: the uniform mix is h/N, and RMSNorm(h/N)
      differs from RMSNorm(h) by about (N^2-1)*eps / (2*mean(h^2)) relative.
    A pretrained Qwen3 keeps its outputs at step 0; the gates then the queries learn from the
    first step on (at a = 1 a site is exactly the paper's routing).
    """
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ConversionError(f"unknown override(s) {', '.join(unknown)}: expected ModelConfig "
                              "fields (residual, num_blocks, router_init, param_dtype, ...)")
    is_attnres = hf_config.get("model_type") == ATTNRES
    if is_attnres:
        trained = config_from_hf(hf_config)
        if preserve_function:
            raise ConversionError(f"{source}: preserve_function applies to converting a plain "
                                  "Qwen3 checkpoint; this one is already qwen3_attnres")
        for field in ROUTING_FIELDS:
            if field in overrides and overrides[field] != getattr(trained, field):
                raise ConversionError(
                    f"{source}: override {field}={overrides[field]!r} contradicts the "
                    f"qwen3_attnres checkpoint ({field}={getattr(trained, field)!r}); a trained "
                    "routing cannot be changed: convert from a plain Qwen3 instead")
    elif preserve_function and overrides.get("residual", "baseline") != "baseline":
        overrides = _preserving(overrides, source=source)
    cfg = config_from_hf(hf_config, **overrides)
    if is_attnres:
        return cfg, cfg
    return cfg, cfg.replace(residual="baseline", null_source=False, routing_gate=False,
                            gate_base="live")


def _preserving(overrides: dict[str, Any], *, source: str) -> dict[str, Any]:
    residual = overrides["residual"]
    wanted = {"router_init": "zeros", "routing_gate": True,
              "gate_base": "stream" if residual in ("block", "full") else "live"}
    for field, value in wanted.items():
        if field in overrides and overrides[field] != value:
            raise ConversionError(f"{source}: preserve_function with residual={residual!r} needs "
                                  f"{field}={value!r}, got {field}={overrides[field]!r}")
    return {**overrides, **wanted}


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


def _check_tied_copy(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], *, source: str) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ConversionError(f"{source}: tie_word_embeddings=True but lm_head.weight "
                                  "differs from model.embed_tokens.weight")


def converted_tensors(cfg: ModelConfig, read: Callable[[str], np.ndarray], *,
                      source: str) -> Iterator[tuple[KeyRule, np.ndarray]]:
    """Yield (rule, array in our layout and cfg.param_dtype, stacked over layers).

    `read(name)` returns one tensor in HF layout; shapes are checked against the config. A rule's
    layers are written into one preallocated stack, so the host holds that stack plus one layer.
    """
    state = nnx.state(abstract_model(cfg), nnx.Param)
    dtype = jnp.dtype(cfg.param_dtype)
    for rule in active_rules(cfg):
        target = _get_path(state, rule.ours)
        want = tuple(target.shape[1:] if rule.per_layer else target.shape)
        out = np.empty(target.shape, dtype)
        for index, name in enumerate(hf_names(rule, cfg)):
            tensor = read(name)
            try:
                converted = rule.to_ours(tensor, cfg)
            except ValueError:
                converted = None
            if converted is None or converted.shape != want:
                raise ConversionError(f"{source}: tensor {name} has shape {list(tensor.shape)}, "
                                      f"expected {list(hf_shape(rule, cfg, want))} for this config")
            out[index if rule.per_layer else ...] = converted
        yield rule, out


def _fresh_routing(cfg: ModelConfig, seed: int) -> dict[tuple[str, ...], np.ndarray]:
    """Initial values of the routing parameters alone (the backbone is never built)."""
    rngs = nnx.Rngs(params=seed)
    sites = {("layers", "attn_site"): RoutingSite(cfg, rngs, stack=cfg.num_layers),
             ("layers", "mlp_site"): RoutingSite(cfg, rngs, stack=cfg.num_layers)}
    if cfg.has_final_site:
        sites[("final_site",)] = RoutingSite(cfg, rngs)
    return {prefix + tuple(path): np.asarray(variable.get_value())
            for prefix, site in sites.items()
            for path, variable in nnx.state(site, nnx.Param).flat_state()}


def from_converted(cfg: ModelConfig, tensors: Iterator[tuple[KeyRule, np.ndarray]], *,
                   mesh: Mesh | None = None, initialise_routing: bool = False,
                   seed: int = 0) -> CausalLM:
    """Assemble a model from converted tensors, each placed as it arrives (on its sharding of
    `mesh` if given, else on the default device).

    initialise_routing: routing parameters the tensors do not cover get their initial values
    (a conversion); otherwise an uncovered parameter is an error.
    """
    graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    shardings = state_shardings(params, mesh) if mesh is not None else None

    def place(path: tuple[str, ...], array: np.ndarray) -> None:
        if shardings is None:
            value = jax.device_put(array)
        else:  # each device (or process) takes its own slice of the host array
            value = jax.make_array_from_callback(array.shape, _get_path(shardings, path),
                                                 lambda index: array[index])
        # Transfers are asynchronous and hold the host array until done: wait, or a fast reader
        # on a busy host keeps several stacked tensors alive at once (peak memory then depends
        # on timing, not on the model).
        value.block_until_ready()
        _get_path(params, path).set_value(value)

    for rule, array in tensors:
        place(rule.ours, array)
    uncovered = [tuple(path) for path, variable in params.flat_state()
                 if isinstance(variable.get_value(), jax.ShapeDtypeStruct)]
    if uncovered:
        fresh = _fresh_routing(cfg, seed) if initialise_routing else {}
        for path in uncovered:
            if path not in fresh:
                raise ConversionError(f"parameter {'.'.join(path)} of residual={cfg.residual!r} "
                                      "has no Hugging Face tensor to load it from")
            place(path, fresh[path])
    if mesh is not None:
        logger.info("%s", placement(params, mesh))
    return nnx.merge(graphdef, params, rest)


def build_model(hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, source: str,
                mesh: Mesh | None = None, **overrides: Any) -> CausalLM:
    """A config.json dict and a mapping {HF name: tensor in HF layout} (possibly lazy: each
    tensor is looked up once, in key-table order) -> CausalLM. `overrides` as plan_conversion."""
    cfg, held = plan_conversion(hf_config, source=source, **overrides)
    check_keys(held, tensors.keys(), source=source)
    _check_tied_copy(held, tensors, source=source)
    return from_converted(cfg, converted_tensors(held, tensors.__getitem__, source=source),
                          mesh=mesh, initialise_routing=held != cfg)


def from_state_dict(hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                    **overrides: Any) -> CausalLM:
    """A Hugging Face config dict and tensors under HF names (torch layout) -> CausalLM."""
    return build_model(hf_config, {k: np.asarray(v) for k, v in state_dict.items()},
                       source="state_dict", **overrides)


@jax.jit
def _layer(stack: jax.Array, index) -> jax.Array:
    """stack [L, ...] -> layer `index` [...], laid out like the stack's other dimensions."""
    return jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)


def _to_host(array: jax.Array) -> np.ndarray:
    """The whole of `array` on this host. An array spread over several processes is gathered,
    a collective: every process calls this for the same arrays in the same order."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return multihost_utils.process_allgather(array, tiled=True)


def iter_hf_tensors(model: CausalLM, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor in HF layout) one at a time in key-table order, cast to `dtype`
    (default: the param dtype). The host holds one Hugging Face tensor (one layer of a stacked
    parameter) at a time. For a model sharded over several processes every process must draw
    the whole stream in step (each tensor is gathered from all of them) and receives it."""
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    for rule in active_rules(cfg):
        value = _get_path(state, rule.ours)[...]
        names = hf_names(rule, cfg)
        for index, name in enumerate(names):
            part = _to_host(_layer(value, np.int32(index)) if rule.per_layer else value)
            yield name, np.array(rule.to_hf(part, cfg), dtype=dtype or part.dtype, order="C")


def to_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
    """CausalLM -> {HF name: numpy array in torch layout, the param dtype}."""
    return dict(iter_hf_tensors(model))
