"""Perplexity and bits per byte of held-out text: read_stream, then perplexity.

The command line `python -m delta_jax.eval --model PATH --data ...` is in __main__.py.

Data is a prepared directory (`python -m delta_jax.data prepare`), a "tfds:NAME?..." spec read
through the data pipeline, or text/Markdown/JSONL/Parquet files. Each becomes one token stream:
every document's tokens followed by EOS, as the data preparation writes it, so a text file and
the same file prepared score the same.

Windows (the strided-perplexity rule): window k holds inputs stream[k*stride : k*stride + T]
and predicts the next token at each place, but scores only the tokens no earlier window scored.
Every token but the stream's first is scored exactly once, with at least T - stride tokens of
context; stride = T gives non-overlapping windows (the trainer's validation windows).
Bits per byte = total NLL in nats / (ln 2 * UTF-8 bytes of the scored tokens' text, EOS excluded).

Conventions: B windows per batch, T window length (seq_len), N stream length, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax.data.corpus import DEFAULT_CACHE_DIR, EMBEDDED, default_prepared_data
from delta_jax.data.pipeline import (
    PACKINGS,
    PreparedSplit,
    build_eval_iterator,
    document_segments,
)
from delta_jax.data.prepare import METADATA, find_inputs, iter_documents
from delta_jax.data.tokenizers import Tokenizer, check_token_ids, get_tokenizer
from delta_jax.loading import data_tokenizer
from delta_jax.model import CausalLM
from delta_jax.sharding import mesh_of, on_mesh, put_batch, replicated


@dataclasses.dataclass(frozen=True)
class TokenStream:
    tokens: np.ndarray  # [N] int32
    tokenizer: Tokenizer | None  # decodes the scored tokens to count bytes; None: no bits/byte
    source: str


def read_stream(data: Sequence[str], *, tokenizer: Tokenizer | None = None,
                split: str = "validation", max_tokens: int | None = None) -> TokenStream:
    """The token stream of `data`: "embedded" (the trainer's default corpus, prepared under
    data/cache on first use), one prepared directory, one "tfds:..." spec, or text files.

    A prepared directory and a TFDS spec carry their own tokenizer (`tokenizer` overrides the
    one used to count bytes); text files are tokenised with `tokenizer`, which they need.
    At most `max_tokens` tokens are read.
    """
    data = [str(d) for d in data]
    if not data:
        raise ValueError("no data given: expected embedded, a prepared directory, a tfds: spec "
                         "or text files")
    if data == [EMBEDDED]:
        data = [str(default_prepared_data(DEFAULT_CACHE_DIR))]
    first, source = data[0], " ".join(data)
    if first.startswith("tfds:") or (Path(first) / METADATA).is_file():
        if len(data) > 1:
            raise ValueError(f"{source}: a prepared directory or tfds: spec must come alone")
        tokens = (_tfds_tokens(first, split, max_tokens) if first.startswith("tfds:") else
                  _prepared_tokens(Path(first), split, max_tokens))
        return TokenStream(tokens, tokenizer or get_tokenizer(data_tokenizer(first)),
                           f"{source} [{split}]")
    if tokenizer is None:
        raise ValueError(f"{source}: text files need a tokenizer (--tokenizer byte, qwen3 or a "
                         "tokenizer.json), and the model folder holds none")
    pieces, total = [], 0
    documents = (text for path in find_inputs(data) for text, _ in iter_documents(path))
    for text in documents:
        if max_tokens is not None and total >= max_tokens:
            break
        if text:
            pieces.append(np.append(tokenizer.encode_array(text), tokenizer.eos_id))
            total += len(pieces[-1])
    if not pieces:
        raise ValueError(f"{source}: no non-empty document")
    tokens = np.concatenate(pieces).astype(np.int32)[:max_tokens]
    return TokenStream(tokens, tokenizer, source)


def _prepared_tokens(directory: Path, split: str, max_tokens: int | None) -> np.ndarray:
    prepared = PreparedSplit(directory, split)
    stop = prepared.num_tokens if max_tokens is None else min(max_tokens, prepared.num_tokens)
    return prepared.read(0, stop)


def _tfds_tokens(spec: str, split: str, max_tokens: int | None, chunk: int = 256) -> np.ndarray:
    """The pipeline packs documents into windows of chunk + 1 tokens that overlap by one; their
    first token and then every label rebuild the stream (less a tail shorter than a chunk)."""
    batches = build_eval_iterator(spec, seq_len=chunk, global_batch_size=1, split=split,
                                  process_index=0, process_count=1)
    pieces, total = [], 0
    for batch in batches:
        if not pieces:
            pieces.append(batch["input_ids"][0, :1])
        pieces.append(batch["labels"][0])
        total += chunk
        if max_tokens is not None and total >= max_tokens:
            break
    if not pieces:
        raise ValueError(f"{spec} split {split!r}: fewer than {chunk + 1} tokens")
    return np.concatenate(pieces).astype(np.int32)[:max_tokens]


def window_starts(num_tokens: int, seq_len: int, stride: int) -> list[int]:
    """Start of every window over a stream of `num_tokens` (the last reaches its end)."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} is invalid: expected 1 <= stride <= seq_len={seq_len}")
    starts = [0]
    while starts[-1] + seq_len < num_tokens - 1:
        starts.append(starts[-1] + stride)
    return starts


