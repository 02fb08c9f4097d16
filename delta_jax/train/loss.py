"""Next-token cross-entropy from the final hidden states, the vocabulary a chunk at a time.

With Qwen3's 151,936-token vocabulary the [B,T,V] logits are most of a train step's memory: at
1044M on v5p (8 sequences of 2048 a chip) the bf16 logits and their float32 copy take 4.6 and
9.3 GiB a chip (BENCHMARKS.md). `vocab_chunked_cross_entropy` never forms them: the forward
pass runs over the vocabulary in C chunks of V/C columns, keeping a running max, sum of
exponentials and the label's logit per token (an online logsumexp), and the backward pass
recomputes each chunk's logits from the saved per-token logsumexp, so a step holds one
[B,T,V/C] chunk at a time.

Chunk k holds the columns k, k + C, k + 2C, ... (a strided split), so each chunk of a head
sharded over the vocabulary (tensor parallel) stays sharded the same way. Each chunk's logits
are rounded to the compute dtype before the float32 softmax, as the unchunked loss does
(`CausalLM.logits` then `astype(float32)`), so the two agree to float32 rounding
(tests/test_chunked_loss.py).

XLA's cost analysis counts a loop's body once, whatever its trip count: the planner's cost twin
(delta_jax/plan/compile.py) traces the loss inside `unrolled_vocab_chunks()`, which writes the
chunk loops out chunk by chunk, so that every chunk's matmuls are counted. A run never does:
the unrolled loops would let XLA hold several chunks' logits at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from delta_jax.sharding import constrain

_UNROLL_CHUNKS = contextvars.ContextVar("unroll_vocab_chunks", default=False)


@contextlib.contextmanager
def unrolled_vocab_chunks():
    """Within it, losses traced write their vocabulary-chunk loops out (the cost twin's)."""
    token = _UNROLL_CHUNKS.set(True)
    try:
        yield
    finally:
        _UNROLL_CHUNKS.reset(token)


def _scan_chunks(body, init, xs):
    """jax.lax.scan over the chunks, unrolled inside unrolled_vocab_chunks()."""
    return jax.lax.scan(body, init, xs, unroll=_UNROLL_CHUNKS.get())


def _split_vocab(head: jax.Array, chunks: int) -> jax.Array:
    """[D,V] -> [C, D, V/C]: chunk k holds columns k, k + C, ..."""
    d, v = head.shape
    return jnp.moveaxis(head.reshape(d, v // chunks, chunks), 2, 0)


def _join_vocab(chunked: jax.Array) -> jax.Array:
    """[C, D, V/C] -> [D,V], the inverse of _split_vocab."""
    c, d, w = chunked.shape
    return jnp.moveaxis(chunked, 0, 2).reshape(d, w * c)


def _chunk_logits(hidden: jax.Array, head_chunk: jax.Array) -> jax.Array:
    """[B,T,D] x [D,W] -> float32 [B,T,W], rounded to the compute dtype first (as the full
    logits are)."""
    logits = constrain(hidden @ head_chunk, ("batch", "seq", "vocab"))
    return logits.astype(jnp.float32)


def _label_mask(labels: jax.Array, chunk: jax.Array, chunks: int, width: int) -> jax.Array:
    """bool [B,T,W]: where chunk `chunk`'s column is the token's label."""
    column = jnp.arange(width, dtype=labels.dtype) * chunks + chunk
    return labels[..., None] == column


def _forward(hidden, head, labels, chunks):
    """(CE float32 [B,T], logsumexp float32 [B,T])."""
    head_chunks = _split_vocab(head, chunks)
    width = head_chunks.shape[-1]
    zeros = jnp.zeros(labels.shape, jnp.float32)

    def one_chunk(carry, xs):
        running_max, total, picked = carry
        k, head_chunk = xs
        logits = _chunk_logits(hidden, head_chunk)
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        total = (total * jnp.exp(running_max - new_max)
                 + jnp.exp(logits - new_max[..., None]).sum(axis=-1))
        picked = picked + jnp.where(_label_mask(labels, k, chunks, width), logits, 0.0).sum(-1)
        return (new_max, total, picked), None

    (running_max, total, picked), _ = _scan_chunks(
        one_chunk, (zeros - jnp.inf, zeros, zeros), (jnp.arange(chunks), head_chunks))
    logsumexp = running_max + jnp.log(total)
    return logsumexp - picked, logsumexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def vocab_chunked_cross_entropy(hidden: jax.Array, head: jax.Array, labels: jax.Array,
                                chunks: int) -> jax.Array:
    """hidden [B,T,D] and head [D,V] in the compute dtype, labels int [B,T] in [0, V) ->
    float32 [B,T]: each token's CE against its label, with V/`chunks` logit columns formed at
    a time. `chunks` must divide V."""
    return _forward(hidden, head, labels, chunks)[0]


def _fwd(hidden, head, labels, chunks):
    ce, logsumexp = _forward(hidden, head, labels, chunks)
    return ce, (hidden, head, labels, logsumexp)


def _bwd(chunks, residuals, d_ce):
    hidden, head, labels, logsumexp = residuals
    head_chunks = _split_vocab(head, chunks)
    width = head_chunks.shape[-1]

    def one_chunk(d_hidden, xs):
        k, head_chunk = xs
        logits = _chunk_logits(hidden, head_chunk)
        # d CE / d logit = softmax - one_hot(label), times the token's cotangent.
        d_logits = (jnp.exp(logits - logsumexp[..., None])
                    - _label_mask(labels, k, chunks, width)) * d_ce[..., None]
        d_logits = d_logits.astype(hidden.dtype)
        d_hidden = d_hidden + jnp.einsum("btw,dw->btd", d_logits, head_chunk,
                                         preferred_element_type=jnp.float32)
        d_head_chunk = jnp.einsum("btd,btw->dw", hidden, d_logits)
        return d_hidden, d_head_chunk

    d_hidden, d_head_chunks = _scan_chunks(
        one_chunk, jnp.zeros(hidden.shape, jnp.float32), (jnp.arange(chunks), head_chunks))
    return d_hidden.astype(hidden.dtype), _join_vocab(d_head_chunks), None


vocab_chunked_cross_entropy.defvjp(_fwd, _bwd)
