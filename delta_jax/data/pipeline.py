"""Grain readers: prepared shards or a TFDS dataset -> token windows -> per-process batches.

Conventions: B global batch, P process count, L = B / P local batch, T seq_len. A window is
T + 1 consecutive tokens of a split's stream; batches hold input_ids = window[:-1] and
labels = window[1:], both int32 [L, T] (labels are already shifted: the loss compares
logits[:, t] with labels[:, t]). Consecutive windows share one token, so every token but the
stream's first is a label once per epoch; the tail of fewer than T tokens is dropped.

Packing (`packing`, docs/data.md#packing): "concat" is the above, a window's documents
attending to each other. "documents" cuts the same windows but keeps the documents apart:
batches also hold segment_ids (which document of the window a token belongs to, counted from
0; a document ends with its EOS) and positions (the token's place in its document, from 0 at
the window's first token or the token after an EOS), both int32 [L, T], and the label of every
EOS input, the next document's first token, is IGNORE_LABEL: no loss is taken there.

Prepared data (a directory written by `prepare`): window i = tokens [i*T, i*T + T + 1), read
by random access. Epoch e visits the windows in a permutation seeded by (seed, e) (grain's
index_shuffle, no buffer); the global batch of step s is items [s*B, (s+1)*B) of the epochs laid
end to end, and process p reads items s*B + p*L + [0, L). So batch s is a pure function of
(seed, s), whatever the process count, and resuming is setting the iterator's state
{"next_index": s}.

A mixture (build_mixture_iterator, docs/data.md#mixtures) of S prepared sources with weights
w: global example g = s*B + j (row j of batch s) comes from source src(g), drawn with
probability w / sum(w) by a hash of (seed, g) alone, and is item pos(g) = #{g' < g : src(g') =
src(g)} of that source's windows, shuffled and repeated as above with a seed of its own. So each
source is read in its own order without skipping a window, batch s is again a pure function of
(seed, s) for any process count, process p reads rows p*L + [0, L), and the iterator's state is
{"next_index": s} as for one source. pos is found from counts kept per chunk of examples, built
once, in order, on first need (a resumed run counts the examples before it again: a hash each).

TFDS ("tfds:NAME[?data_dir=DIR&tokenizer=SPEC&text_field=FIELD]", ArrayRecord format, read
without TensorFlow): documents are random access but their token counts are unknown until
tokenised, so process p tokenises documents p, p + P, ... of the (shuffled, repeated) split and
packs them into windows as a stream. Batch s is a pure function of (seed, s, P); resuming
restores grain's iterator state. A finite TFDS stream may give processes different numbers of
batches: cap evaluation steps in the caller.
"""
from __future__ import annotations

import bisect
import collections
import functools
import hashlib
import json
import os
import threading
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from delta_jax.data.prepare import FORMAT, METADATA
from delta_jax.data.tokenizers import get_tokenizer

PACKINGS = ("concat", "documents")
IGNORE_LABEL = -1  # a label the loss skips (documents packing: the token after an EOS)


class PreparedSplit:
    """One split of a prepared directory, checked against metadata.json on opening.

    Existence and size of every shard are always checked (cheap); SHA-256 checksums only when
    `verify_checksums`, since that reads every byte (about 1 s per GB, in every process). Without
    it, damage is still caught when a record is read: ArrayRecord's chunks carry their own hashes.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, *, verify_checksums: bool = False):
        self.data_dir = Path(data_dir)
        meta_path = self.data_dir / METADATA
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: missing; is {self.data_dir} the output of "
                                    "`python -m delta_jax.data prepare`?")
        try:
            self.metadata = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
        if self.metadata.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: format {self.metadata.get('format')!r}, "
                             f"expected {FORMAT!r}")
        if split not in self.metadata["splits"]:
            raise ValueError(f"{meta_path}: no split {split!r} "
                             f"(splits: {', '.join(self.metadata['splits'])})")
        info = self.metadata["splits"][split]
        if info["num_tokens"] == 0:
            raise ValueError(f"{meta_path}: split {split!r} is empty (validation_fraction was "
                             f"{self.metadata['validation_fraction']})")
        self.split, self.num_tokens = split, info["num_tokens"]
        self.record_tokens = self.metadata["record_tokens"]
        self.dtype = np.dtype(self.metadata["dtype"]).newbyteorder("<")
        self.shards = [self.data_dir / s["file"] for s in info["shards"]]
        for path, shard in zip(self.shards, info["shards"]):
            _check_shard(path, shard, verify_checksums)
        self._first_record = [0]  # global index of each shard's first record
        for shard in info["shards"]:
            self._first_record.append(self._first_record[-1] + shard["num_records"])
        # "path[0:n]" hands ArrayRecord the record counts, so no shard is opened before it is read.
        self._records = grain.sources.ArrayRecordDataSource(
            [f"{p}[0:{s['num_records']}]" for p, s in zip(self.shards, info["shards"])])

    def _where(self, r: int) -> str:
        shard = bisect.bisect_right(self._first_record, r) - 1
        return f"{self.shards[shard]}: record {r - self._first_record[shard]}"

    def _record(self, r: int) -> np.ndarray:
        try:
            tokens = np.frombuffer(self._records[r], dtype=self.dtype)
        except Exception as e:  # a corrupt file fails inside ArrayRecord with its own message
            raise ValueError(f"{self._where(r)}: unreadable ({e}); check the shards with "
                             f"`python -m delta_jax.data verify {self.data_dir}`") from e
        if len(tokens) != (expected := min(self.record_tokens,
                                           self.num_tokens - r * self.record_tokens)):
            raise ValueError(f"{self._where(r)}: holds {len(tokens)} tokens, "
                             f"the format says {expected}")
        return tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream as int32 [stop - start]."""
        if not 0 <= start < stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.num_tokens}) "
                             f"of {self.split!r}")
        first, last = start // self.record_tokens, (stop - 1) // self.record_tokens
        tokens = np.concatenate([self._record(r) for r in range(first, last + 1)])
        offset = first * self.record_tokens
        return tokens[start - offset:stop - offset].astype(np.int32)


