"""The causal language model: embedding, stacked decoder layers, routing, head.

Conventions: B batch, T sequence, D hidden, V vocab, L layers, S buffer slots, N_pad the padded
number of sources of a site ([null?] + S slots + [live?], routing.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from delta_jax.config import ModelConfig
from delta_jax.model.decoder import DecoderLayer, apply_writes, make_write
from delta_jax.model.drivers import DRIVERS, with_remat
from delta_jax.model.layers import LayerCache, RMSNorm, dtype_of, make_param, rope_tables
from delta_jax.model.routing import RoutingSite, weight_statistics
from delta_jax.model.schedule import Schedule, schedule
from delta_jax.sharding import constrain


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


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        pd = dtype_of(cfg.param_dtype)
        self.embed_tokens = make_param(rngs, (cfg.vocab_size, cfg.hidden_size),
                                       ("vocab", "embed"), init="normal", std=cfg.init_std,
                                       dtype=pd, stack=None)
        self.layers = DecoderLayer(cfg, rngs, stack=cfg.num_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
        # The reference's final site has no gate; gated against the stream, it needs one.
        self.final_site = (RoutingSite(cfg, rngs, gated=cfg.carries_stream)
                           if cfg.has_final_site else None)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        make_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                   init="normal", std=cfg.init_std, dtype=pd, stack=None))

    @property
    def schedule(self) -> Schedule:
        return schedule(self.config)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 cache: LayerCache | None = None, return_routing: bool = False,
                 return_hidden: bool = False, driver: str | None = None):
        """input_ids [B,T] int -> logits [B,T,V] in the compute dtype.

        With a `cache` (from `init_cache`) the tokens are appended to it and the updated cache
        is returned after the logits. return_routing adds a `Routing` (routing weights and
        statistics); return_hidden adds the final-normed hidden states [B,T,D]. The layer
        driver defaults to the config's; layer outputs (routing, cache) need a driver that
        returns them, so the lean one gives way to `scan` there.
        """
        hidden, routing, cache = self.hidden_states(
            input_ids, positions=positions, cache=cache, return_routing=return_routing,
            driver=driver)
        logits = self.logits(hidden)
        outputs = (logits,) if cache is None else (logits, cache)
        if return_routing:
            outputs += (routing,)
        if return_hidden:
            outputs += (hidden,)
        return outputs[0] if len(outputs) == 1 else outputs

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B,T,D] final-normed -> [B,T,V]."""
        dtype = dtype_of(self.config.dtype)
        head = (self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...])
        return constrain(hidden.astype(dtype) @ head.astype(dtype), ("batch", "seq", "vocab"))

    def init_cache(self, batch: int, capacity: int, start: jax.Array | None = None) -> LayerCache:
        """An empty decoding cache: k, v [L,B,capacity,K,hd]; start [B] marks left padding."""
        cfg = self.config
        shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, dtype_of(cfg.dtype))
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        return LayerCache(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32), start=start)

    def hidden_states(self, input_ids, *, positions=None, cache=None, return_routing=False,
                      driver=None):
        """input_ids [B,T] -> (final-normed hidden [B,T,D], Routing or None, LayerCache or None).

        Positions default to 0..T-1, or with a cache to each token's place after its row's
        start (so a left-padded row sees the positions an unpadded one would).
        """
        cfg = self.config
        dtype = dtype_of(cfg.dtype)
        batch, length = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
            if cache is not None:
                positions = positions + cache.length - cache.start[:, None]
        rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        embeddings = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(dtype)

        plan = self.schedule
        carry = {
            "h": embeddings,
            "buf": constrain(jnp.zeros((plan.num_slots, batch, length, cfg.hidden_size), dtype),
                             ("sources", "batch", "seq", "act_embed")),
            "rinv": jnp.zeros((plan.num_slots, batch, length), jnp.float32),
        }
        if cfg.carries_stream:
            carry["stream"] = embeddings
        if plan.embedding_in_slot0:
            carry = apply_writes(carry, (make_write(embeddings, 0, cfg.rms_norm_eps),))

        driver = driver or cfg.layer_driver
        if (return_routing or cache is not None) and driver == "lean":
            driver = "scan"
        graphdef, params = nnx.split(self.layers)
        layer_inputs = params if cache is None else (params, (cache.k, cache.v))

        def step(inputs, c, row):
            params_l, kv = (inputs, None) if cache is None else inputs
            layer_cache = None if kv is None else cache.replace(k=kv[0], v=kv[1])
            state, writes, weights, layer_cache = nnx.merge(graphdef, params_l)(
                c, row, {"rope": rope, "cache": layer_cache})
            kv = None if layer_cache is None else (layer_cache.k, layer_cache.v)
            return state, writes, (weights, kv)

        rows = {"first_write": plan.first_write, "attn_visible": plan.attn_visible,
                "boundary": plan.boundary}
        carry, (site_weights, kv) = DRIVERS[driver](with_remat(step, cfg.remat), layer_inputs,
                                                    carry, rows)
        if cache is not None:
            cache = cache.replace(k=kv[0], v=kv[1], length=cache.length + length)

        out, final_weights = carry["h"], None
        if self.final_site is not None:
            mix, final_weights = self.final_site(carry["buf"], carry["rinv"],
                                                 plan.final_visible, live=carry["h"])
            out = self.final_site.gated(carry.get("stream"), mix)
        hidden = self.norm(out)
        if not return_routing:
            return hidden, None, cache
        weights = (jnp.stack(site_weights, axis=1) if site_weights
                   else jnp.zeros((cfg.num_layers, 2, 0, batch, length), jnp.float32))
        return hidden, Routing(weights=weights, final=final_weights,
                               site_sources=tuple(map(tuple, plan.site_sources(cfg).tolist())),
                               final_sources=plan.final_sources(),
                               has_null=cfg.null_source, has_live=plan.has_live), cache


def init_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return CausalLM(cfg, rngs=nnx.Rngs(params=seed))


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters, computed without allocating them."""
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
