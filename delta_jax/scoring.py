"""Log-likelihood of continuations, the primitive of multiple-choice evaluation (lm-eval-harness).

score(context, continuation) = (sum of log p(continuation token | everything before it),
whether greedy decoding from the context would produce exactly the continuation). Requests are
sorted by length and scored in right-padded batches of a fixed size, with lengths rounded up to
a multiple of `pad_multiple`, so that few shapes are compiled.

Conventions: B requests per batch, T padded length (<= max_length), V vocab.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax.data.tokenizers import Tokenizer, check_token_ids
from delta_jax.model import CausalLM
from delta_jax.sharding import mesh_of, on_mesh, put_batch, replicated


@functools.partial(jax.jit, static_argnums=0)
def _score_batch(graphdef, state, input_ids, targets, mask):
    """[B,T] ids, next-token targets, mask of continuation places ->
    (sum of target log-probs over the mask [B] float32, all masked targets are argmax [B] bool)."""
    logits = nnx.merge(graphdef, state)(input_ids).astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target_logprobs = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return replicated((jnp.sum(jnp.where(mask, target_logprobs, 0.0), axis=-1),
                       jnp.all(greedy | ~mask, axis=-1)))


def loglikelihood(model: CausalLM, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                  max_length: int = 2048, batch_size: int = 8,
                  pad_multiple: int = 64) -> list[tuple[float, bool]]:
    """(context ids, continuation ids) pairs -> [(sum of log-probs, is_greedy)] in input order.

    The context must hold at least one token (text callers prepend BOS/EOS to an empty one);
    a pair longer than max_length + 1 tokens keeps its last max_length + 1 (context cut first).
    A model loaded onto a mesh runs there, each batch split over (data, fsdp) where it divides.
    """
    rows = []
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0:
            raise ValueError(f"request {i}: empty context; prepend a BOS/EOS token")
        if not 0 < len(continuation) <= max_length:
            raise ValueError(f"request {i}: continuation of {len(continuation)} tokens, "
                             f"expected 1 to max_length={max_length}")
        sequence = np.asarray([*context, *continuation], np.int32)[-(max_length + 1):]
        check_token_ids(sequence, model.config.vocab_size, where=f"request {i}")
        rows.append((sequence, len(continuation)))

    graphdef, state = nnx.split(model)
    mesh = mesh_of(state)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    for first in range(0, len(order), batch_size):
        chunk = order[first:first + batch_size]
        longest = len(rows[chunk[0]][0]) - 1
        length = min(-(-longest // pad_multiple) * pad_multiple, max_length)
        ids, targets = (np.zeros((batch_size, length), np.int32) for _ in range(2))
        mask = np.zeros((batch_size, length), bool)
        for row, index in enumerate(chunk):
            sequence, count = rows[index]
            n = len(sequence) - 1
            ids[row, :n], targets[row, :n] = sequence[:-1], sequence[1:]
            mask[row, n - count:n] = True
        with on_mesh(mesh):
            logprob, greedy = _score_batch(graphdef, state, *(put_batch(x, mesh)
                                                              for x in (ids, targets, mask)))
        for row, index in enumerate(chunk):
            results[index] = (float(logprob[row]), bool(greedy[row]))
    return results


def encode_pair(tokenizer: Tokenizer, context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """Text pair -> token pair, the way lm-eval-harness splits it.

    Trailing whitespace of the context move to the continuation; the pair is encoded as one string
    and split where the context's own encoding ends, so a token spanning the boundary counts as
    continuation. An empty context becomes the EOS token.
    """
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    if not stripped:
        return [tokenizer.eos_id], tokenizer.encode(continuation)
    context_ids = tokenizer.encode(stripped)
    return context_ids, tokenizer.encode(stripped + continuation)[len(context_ids):]


def loglikelihood_text(model: CausalLM, tokenizer: Tokenizer,
                       requests: Sequence[tuple[str, str]], **kwargs) -> list[tuple[float, bool]]:
    """(context, continuation) strings -> [(sum of log-probs, is_greedy)]; kwargs as above."""
    return loglikelihood(model, [encode_pair(tokenizer, c, x) for c, x in requests], **kwargs)