def _check_shard(path: Path, shard: dict, verify_checksums: bool) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (listed in {METADATA})")
    if (size := path.stat().st_size) != shard["num_bytes"]:
        raise ValueError(f"{path}: truncated or altered (metadata says {shard['num_bytes']} bytes, "
                         f"file has {size})")
    if verify_checksums:
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != shard["sha256"]:
            raise ValueError(f"{path}: checksum mismatch (metadata says sha256 {shard['sha256']}, "
                             f"file has {digest})")


def verify(data_dir: str | os.PathLike) -> dict:
    """Checks every shard of every split, checksums included; returns the metadata."""
    meta = PreparedSplit(data_dir, "train", verify_checksums=True).metadata
    for split, info in meta["splits"].items():
        if split != "train" and info["num_tokens"]:
            PreparedSplit(data_dir, split, verify_checksums=True)
    return meta


class TokenWindows:
    """Random-access source of windows: item i = tokens [i*T, i*T + T + 1) as int32 [T + 1]."""

    def __init__(self, split: PreparedSplit, seq_len: int):
        self._split, self._seq_len = split, seq_len
        self._len = (split.num_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self._seq_len
        return self._split.read(start, start + self._seq_len + 1)


def make_window_source(data_dir: str | os.PathLike, *, split: str, seq_len: int,
                       verify_checksums: bool = False) -> grain.MapDataset:
    """The windows [T + 1] of a prepared split as a (random-access) grain.MapDataset."""
    windows = TokenWindows(PreparedSplit(data_dir, split, verify_checksums=verify_checksums),
                           seq_len)
    if len(windows) == 0:
        raise ValueError(f"{data_dir}: split {split!r} has fewer than "
                         f"seq_len + 1 = {seq_len + 1} tokens")
    return grain.MapDataset.source(windows)


class _GatherRows:
    """Step s -> this process's rows of global batch s: windows s*B + offset + [0, L),
    [L, T + 1]."""

    def __init__(self, windows: grain.MapDataset, global_batch: int, offset: int, local_batch: int):
        self._windows, self._b, self._offset, self._l = windows, global_batch, offset, local_batch

    def __call__(self, step: int) -> np.ndarray:
        first = step * self._b + self._offset
        return np.stack([self._windows[first + j] for j in range(self._l)])


def _inputs_and_labels(windows: np.ndarray) -> dict[str, np.ndarray]:
    """[L, T + 1] -> {"input_ids": [L, T], "labels": [L, T]}, int32."""
    return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def batch_keys(packing: str) -> tuple[str, ...]:
    """The arrays of a batch of `packing`, each int32 [L, T]."""
    return ("input_ids", "labels") + (("segment_ids", "positions") if packing == "documents"
                                      else ())


def document_segments(input_ids: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids [L, T] -> (segment_ids, positions), int32 [L, T] each: a document ends with
    its EOS, so a segment starts at the window's first token and after every EOS."""
    ends = input_ids == eos_id
    segment_ids = np.zeros(input_ids.shape, np.int32)
    segment_ids[:, 1:] = np.cumsum(ends[:, :-1], axis=1)
    index = np.arange(input_ids.shape[1])
    starts = np.ones(input_ids.shape, bool)
    starts[:, 1:] = ends[:, :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)  # its segment's start
    return segment_ids, (index - first).astype(np.int32)


def documents_batch(windows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """[L, T + 1] -> {"input_ids", "labels" (IGNORE_LABEL after an EOS), "segment_ids",
    "positions"}: int32 [L, T] each."""
    input_ids = windows[:, :-1]
    segment_ids, positions = document_segments(input_ids, eos_id)
    labels = np.where(input_ids == eos_id, IGNORE_LABEL, windows[:, 1:]).astype(np.int32)
    return {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids,
            "positions": positions}


def data_tokenizer(data: str | os.PathLike, split: str = "train") -> dict:
    """{"name", "vocab_size", "eos_id", ...} of the tokenizer behind `data`'s token ids (a
    prepared directory's metadata, or a TFDS spec's tokenizer option)."""
    if str(data).startswith("tfds:"):
        tok = get_tokenizer(_parse_tfds(str(data)[5:])[1].get("tokenizer", "byte"))
        return {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
    return PreparedSplit(data, split).metadata["tokenizer"]


def _batch_fn(packing: str, data: str | os.PathLike, split: str):
    """The function from windows [L, T + 1] to batches of `packing`."""
    if packing == "concat":
        return _inputs_and_labels
    if packing != "documents":
        raise ValueError(f"packing={packing!r} is invalid: expected one of {', '.join(PACKINGS)}")
    return functools.partial(documents_batch, eos_id=data_tokenizer(data, split)["eos_id"])


class _TokenizeExample:
    """A TFDS example -> its tokens followed by EOS, int32 [n] (empty for an empty text)."""

    def __init__(self, tokenizer: str, field: str, where: str):
        self._tok, self._field, self._where = get_tokenizer(tokenizer), field, where

    def __call__(self, example: dict) -> np.ndarray:
        text = example[self._field]
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{self._where}: invalid UTF-8 in {self._field!r} ({e})") from None
        if not text:
            return np.zeros(0, np.int32)
        return np.append(self._tok.encode_array(text), self._tok.eos_id).astype(np.int32)


class _PackWindows(grain.IterDataset):
    """Concatenates token arrays and cuts windows of `window` tokens every `stride` tokens."""

    def __init__(self, parent: grain.IterDataset, window: int, stride: int):
        super().__init__(parent)
        self._window, self._stride = window, stride

    def __iter__(self) -> grain.DatasetIterator:
        return _PackWindowsIterator(self._parent.__iter__(), self._window, self._stride)


class _PackWindowsIterator(grain.DatasetIterator):
    # State: the parent's state before the first document still needed, and the offset of the
    # next window in it -- no tokens in the checkpoint, and restoring re-reads one window's worth.

    def __init__(self, parent: grain.DatasetIterator, window: int, stride: int):
        super().__init__(parent)
        self._window, self._stride = window, stride
        self._docs = collections.deque()  # (parent state before the document, tokens [n])
        self._offset = 0  # where the next window starts in self._docs[0]
        self._buffered = 0  # tokens in self._docs

    def __next__(self) -> np.ndarray:
        while self._buffered - self._offset < self._window:
            state = self._parent.get_state()
            tokens = next(self._parent)  # StopIteration ends the stream: the tail is dropped
            self._docs.append((state, tokens))
            self._buffered += len(tokens)
        pieces, need, start = [], self._window, self._offset
        for _, tokens in self._docs:
            pieces.append(tokens[start:start + need])
            need, start = need - len(pieces[-1]), 0
            if need == 0:
                break
        self._offset += self._stride
        while self._docs and self._offset >= len(self._docs[0][1]):
            done = len(self._docs.popleft()[1])
            self._offset -= done
            self._buffered -= done
        return np.concatenate(pieces)

    def get_state(self) -> dict:
        parent = self._docs[0][0] if self._docs else self._parent.get_state()
        return {"parent": parent, "offset": self._offset}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._docs.clear()
        self._offset, self._buffered = state["offset"], 0


def _parse_tfds(spec: str) -> tuple[str, dict[str, str]]:
    parsed = urllib.parse.urlsplit(spec)
    options = dict(urllib.parse.parse_qsl(parsed.query, strict_parsing=bool(parsed.query)))
    if unknown := set(options) - {"data_dir", "tokenizer", "text_field"}:
        raise ValueError(f"{spec}: unknown option(s) {sorted(unknown)} (expected data_dir, "
                         "tokenizer, text_field)")
    return parsed.path, options


def _tfds_windows(spec: str, *, split: str, seq_len: int, seed: int, shuffle: bool,
                  num_epochs: int | None, process_index: int, process_count: int,
                  read_options: grain.ReadOptions) -> grain.IterDataset:
    import tensorflow_datasets as tfds

    name, options = _parse_tfds(spec)
    source = tfds.data_source(name, split=split, data_dir=options.get("data_dir"))
    field, where = options.get("text_field", "text"), f"{spec} split {split!r}"
    if len(source) == 0:
        raise ValueError(f"{where}: no examples")
    if field not in (example := source[0]):
        raise ValueError(f"{where}: no feature {field!r} (features: {', '.join(example)})")
    docs = grain.MapDataset.source(source)
    if shuffle:
        docs = docs.shuffle(seed)
    docs = docs.repeat(num_epochs)[process_index::process_count]
    docs = docs.map(_TokenizeExample(options.get("tokenizer", "byte"), field, where))
    return _PackWindows(docs.to_iter_dataset(read_options), seq_len + 1, seq_len)


def build_batch_iterator(data: str | os.PathLike, *, split: str, seq_len: int,
                         global_batch_size: int, seed: int, shuffle: bool = True,
                         num_epochs: int | None = None, process_index: int | None = None,
                         process_count: int | None = None, verify_checksums: bool = False,
                         num_threads: int = 2, prefetch: int = 4,
                         packing: str = "concat") -> grain.DatasetIterator:
    """This process's batches {"input_ids", "labels"}, with packing="documents" also
    "segment_ids" and "positions": int32 [B / P, T] each (see the module doc).

    `data` is a prepared directory or a "tfds:NAME?..." spec. `num_epochs=None` repeats forever;
    a finite run ends after the last full global batch. The iterator's get_state()/set_state()
    checkpoint and restore it exactly. `num_threads` read ahead up to `prefetch` batches.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if seq_len < 1 or global_batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) "
                         "must be positive")
    if global_batch_size % process_count or not 0 <= process_index < process_count:
        raise ValueError(f"global_batch_size {global_batch_size} must split evenly over "
                         f"{process_count} processes, and process_index {process_index} "
                         "be below it")
    local = global_batch_size // process_count
    to_batch = _batch_fn(packing, data, split)
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    if str(data).startswith("tfds:"):
        windows = _tfds_windows(str(data)[5:], split=split, seq_len=seq_len, seed=seed,
                                shuffle=shuffle, num_epochs=num_epochs, process_index=process_index,
                                process_count=process_count, read_options=read_options)
        return iter(windows.batch(local, drop_remainder=True).map(to_batch))
    windows = make_window_source(data, split=split, seq_len=seq_len,
                                 verify_checksums=verify_checksums)
    if shuffle:
        windows = windows.shuffle(seed)
    windows = windows.repeat(num_epochs)
    if (steps := len(windows) // global_batch_size) == 0:
        raise ValueError(f"{data}: split {split!r} has {len(windows)} windows of {seq_len + 1} "
                         f"tokens, fewer than one global batch of {global_batch_size}")
    batches = grain.MapDataset.range(steps).map(
        _GatherRows(windows, global_batch_size, process_index * local, local))
    return iter(batches.map(to_batch).to_iter_dataset(read_options))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective mix of uint64 [n] (splitmix64's finaliser): a counter-based random
    stream."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MixtureSchedule:
    """Which source each global example index g draws from, and its place in that source's
    sequence (the module doc); thread safe, deterministic in (weights, seed)."""

    CHUNK = 1 << 14  # examples per entry of the running counts

    def __init__(self, weights: Sequence[float], seed: int):
        weights = np.asarray(weights, np.float64)
        if weights.ndim != 1 or len(weights) == 0 or not (weights > 0).all():
            raise ValueError(f"mixture weights {weights.tolist()}: expected positive numbers")
        self.shares = weights / weights.sum()
        self._edges = np.cumsum(self.shares)[:-1]  # [S - 1]
        self._key = _splitmix64(np.array([seed], np.uint64))
        self._before = [np.zeros(len(weights), np.int64)]  # [chunks][S]: counts before a chunk
        self._lock = threading.Lock()

    def sources(self, start: int, stop: int) -> np.ndarray:
        """src(g) for g in [start, stop): int64 [stop - start]."""
        g = np.arange(start, stop, dtype=np.uint64)
        bits = _splitmix64(self._key + g * _GOLDEN) >> np.uint64(11)
        return np.searchsorted(self._edges, bits * 2.0**-53, side="right")

    def counts(self, start: int, stop: int) -> np.ndarray:
        """How many of the examples [start, stop) each source gives: int64 [S]."""
        return np.bincount(self.sources(start, stop), minlength=len(self.shares))

    def _counts_before(self, chunk: int) -> np.ndarray:
        with self._lock:
            while len(self._before) <= chunk:
                first = (len(self._before) - 1) * self.CHUNK
                self._before.append(self._before[-1] + self.counts(first, first + self.CHUNK))
            return self._before[chunk]

    def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(src(g), pos(g)) for g in [start, stop): int64 [stop - start] each."""
        chunk = start // self.CHUNK
        first = chunk * self.CHUNK
        src = self.sources(first, stop)
        pos = np.empty_like(src)
        for i, before in enumerate(self._counts_before(chunk)):
            mine = src == i
            pos[mine] = before + np.arange(mine.sum())
        return src[start - first:], pos[start - first:]


class _GatherMixtureRows:
    """Step s -> this process's rows of global batch s of a mixture, [L, T + 1]."""

    def __init__(self, sources: Sequence[grain.MapDataset], schedule: MixtureSchedule,
                 global_batch: int, offset: int, local_batch: int):
        self._sources, self._schedule = sources, schedule
        self._b, self._offset, self._l = global_batch, offset, local_batch

    def __call__(self, step: int) -> np.ndarray:
        first = step * self._b + self._offset
        src, pos = self._schedule.assign(first, first + self._l)
        return np.stack([self._sources[i][p] for i, p in zip(src, pos)])


def mixture_tokenizer(paths: Sequence[str | os.PathLike]) -> dict:
    """The tokenizer every source of a mixture shares, or a ValueError naming two that
    differ."""
    tokenizers = [data_tokenizer(p) for p in paths]
    for path, tok in zip(paths[1:], tokenizers[1:]):
        if tok != tokenizers[0]:
            raise ValueError(f"{path}: tokenised with {tok['name']!r} ({tok['vocab_size']} ids), "
                             f"{paths[0]} with {tokenizers[0]['name']!r} "
                             f"({tokenizers[0]['vocab_size']}): a mixture's sources must share "
                             "one tokenizer")
    return tokenizers[0]


def build_mixture_iterator(paths: Sequence[str | os.PathLike], schedule: MixtureSchedule, *,
                           split: str, seq_len: int, global_batch_size: int, seed: int,
                           process_index: int | None = None, process_count: int | None = None,
                           verify_checksums: bool = False, num_threads: int = 2,
                           prefetch: int = 4, packing: str = "concat") -> grain.DatasetIterator:
    """This process's batches of a mixture of prepared directories `paths` (one per weight of
    `schedule`), as build_batch_iterator's, forever; see the module doc."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if len(paths) != len(schedule.shares):
        raise ValueError(f"{len(paths)} mixture sources for {len(schedule.shares)} weights")
    if global_batch_size % process_count or not 0 <= process_index < process_count:
        raise ValueError(f"global_batch_size {global_batch_size} must split evenly over "
                         f"{process_count} processes, and process_index {process_index} "
                         "be below it")
    mixture_tokenizer(paths)
    sources = []
    for i, path in enumerate(paths):
        windows = make_window_source(path, split=split, seq_len=seq_len,
                                     verify_checksums=verify_checksums)
        own_seed = int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
        sources.append(windows.shuffle(own_seed).repeat(None))
    local = global_batch_size // process_count
    to_batch = _batch_fn(packing, paths[0], split)  # one tokenizer: the first's EOS is all's
    steps = len(sources[0]) // global_batch_size  # unbounded (repeat(None))
    batches = grain.MapDataset.range(steps).map(
        _GatherMixtureRows(sources, schedule, global_batch_size, process_index * local, local))
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(batches.map(to_batch).to_iter_dataset(read_options))


def build_eval_iterator(data: str | os.PathLike, *, seq_len: int, global_batch_size: int,
                        split: str = "validation", process_index: int | None = None,
                        process_count: int | None = None, verify_checksums: bool = False,
                        packing: str = "concat") -> grain.DatasetIterator:
    """One pass over `split` in order, without shuffling; windows past the last full batch
    dropped."""
    return build_batch_iterator(data, split=split, seq_len=seq_len,
                                global_batch_size=global_batch_size, seed=0, shuffle=False,
                                num_epochs=1, process_index=process_index,
                                process_count=process_count, verify_checksums=verify_checksums,
                                packing=packing)


def to_global_array(local_batch: dict[str, np.ndarray],
                    sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """Assembles each process's [L, T] arrays into global [B, T] jax.Arrays laid out by
    `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
