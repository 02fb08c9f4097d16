"""Sampling with a KV cache: generate(model, prompts, ...) and the Sampling rule.

The command line `python -m delta_jax.generate --model PATH --prompt TEXT` is in __main__.py.

Prompts of a batch are left-padded to a common length P; the cache (model.init_cache) records
each row's first real position, so a padded row decodes exactly as it would alone. One jitted
call prefills the prompts and runs the decode loop (jax.lax.while_loop over a preallocated cache
of capacity P + max_new_tokens), stopping early once every row has produced EOS.

Routing variants decode with the same cache as the baseline: the sources a routing site mixes
are the current token's own sublayer outputs, so they live only inside that token's forward pass
([S,B,1,D], S buffer slots) and nothing beyond the keys and values is carried between steps.

Conventions: B prompts, P padded prompt length, N max_new_tokens, V vocab, C cache capacity.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax.data.tokenizers import check_token_ids
from delta_jax.model import CausalLM
from delta_jax.sharding import mesh_of, on_mesh, put_batch, replicated

PAD_ID = 0  # left padding; masked out by the cache, so any id will do


@dataclasses.dataclass(frozen=True)
class Sampling:
    """greedy (argmax), or sampling from softmax(logits / temperature) restricted to the top_k
    tokens (0: all) and then to the smallest set whose probability reaches top_p (1.0: all)."""
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: expected > 0 (or greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: expected >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: expected 0 < top_p <= 1")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B,V] -> token ids [B] int32."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep a token while the mass before it is below top_p; the most likely always stays.
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < sampling.top_p, axis=-1)
        threshold = jnp.take_along_axis(ordered, kept[:, None] - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling",
                                             "keep_logits"))
def _generate(graphdef, state, prompt, start, key, eos_id, *, max_new_tokens: int,
              sampling: Sampling, keep_logits: bool):
    """prompt [B,P] left-padded, start [B] -> (tokens [B,N], steps run, logits [B,N,V] or None).

    Rows that produced EOS (eos_id >= 0) continue with EOS; the loop ends when all have.
    """
    model = nnx.merge(graphdef, state)
    batch = prompt.shape[0]
    cache = model.init_cache(batch, prompt.shape[1] + max_new_tokens, start)
    out = model.forward(prompt, cache=cache)
    logits, cache = out.logits[:, -1].astype(jnp.float32), out.cache
    tokens = jnp.full((batch, max_new_tokens), PAD_ID, jnp.int32)
    kept = (jnp.zeros((batch, max_new_tokens, logits.shape[-1]), jnp.float32)
            if keep_logits else None)

    def emit(i, logits, tokens, kept, done):
        token = sample(logits, jax.random.fold_in(key, i), sampling)
        token = jnp.where(done, eos_id, token)
        tokens = tokens.at[:, i].set(token)
        if keep_logits:
            kept = kept.at[:, i].set(logits)
        return token, tokens, kept, done | (token == eos_id)

    token, tokens, kept, done = emit(0, logits, tokens, kept, jnp.zeros((batch,), bool))

    def cond(carry):
        i, _, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, tokens, kept, done = carry
        out = model.forward(token[:, None], cache=cache)
        token, tokens, kept, done = emit(i, out.logits[:, 0].astype(jnp.float32), tokens, kept,
                                         done)
        cache = out.cache
        return i + 1, token, cache, tokens, kept, done

    steps, _, _, tokens, kept, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), token, cache, tokens, kept, done))
    return replicated((tokens, steps, kept))


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [B,N] int32: new tokens; after a row's EOS, EOS again
    lengths: np.ndarray  # [B] new tokens per row up to and including its first EOS
    steps: int  # decode steps run (< N when every row stopped early)
    logits: np.ndarray | None  # [B,N,V] float32: the logits each token was drawn from
    seconds: float  # wall time of the call (compilation included on a first call)

    def row(self, b: int) -> list[int]:
        return self.tokens[b, :self.lengths[b]].tolist()


def left_pad(prompts: Sequence[Sequence[int]], multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (ids [B,P] int32 left-padded with PAD_ID, start [B] int32); P is the
    longest prompt rounded up to `multiple`."""
    length = -(-max(len(p) for p in prompts) // multiple) * multiple
    ids = np.full((len(prompts), length), PAD_ID, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = prompt
    return ids, np.asarray([length - len(p) for p in prompts], np.int32)


def generate(model: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(greedy=True), seed: int = 0,
             eos_id: int | None = None, max_length: int | None = None,
             keep_logits: bool = False, pad_multiple: int = 1) -> Generation:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    `max_length` bounds prompt + new tokens (the model's context); `eos_id` stops a row.
    Rounding the padded prompt length up to `pad_multiple` lets calls with prompts of
    different lengths share one compilation. A model loaded onto a mesh decodes there, the
    prompts split over (data, fsdp) where their number allows.
    """
    if not prompts:
        raise ValueError("no prompt given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: expected at least one token")
        check_token_ids(np.asarray(prompt), model.config.vocab_size, where=f"prompt {i}")
        if max_length is not None and len(prompt) + max_new_tokens > max_length:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                             f"{max_new_tokens} that exceeds the context length {max_length}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    ids, start = left_pad(prompts, pad_multiple)
    graphdef, state = nnx.split(model)
    mesh = mesh_of(state)
    begin = time.perf_counter()
    with on_mesh(mesh):
        tokens, steps, logits = _generate(
            graphdef, state, put_batch(ids, mesh), put_batch(start, mesh), jax.random.key(seed),
            jnp.int32(-1 if eos_id is None else eos_id), max_new_tokens=max_new_tokens,
            sampling=sampling, keep_logits=keep_logits)
    tokens = np.asarray(tokens)
    seconds = time.perf_counter() - begin
    lengths = np.full(len(prompts), max_new_tokens)
    if eos_id is not None:
        for b, row in enumerate(tokens):
            if (hits := np.flatnonzero(row == eos_id)).size:
                lengths[b] = hits[0] + 1
    return Generation(tokens, lengths, int(steps), None if logits is None else np.asarray(logits),
                      seconds)


def decode_memory(model: CausalLM, batch: int, capacity: int) -> dict[str, int]:
    """Bytes of the KV cache and of one compiled decode step (one new token per row)."""
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, capacity)

    def step(state, token, cache):
        out = nnx.merge(graphdef, state).forward(token, cache=cache)
        return out.logits, out.cache

    compiled = jax.jit(step).lower(state, jnp.zeros((batch, 1), jnp.int32), cache).compile()
    stats = compiled.memory_analysis()
    return {"cache_bytes": sum(x.nbytes for x in jax.tree.leaves(cache)),
            "param_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
            "step_temp_bytes": int(stats.temp_size_in_bytes),
            "step_argument_bytes": int(stats.argument_size_in_bytes),
            "step_output_bytes": int(stats.output_size_in_bytes)}