def window_batches(tokens: np.ndarray, seq_len: int, stride: int, batch_size: int,
                   eos_id: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Batches {"input_ids", "labels", "mask"} [B, T] (int32, int32, bool) of the strided windows;
    mask marks the labels this window scores. The last batch is padded with empty windows.

    With `eos_id` (documents packing, docs/data.md#packing) the batches also hold segment_ids
    and positions, and the label after an EOS input is not scored: the model, kept inside the
    document, cannot see the next one coming."""
    n = len(tokens)
    starts = window_starts(n, seq_len, stride)
    scored_until = 1  # stream index of the first label not yet scored
    for first in range(0, len(starts), batch_size):
        batch = {"input_ids": np.zeros((batch_size, seq_len), np.int32),
                 "labels": np.zeros((batch_size, seq_len), np.int32),
                 "mask": np.zeros((batch_size, seq_len), bool)}
        for row, start in enumerate(starts[first:first + batch_size]):
            inputs = tokens[start:min(start + seq_len, n - 1)]
            batch["input_ids"][row, :len(inputs)] = inputs
            batch["labels"][row, :len(inputs)] = tokens[start + 1:start + 1 + len(inputs)]
            label_index = start + 1 + np.arange(seq_len)
            batch["mask"][row] = (label_index >= scored_until) & (label_index < n)
            scored_until = min(start + 1 + seq_len, n)
        if eos_id is not None:
            batch["segment_ids"], batch["positions"] = document_segments(batch["input_ids"],
                                                                         eos_id)
            batch["mask"] &= batch["input_ids"] != eos_id
        yield batch


@functools.partial(jax.jit, static_argnums=0)
def _batch_nll(graphdef, state, input_ids, labels, mask, segment_ids=None, positions=None):
    """[B,T] ids, labels, mask (and segment ids, positions of packed documents) -> (sum of NLL
    in nats over the mask, number of masked tokens)."""
    logits = nnx.merge(graphdef, state)(input_ids, segment_ids=segment_ids,
                                        positions=positions).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return replicated((jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)))


def perplexity(model: CausalLM, stream: TokenStream, *, seq_len: int = 2048,
               stride: int | None = None, batch_size: int = 8, packing: str = "concat") -> dict:
    """Score `stream` in windows of `seq_len` (shortened to the stream) every `stride` tokens
    (default: seq_len). Returns tokens, windows, nll (mean nats/token), perplexity, bytes,
    bits_per_byte (None without a tokenizer), seconds. A model loaded onto a mesh runs there,
    each batch split over (data, fsdp) where its size allows.

    `packing` is the training data's (docs/data.md#packing): "concat" lets a window's documents
    attend to each other; "documents" keeps each within itself (positions restart after every
    EOS) and leaves the token after each EOS unscored, so it needs the stream's tokenizer."""
    tokens = stream.tokens
    if len(tokens) < 2:
        raise ValueError(f"{stream.source}: {len(tokens)} token(s), need at least 2 to score one")
    check_token_ids(tokens, model.config.vocab_size, where=stream.source)
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} is invalid: expected 1 <= stride <= seq_len={seq_len}")
    seq_len = min(seq_len, len(tokens) - 1)  # a short stream is one shorter window
    stride = min(stride, seq_len)
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} is invalid: expected one of {', '.join(PACKINGS)}")
    eos_id = None
    if packing == "documents":
        if stream.tokenizer is None:
            raise ValueError(f"{stream.source}: packing='documents' needs the tokenizer's EOS "
                             "id, and this stream has no tokenizer (pass --tokenizer)")
        eos_id = stream.tokenizer.eos_id
    num_windows = len(window_starts(len(tokens), seq_len, stride))
    batch_size = min(batch_size, num_windows)
    graphdef, state = nnx.split(model)
    mesh = mesh_of(state)
    total_nll, total_tokens = 0.0, 0
    begin = time.perf_counter()
    with on_mesh(mesh):
        for batch in window_batches(tokens, seq_len, stride, batch_size, eos_id):
            nll, count = _batch_nll(graphdef, state, **{k: put_batch(v, mesh)
                                                        for k, v in batch.items()})
            total_nll += float(nll)
            total_tokens += int(count)
    seconds = time.perf_counter() - begin
    mean = total_nll / total_tokens
    result = {"data": stream.source, "tokens": total_tokens, "windows": num_windows,
              "seq_len": seq_len, "stride": stride, "packing": packing, "nll": mean,
              "perplexity": math.exp(mean),
              "bytes": None, "bits_per_byte": None, "seconds": seconds}
    if stream.tokenizer is not None:
        scored = tokens[1:]
        text = stream.tokenizer.decode(scored[scored != stream.tokenizer.eos_id].tolist())
        result["bytes"] = len(text.encode("utf-8"))
        if result["bytes"]:
            result["bits_per_byte"] = total_nll / (math.log(2) * result["bytes"])
    return result
