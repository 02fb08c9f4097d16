"""The routing site: a learned softmax over earlier sublayer outputs (docs/spec.md section 2),
and `Routing`, the report of every site's weights.

Conventions: S buffer slots, N = sources a site sees, B batch, T sequence, D hidden, L layers.
Sources live in a `SourceBuffer` (values [S,B,T,D], float32 inverse RMS [S,B,T]) written once per
source, so a site's logits are r_n * ((w*g) . s_n): the normalised sources are never
materialised. A site can also see a per-site learned null source [D] (prepended, delta modes)
and a `live` source [B,T,D] that is not in the buffer (the current partial sum of the
replacement modes, appended). Padded weight layout of a site: [null?] + S slots + [live?].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from delta_jax.model.layers import inverse_rms, make_param
from delta_jax.model.protocol import SourceBuffer, Write


class RoutingSite(nnx.Module):
    """Pseudo-query w [D], its RMSNorm scale g [D], optional null source [D] and gate []."""

    def __init__(self, cfg, rngs: nnx.Rngs, *, stack: int | None = None, gated: bool = True):
        d = cfg.hidden_size
        pd = jnp.dtype(cfg.param_dtype)
        self.eps = cfg.rms_norm_eps
        self.query = make_param(rngs, (d,), ("routing",), init=cfg.router_init,
                                std=cfg.init_std, dtype=pd, stack=stack)
        self.norm = make_param(None, (d,), ("routing",), init="ones", std=0.0, dtype=pd,
                               stack=stack)
        self.null = (make_param(None, (d,), ("routing",), init="zeros", std=0.0, dtype=pd,
                                stack=stack) if cfg.null_source else None)
        # The reference's `learnable_alpha` gate: input = (1-a)*base + a*routed, a starts at 0.
        # The final site has one only when gated against the residual stream (gate_base).
        self.gate = (make_param(None, (), (), init="zeros", std=0.0, dtype=pd, stack=stack)
                     if cfg.routing_gate and gated else None)

    def __call__(self, sources: SourceBuffer, num_valid, *, fresh: Write | None = None,
                 live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Route over buffer slots [0, num_valid), a source `fresh`ly written by this layer
        (slot num_valid, not yet in the read-only buffer), and the null and live sources.

        num_valid int (static or traced); live [B,T,D] or None -> mix [B,T,D] in the buffer's
        dtype, weights [N_pad,B,T] float32 in the padded layout (zero on unused slots; all
        zero, and mix zero, with no source). Slots at or past num_valid may hold later sources
        (the lean backward pass reads the final buffer): they are masked out of the softmax and
        get no gradient.
        """
        buffer, inv_rms = sources.values, sources.inv_rms
        num_slots, batch_shape = buffer.shape[0], buffer.shape[1:3]
        if num_slots == 1 and fresh is None and live is None and self.null is None:
            return self._one_slot(buffer, num_valid)
        wg = self.query_direction()
        logits = [inv_rms * jnp.einsum("sbtd,d->sbt", buffer, wg.astype(buffer.dtype),
                                       preferred_element_type=jnp.float32)]
        valid = [jnp.arange(num_slots) < num_valid]
        if self.null is not None:
            null = self.null[...].astype(jnp.float32)
            null_logit = jnp.dot(null, wg) * jax.lax.rsqrt(jnp.mean(null * null) + self.eps)
            logits.insert(0, jnp.broadcast_to(null_logit, (1, *batch_shape)))
            valid.insert(0, jnp.ones((1,), bool))
        # The sources outside the buffer, in padded order: (value [B,T,D], logit [B,T], present)
        outside = []
        if fresh is not None:
            outside.append((fresh.value, self._logit(fresh.value, fresh.inv_rms, wg),
                            True if fresh.when is None else fresh.when))
        if live is not None:
            outside.append((live, self._logit(live, inverse_rms(live, self.eps), wg), True))
        for _, logit, present in outside:
            logits.append(logit[None])
            valid.append(jnp.full((1,), present, bool))
        weights = masked_softmax(jnp.concatenate(logits), jnp.concatenate(valid))

        null_weight, weights = ((weights[0], weights[1:]) if self.null is not None
                                else (None, weights))
        slot_weights, outside_weights = weights[:num_slots], weights[num_slots:]
        outside_terms = tuple((weight, value) for (value, _, _), weight
                              in zip(outside, outside_weights))
        if null_weight is None:  # with a backward pass of its own
            mix = weighted_sum(slot_weights.astype(buffer.dtype), buffer, outside_terms)
        else:
            mix = jnp.einsum("sbt,sbtd->btd", slot_weights.astype(buffer.dtype), buffer,
                             preferred_element_type=jnp.float32)
            mix = _add_weighted(mix + null_weight[..., None] * null, outside_terms)
        if fresh is not None:  # report the fresh source at the slot it is being written to
            slot_weights = (slot_weights
                            + jax.nn.one_hot(num_valid, num_slots)[:, None, None]
                            * outside_weights[0])
        padded = [] if null_weight is None else [null_weight[None]]
        padded.append(slot_weights)
        if live is not None:
            padded.append(outside_weights[-1:])
        return mix.astype(buffer.dtype), jnp.concatenate(padded)

    @staticmethod
    def _one_slot(buffer: jax.Array, num_valid) -> tuple[jax.Array, jax.Array]:
        """A site whose only possible source is the buffer's one slot (a lean loop over the
        first slot, as delta_block's first block runs): the softmax over one source is exactly
        1, so the mix is the slot itself, or zero where the site sees no slot, and the query
        gets no gradient from it, as through the softmax (p * (g - p * g) = 0). Forming the
        logit and the sum would read the slot twice more in each pass."""
        seen = jnp.asarray(num_valid) > 0
        weights = jnp.broadcast_to(seen.astype(jnp.float32), buffer.shape[:3])
        return jnp.where(seen, buffer[0], jnp.zeros_like(buffer[0])), weights

    def query_direction(self) -> jax.Array:
        """w*g [D] float32: the query folded into the sources' RMSNorm weight, so a source's
        logit is inv_rms * (w*g . s)."""
        return self.query[...].astype(jnp.float32) * self.norm[...].astype(jnp.float32)

    @staticmethod
    def _logit(value: jax.Array, inv_rms: jax.Array, wg: jax.Array) -> jax.Array:
        """One source's logit r * ((w*g) . s): value [B,T,D], inv_rms [B,T] -> [B,T] float32."""
        return inv_rms * jnp.einsum("btd,d->bt", value, wg.astype(value.dtype),
                                    preferred_element_type=jnp.float32)

    def gated(self, base: jax.Array, routed: jax.Array) -> jax.Array:
        """The sublayer's input before its RMSNorm: routed, or (1-a)*base + a*routed."""
        if self.gate is None:
            return routed
        a = self.gate[...].astype(routed.dtype)
        return (1 - a) * base + a * routed


