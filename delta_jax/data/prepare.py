"""Text, JSONL and Parquet files -> tokenised ArrayRecord shards
(`python -m delta_jax.data prepare`).

Inputs: .txt/.md (one document per file), .jsonl (one per line, the string field `text_field`),
.parquet (one per row, the string column `text_field`; a FineWeb-Edu download is such files).
A directory stands for every such file below it, in sorted order. Empty documents are skipped
(and counted); an empty file is an error.

Output format (version 1) of DIR:
  metadata.json                      tokenizer, dtype, record_tokens, and per split:
                                     num_documents, num_tokens (EOS included), num_records,
                                     shards (file, num_records, num_tokens, num_bytes, sha256)
  {train,validation}/shard-NNNNN.array_record
Each split is ONE token stream: every document's tokens followed by the tokenizer's EOS id,
documents in input order. The stream is cut into records of `record_tokens` consecutive tokens,
stored as little-endian `dtype` (uint16 when the vocabulary fits, else uint32); every record but
the split's last is full, so token t lives in record t // record_tokens, and a reader can cut
windows of any length at any offset. A shard holds `shard_records` records (the last, fewer).
ArrayRecord group_size 1 (zstd), so each record is one random read.

The validation split is held out by document: a document goes to validation iff the first 8
bytes of blake2b(its UTF-8 text), as a fraction of 2**64, are below `validation_fraction`. This is
stable under reordering or resharding the inputs, and duplicates land in the same split.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from delta_jax.data.tokenizers import Tokenizer, get_tokenizer, token_dtype

FORMAT = "delta_jax.tokens/1"
METADATA = "metadata.json"
SPLITS = ("train", "validation")
TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
_BATCH_BYTES = 1 << 20  # text per tokenisation task: large enough to amortise inter-process copies


def find_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The input files named by `paths` (files, or directories searched recursively, sorted)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: no {'/'.join(SUFFIXES)} files in this directory")
            files += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ValueError(f"{p}: unsupported file type {p.suffix!r} "
                                 f"(expected one of {SUFFIXES})")
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return files


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: invalid UTF-8 at byte {e.start} ({e.reason})") from None


def iter_documents(path: Path, text_field: str = "text") -> Iterator[tuple[str, float]]:
    """Yields (document text, bytes of `path` it accounts for) -- the latter drives the progress
    bar."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: empty file")
    if path.suffix in TEXT_SUFFIXES:
        yield _decode(path.read_bytes(), str(path)), size
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    else:
        yield from _iter_parquet(path, text_field, size)


def _iter_jsonl(path: Path, field: str) -> Iterator[tuple[str, float]]:
    seen = False
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            if not line.strip():
                continue
            try:
                record = json.loads(_decode(line, where))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if field not in record:
                raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(record)})")
            if not isinstance(text := record[field], str):
                raise ValueError(f"{where}: field {field!r} is {type(text).__name__}, "
                                 "expected a string")
            seen = True
            yield text, len(line)
    if not seen:
        raise ValueError(f"{path}: empty file (no JSON lines)")


