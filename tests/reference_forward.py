"""An independent, literal transcription of docs/spec.md section 3 for the tests.

Python lists of sources, every site stacks its sources and normalises them explicitly (no
buffer, no inverse-RMS cache, no schedule): what the scanned model must agree with on configs the
golden files do not cover (paper block sources, null sources, gates, gates against the
residual stream, uneven blocks).
"""
import jax
import jax.numpy as jnp
from flax import nnx

from delta_jax.model.layers import rope_tables


def _rms(x, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def _route(site, sources, eps):
    """sources: list of [B,T,D] -> (mix [B,T,D], alpha [N,B,T])."""
    if not sources:
        return None, None
    stacked = jnp.stack(sources)
    logits = jnp.einsum("nbtd,d->nbt", _rms(stacked, eps) * site.norm[...], site.query[...])
    alpha = jax.nn.softmax(logits, axis=0)
    return jnp.einsum("nbt,nbtd->btd", alpha, stacked), alpha


def _sources(site, deltas, like):
    null = [] if site.null is None else [jnp.broadcast_to(site.null[...], like.shape)]
    return null + list(deltas)


def _gate(site, base, routed):
    return routed if site.gate is None else (1 - site.gate[...]) * base + site.gate[...] * routed


def reference_forward(model, ids):
    """ids [B,T] -> (logits [B,T,V], list of alpha [N,B,T] in call order)."""
    cfg, eps = model.config, model.config.rms_norm_eps
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    graphdef, state = nnx.split(model.layers)
    layers = [nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))
              for i in range(cfg.num_layers)]
    attn = lambda layer, x: layer.self_attn(layer.input_layernorm(x), *rope)[0]
    mlp = lambda layer, x: layer.mlp(layer.post_attention_layernorm(x))
    h = jnp.take(model.embed_tokens[...], ids, axis=0)
    lpb, variant, calls, S = cfg.layers_per_block, cfg.residual, [], []
    stream = h  # the plain residual stream, the gates' base with gate_base="stream"

    def additive(site, h):
        mix, alpha = _route(site, _sources(site, S, h), eps)
        if alpha is None:
            return h
        calls.append(alpha)
        return _gate(site, h, h + mix)

    def replacement(site, live):
        mix, alpha = _route(site, S + [live], eps)
        calls.append(alpha)
        return _gate(site, stream if cfg.gate_base == "stream" else live, mix)

    for l, layer in enumerate(layers):
        if variant == "baseline":
            h = h + attn(layer, h)
            h = h + mlp(layer, h)
        elif variant == "full":
            x = replacement(layer.attn_site, h)
            S.append(h)
            h = attn(layer, x)
            stream = stream + h
            x = replacement(layer.mlp_site, h)
            S.append(h)
            h = mlp(layer, x)
            stream = stream + h
        elif variant == "block":
            x = replacement(layer.attn_site, h)
            if l % lpb == 0:
                S.append(h)
                h = jnp.zeros_like(h)
            a = attn(layer, x)
            h, stream = h + a, stream + a
            m = mlp(layer, replacement(layer.mlp_site, h))
            h, stream = h + m, stream + m
        elif variant == "delta":
            a = attn(layer, additive(layer.attn_site, h))
            if not S:
                S.append(h)
            h = h + a
            S.append(a)
            m = mlp(layer, additive(layer.mlp_site, h))
            h = h + m
            S.append(m)
        elif variant == "delta_block":
            a = attn(layer, additive(layer.attn_site, h))
            if l % lpb == 0:
                if not S:
                    S.append(h)
                elif cfg.block_sources == "reference":
                    S.append(h - S[-1])
                else:
                    S.append(h - sum(S))
            h = h + a
            h = h + mlp(layer, additive(layer.mlp_site, h))
    if model.final_site is not None:
        h = replacement(model.final_site, h)
    return model.logits(model.norm(h)), calls