@jax.custom_vjp
def weighted_sum(weights: jax.Array, values: jax.Array, outside: tuple = ()) -> jax.Array:
    """sum_s weights[s] * values[s] + sum of w * v over the (w [B,T] float32, v [B,T,D]) pairs
    in `outside`: [S,B,T] and [S,B,T,D] -> [B,T,D], summed in float32 and rounded once to values'
    dtype. Autodiff gives the same gradient (up to the order of its float32 sums) but takes the
    cotangent through the float32 sum, and in bfloat16 runs XLA then writes a float32 copy of
    every site's mix cotangent; here it stays in values' dtype."""
    mix = jnp.einsum("sbt,sbtd->btd", weights, values, preferred_element_type=jnp.float32)
    return _add_weighted(mix, outside).astype(values.dtype)


def _add_weighted(mix: jax.Array, terms) -> jax.Array:
    """mix [B,T,D] float32 + w * v, in float32, for each (w [B,T] float32, v [B,T,D]) term."""
    for weight, value in terms:
        mix = mix + weight[..., None] * value.astype(jnp.float32)
    return mix


def _weighted_sum_forward(weights, values, outside):
    return weighted_sum(weights, values, outside), (weights, values, outside)


def _weighted_sum_backward(residuals, cotangent):
    weights, values, outside = residuals
    # One product per slot: as one "btd,sbtd->sbt" einsum XLA broadcasts the cotangent over
    # the slots and writes a float32 copy of it for the product to read (v5p, 220M
    # delta_block: 0.28338 -> 0.28176 s estimated).
    d_weights = (jnp.stack([_token_dot(cotangent, value) for value in values]) if len(values)
                 else jnp.zeros(values.shape[:3], jnp.float32))
    d_values = weights[..., None].astype(values.dtype) * cotangent[None].astype(values.dtype)
    d_outside = tuple(
        (_token_dot(cotangent, value).astype(weight.dtype),
         (weight[..., None] * cotangent.astype(jnp.float32)).astype(value.dtype))
        for weight, value in outside)
    return d_weights.astype(weights.dtype), d_values, d_outside


