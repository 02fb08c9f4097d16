"""The causal language model: embedding, stacked decoder layers, routing, head.

Conventions: B batch, T sequence, D hidden, V vocab, L layers, S buffer slots, N_pad the padded
number of sources of a site ([null?] + S slots + [live?], routing.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from delta_jax.config import ModelConfig
from delta_jax.model.decoder import DecoderLayer, DeltaStateRebuild, HoistedBlockWrite
from delta_jax.model.drivers import DRIVERS, with_remat
from delta_jax.model.layers import LayerCache, RMSNorm, dtype_of, make_param, rope_tables
from delta_jax.model.protocol import Carry, LayerContext, SourceBuffer, TokenState, Write
from delta_jax.model.routing import Routing, RoutingSite
from delta_jax.model.schedule import Schedule, layer_loops, schedule
from delta_jax.sharding import constrain


@struct.dataclass
class ModelOutput:
    """What `CausalLM.forward` returns; None for what was not asked.

    logits [B,T,V] in the compute dtype; hidden [B,T,D]: the final-normed hidden states;
    cache: the updated decoding cache (when one was passed); routing: every site's weights
    (with return_routing).
    """
    logits: jax.Array
    hidden: jax.Array
    cache: LayerCache | None = None
    routing: Routing | None = None


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
                 segment_ids: jax.Array | None = None, driver: str | None = None) -> jax.Array:
        """input_ids [B,T] int -> logits [B,T,V] in the compute dtype."""
        return self.forward(input_ids, positions=positions, segment_ids=segment_ids,
                            driver=driver).logits

    def head(self) -> jax.Array:
        """The output projection [D,V] in the compute dtype (the embedding's transpose when
        tied)."""
        head = (self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...])
        return head.astype(dtype_of(self.config.dtype))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B,T,D] final-normed -> [B,T,V]."""
        head = self.head()
        return constrain(hidden.astype(head.dtype) @ head, ("batch", "seq", "vocab"))

    def init_cache(self, batch: int, capacity: int, start: jax.Array | None = None) -> LayerCache:
        """An empty decoding cache: k, v [L,B,capacity,K,hd]; start [B] marks left padding."""
        cfg = self.config
        shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, dtype_of(cfg.dtype))
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        return LayerCache(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32), start=start)

    def forward(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, cache: LayerCache | None = None,
                return_routing: bool = False, driver: str | None = None) -> ModelOutput:
        """input_ids [B,T] int -> ModelOutput.

        With a `cache` (from `init_cache`) the tokens are appended to it. Positions [B,T]
        default to 0..T-1, or with a cache to each token's place after its row's start (so a
        left-padded row sees the positions an unpadded one would). `segment_ids` [B,T] int
        (packed documents) keep attention within a segment; the caller passes the matching
        positions (each document's from 0, data/pipeline.py). None is one segment per row. The
        layer driver defaults to the config's; layer outputs (routing, cache) need a driver
        that returns them, so the lean one gives way to `scan` there.
        """
        cfg = self.config
        dtype = dtype_of(cfg.dtype)
        batch, length = input_ids.shape
        if segment_ids is not None and cache is not None:
            raise ValueError("CausalLM.forward: segment_ids with a cache; decoding keeps one "
                             "sequence per row and takes none")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
            if cache is not None:
                positions = positions + cache.length - cache.start[:, None]
        rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        embeddings = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(dtype)

        plan = self.schedule
        buffer = SourceBuffer.zeros(plan.num_slots, batch, length, cfg.hidden_size, dtype)
        if plan.embedding_in_slot0:
            buffer = buffer.commit((Write.of(embeddings, 0, cfg.rms_norm_eps),))
        carry = Carry(TokenState(embeddings, embeddings if cfg.carries_stream else None), buffer)

        driver = driver or cfg.layer_driver
        if (return_routing or cache is not None) and driver == "lean":
            driver = "scan"
        graphdef, params = nnx.split(self.layers)
        layer_inputs = (params, None if cache is None else (cache.k, cache.v))

        def step(inputs, c, row):
            params_l, kv = inputs
            layer_cache = None if kv is None else cache.replace(k=kv[0], v=kv[1])
            context = LayerContext(rope, layer_cache, segment_ids)
            return nnx.merge(graphdef, params_l)(c, row, context)

        hoist = HoistedBlockWrite(cfg) if cfg.residual == "delta_block" else None
        rebuild = (DeltaStateRebuild()
                   if cfg.rebuild_states and cfg.residual == "delta" else None)
        carry, (site_weights, layer_caches) = DRIVERS[driver](
            with_remat(step, cfg.remat), layer_inputs, carry, plan.rows(),
            loops=layer_loops(cfg, plan), unroll=cfg.unroll_layers, hoist=hoist, rebuild=rebuild)
        if cache is not None:
            cache = cache.replace(k=layer_caches.k, v=layer_caches.v,
                                  length=cache.length + length)

        out, final_weights = carry.state.h, None
        if self.final_site is not None:
            mix, final_weights = self.final_site(carry.buffer, plan.final_visible,
                                                 live=carry.state.h)
            out = self.final_site.gated(carry.state.stream, mix)
        hidden = self.norm(out)
        routing = None
        if return_routing:
            weights = (jnp.stack(site_weights, axis=1) if site_weights is not None
                       else jnp.zeros((cfg.num_layers, 2, 0, batch, length), jnp.float32))
            routing = Routing(weights=weights, final=final_weights,
                              site_sources=tuple(map(tuple, plan.site_sources(cfg).tolist())),
                              final_sources=plan.final_sources(),
                              has_null=cfg.null_source, has_live=plan.has_live)
        return ModelOutput(logits=self.logits(hidden), hidden=hidden, cache=cache,
                           routing=routing)


def init_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return CausalLM(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """A CausalLM whose arrays are jax.ShapeDtypeStruct: its structure, shapes and shardings
    without allocating (what loaders restore into)."""
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters, computed without allocating them."""
    params = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