def _iter_parquet(path: Path, field: str, size: int) -> Iterator[tuple[str, float]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise ValueError(f"{path}: column {field!r} has type {kind}, expected a string")
    if (rows := pf.metadata.num_rows) == 0:
        raise ValueError(f"{path}: empty file (no rows)")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        # Read as bytes and decode ourselves, so that bad UTF-8 is reported with its row.
        for value in batch.column(0).cast(pa.large_binary()).to_pylist():
            if value is None:
                raise ValueError(f"{path}: row {row}: {field!r} is null")
            yield _decode(value, f"{path}: row {row}"), size / rows
            row += 1


def _batches(files: Sequence[Path], text_field: str) -> Iterator[tuple[list[str], float]]:
    texts, nbytes, held = [], 0.0, 0
    for path in files:
        for text, consumed in iter_documents(path, text_field):
            texts.append(text)
            nbytes += consumed
            held += len(text)
            if held >= _BATCH_BYTES:
                yield texts, nbytes
                texts, nbytes, held = [], 0.0, 0
    if texts:
        yield texts, nbytes


def in_validation(text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split (see the module docstring)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def tokenize_documents(tok: Tokenizer, texts: Sequence[str], validation_fraction: float) -> dict:
    """Tokens of `texts`, each followed by EOS, concatenated per split.

    Returns {"train"/"validation": (tokens [n] of the storage dtype, num_documents), "empty": k}.
    """
    dtype, eos = token_dtype(tok.vocab_size), np.array([tok.eos_id])
    docs = {split: [] for split in SPLITS}
    for text in texts:
        if text:
            docs["validation" if in_validation(text, validation_fraction) else "train"].append(text)
    out = {"empty": len(texts) - sum(map(len, docs.values()))}
    for split, split_docs in docs.items():
        arrays = [a for text in split_docs for a in (tok.encode_array(text), eos)]
        out[split] = (np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype),
                      len(split_docs))
    return out


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = get_tokenizer(spec)


def _worker_tokenize(texts: list[str], validation_fraction: float) -> dict:
    return tokenize_documents(_WORKER_TOKENIZER, texts, validation_fraction)


def _tokenized(batches, spec: str, fraction: float, workers: int) -> Iterator[tuple[dict, float]]:
    """Tokenised batches in input order; `workers` processes (0: in this one)."""
    if workers == 0:
        tok = get_tokenizer(spec)
        for texts, nbytes in batches:
            yield tokenize_documents(tok, texts, fraction), nbytes
        return
    # spawn, not fork: the caller may have started JAX's threads. At most 2 tasks per worker in
    # flight, so memory stays bounded however large the input.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(spec,)) as pool:
        pending = collections.deque()
        for texts, nbytes in batches:
            pending.append((pool.submit(_worker_tokenize, texts, fraction), nbytes))
            if len(pending) >= 2 * workers:
                future, n = pending.popleft()
                yield future.result(), n
        for future, n in pending:
            yield future.result(), n


class _SplitWriter:
    """Cuts one split's token stream into full records and rolls shards (see the module
    docstring)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, record_tokens: int,
                 shard_records: int):
        self._root, self._split = root, split
        self._dtype = dtype.newbyteorder("<")
        self._record_tokens, self._shard_records = record_tokens, shard_records
        self._pending, self._pending_len = [], 0
        self._writer, self._shard = None, None
        self.shards: list[dict] = []
        self.num_documents = self.num_tokens = 0

    def write(self, tokens: np.ndarray, num_documents: int) -> None:
        self.num_documents += num_documents
        self.num_tokens += len(tokens)
        self._pending.append(tokens)
        self._pending_len += len(tokens)
        if self._pending_len >= self._record_tokens:
            stream = np.concatenate(self._pending)
            full = len(stream) - len(stream) % self._record_tokens
            for start in range(0, full, self._record_tokens):
                self._write_record(stream[start:start + self._record_tokens])
            self._pending, self._pending_len = [stream[full:]], len(stream) - full

    def _write_record(self, tokens: np.ndarray) -> None:
        if self._writer is None:
            name = f"{self._split}/shard-{len(self.shards):05d}.array_record"
            (self._root / name).parent.mkdir(exist_ok=True)
            self._writer = ArrayRecordWriter(str(self._root / name), "group_size:1")
            self._shard = {"file": name, "num_records": 0, "num_tokens": 0}
        self._writer.write(tokens.astype(self._dtype, copy=False).tobytes())
        self._shard["num_records"] += 1
        self._shard["num_tokens"] += len(tokens)
        if self._shard["num_records"] == self._shard_records:
            self._close_shard()

    def _close_shard(self) -> None:
        self._writer.close()
        path = self._root / self._shard["file"]
        with path.open("rb") as f:
            self._shard |= {"num_bytes": path.stat().st_size,
                            "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        self.shards.append(self._shard)
        self._writer = self._shard = None

    def close(self) -> dict:
        """Writes the last (partial) record; returns this split's metadata."""
        if self._pending_len:
            self._write_record(np.concatenate(self._pending))
        if self._writer is not None:
            self._close_shard()
        return {"num_documents": self.num_documents, "num_tokens": self.num_tokens,
                "num_records": sum(s["num_records"] for s in self.shards), "shards": self.shards}


def prepare(inputs: Sequence[str | os.PathLike], output_dir: str | os.PathLike, *,
            tokenizer: str = "byte", validation_fraction: float = 0.01, text_field: str = "text",
            record_tokens: int = 8192, shard_tokens: int = 1 << 26, workers: int = 0,
            progress: bool = True) -> dict:
    """Tokenises `inputs` into `output_dir` (which must not exist or be empty); returns the
    metadata.

    inputs: files or directories (module docstring). tokenizer: a `get_tokenizer` spec.
    record_tokens: tokens per record, the unit of a random read. shard_tokens: tokens per file.
    workers: tokenising processes, 0 for this one; they are spawned, so a script calling this
    with workers > 0 needs the usual `if __name__ == "__main__":` guard. The output appears
    atomically: it is written beside `output_dir` and renamed into place last.
    """
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if record_tokens < 1 or shard_tokens < record_tokens:
        raise ValueError("need 1 <= record_tokens <= shard_tokens, "
                         f"got {record_tokens}, {shard_tokens}")
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; choose a new output")
    files = find_inputs(inputs)
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would otherwise become the dataset's mode
    try:
        writers = {s: _SplitWriter(tmp, s, dtype, record_tokens, shard_tokens // record_tokens)
                   for s in SPLITS}
        empty = 0
        with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                  desc=f"prepare ({tok.name})", disable=not progress) as bar:
            for result, nbytes in _tokenized(_batches(files, text_field), tokenizer,
                                             validation_fraction, workers):
                for split, writer in writers.items():
                    writer.write(*result[split])
                empty += result["empty"]
                bar.update(nbytes)
                bar.set_postfix(tokens=writers["train"].num_tokens
                                + writers["validation"].num_tokens)
        splits = {s: w.close() for s, w in writers.items()}
        if splits["train"]["num_tokens"] == 0:
            raise ValueError(f"no non-empty training document in {[str(f) for f in files]}")
        metadata = {
            "format": FORMAT,
            "tokenizer": {"spec": tokenizer, "name": tok.name, "vocab_size": tok.vocab_size,
                          "eos_id": tok.eos_id},
            "dtype": dtype.name, "record_tokens": record_tokens,
            "shard_records": shard_tokens // record_tokens,
            "validation_fraction": validation_fraction, "text_field": text_field,
            "inputs": [str(f) for f in files], "skipped_empty_documents": empty, "splits": splits,
        }
        (tmp / METADATA).write_text(json.dumps(metadata, indent=1) + "\n")
        try:
            os.rename(tmp, out)  # replaces an empty directory
        except OSError as e:  # Linux says ENOTEMPTY where another writer got there first
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise FileExistsError(f"{out}: another writer finished it first") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return metadata