def _token_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """[B,T,D] x [B,T,D] -> [B,T] float32: each token's dot product."""
    return jnp.einsum("btd,btd->bt", a, b, preferred_element_type=jnp.float32)


weighted_sum.defvjp(_weighted_sum_forward, _weighted_sum_backward)


def masked_softmax(logits: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax over axis 0 of [N,...] float32 restricted to valid [N]; all-invalid -> zeros."""
    valid = valid.reshape(valid.shape + (1,) * (logits.ndim - 1))
    shifted = jnp.where(valid, logits, -jnp.inf)
    peak = jnp.max(shifted, axis=0, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    exp = jnp.where(valid, jnp.exp(shifted - peak), 0.0)
    total = jnp.sum(exp, axis=0, keepdims=True)
    return exp / jnp.where(total > 0, total, 1.0)


def weight_statistics(weights: jax.Array, num_sources) -> dict[str, jax.Array]:
    """Per-site sharpness from padded weights [..., N_pad, B, T] and counts [...].

    max_weight: mean over tokens of max_n alpha; entropy: mean over tokens of -sum a log a;
    normalized_entropy: entropy / log(N) (0 where N <= 1). Sites with N = 0 give NaN.
    """
    num_sources = jnp.asarray(num_sources)
    plogp = jnp.where(weights > 0, weights * jnp.log(jnp.where(weights > 0, weights, 1.0)), 0.0)
    entropy = jnp.mean(-jnp.sum(plogp, axis=-3), axis=(-2, -1))
    max_weight = jnp.mean(jnp.max(weights, axis=-3), axis=(-2, -1))
    log_n = jnp.log(jnp.maximum(num_sources, 1).astype(jnp.float32))
    normalized = jnp.where(num_sources > 1, entropy / jnp.where(log_n > 0, log_n, 1.0), 0.0)
    unused = num_sources == 0
    nan = jnp.float32(jnp.nan)
    return {"max_weight": jnp.where(unused, nan, max_weight),
            "entropy": jnp.where(unused, nan, entropy),
            "normalized_entropy": jnp.where(unused, nan, normalized)}


@struct.dataclass
class Routing:
    """Routing weights of every site, returned by `model(ids, return_routing=True)`.

    weights      [L, 2, N_pad, B, T] float32: (layer, site 0 attention / 1 MLP, source slot);
                 zero on slots a site does not see.
    final        [N_pad, B, T] float32 or None: the final site (block, full).
    site_sources [L][2] ints (static): sources each site sees, 0 for an unused site;
                 `num_sources` is the same as an array.
    final_sources int (static).
    has_null, has_live (static): the padded layout, see routing.py.
    """
    weights: jax.Array
    final: jax.Array | None
    site_sources: tuple = struct.field(pytree_node=False)
    final_sources: int = struct.field(pytree_node=False)
    has_null: bool = struct.field(pytree_node=False)
    has_live: bool = struct.field(pytree_node=False)

    @property
    def num_sources(self) -> np.ndarray:
        return np.asarray(self.site_sources, dtype=np.int32).reshape(-1, 2)

    def statistics(self) -> dict[str, jax.Array]:
        """max_weight, entropy, normalized_entropy, each [L, 2] (and final_* scalars)."""
        stats = weight_statistics(self.weights, self.num_sources)
        if self.final is not None:
            for k, v in weight_statistics(self.final, self.final_sources).items():
                stats["final_" + k] = v
        return stats

    def site_weights(self, layer: int, site: int) -> jax.Array:
        """Compact [N, B, T] weights of one site in source order (null, committed..., live)."""
        return self._compact(self.weights[layer, site], int(self.num_sources[layer, site]))

    def final_weights(self) -> jax.Array:
        return self._compact(self.final, self.final_sources)

    def _compact(self, padded: jax.Array, count: int) -> jax.Array:
        if count == 0:
            return padded[:0]
        if self.has_live:  # live is the last padded slot, the committed ones precede it
            return jnp.concatenate([padded[:count - 1], padded[-1:]])
        return padded[:count]

    def calls(self) -> list[jax.Array]:
        """Every used site's compact weights in call order (attention, MLP per layer, final)."""
        out = [self.site_weights(l, s) for l in range(self.num_sources.shape[0])
               for s in (0, 1) if self.num_sources[l, s] > 0]
        if self.final is not None:
            out.append(self.final_weights())
        return out
