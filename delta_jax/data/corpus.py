"""The embedded default corpus: English prose that every Python installation carries.

It is built, not shipped: the docstrings of the running interpreter's standard library (module,
class and function docstrings in source order, one document per module; test packages and
site-packages left out) plus the language-reference topics of `pydoc_data.topics` (one document
per topic). On CPython 3.11.7 that is 722 documents, 2,249,613 bytes of UTF-8 text (2,250,335
byte-level tokens with the EOS; 2% of the documents held out for validation), built and prepared
in about 3.5 s on 2 cores. The exact bytes depend on the Python version and on how the
distribution packaged the standard library, so corpus.json records the version, the counts and a
SHA-256. Licence: the PSF License Agreement (PSF-2.0), like the standard library it comes from.

Two parts of it make the mixture demo's sources (configs/demo_mixture.yaml): "embedded:code",
the paragraphs that are mostly code (doctest `>>>`/`...` lines, or lines indented by 4 spaces),
and "embedded:prose", the others; a document of each part per corpus document. They are
prepared like the whole, but with 5% of their documents held out (the code part has few).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from delta_jax.data.prepare import METADATA, prepare

EMBEDDED = "embedded"  # what data.path and the tools' --data call this corpus
DEFAULT_CACHE_DIR = "data/cache"  # where it is built and prepared on first use
PARTS = ("code", "prose")  # "embedded:code", "embedded:prose"
CORPUS_FILE = "stdlib-docstrings.jsonl"
CORPUS_METADATA = "corpus.json"
LICENCE = "PSF-2.0 (Python Software Foundation License), as the CPython standard library"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of `node` and of the classes/functions inside it, in source order."""
    if (doc := ast.get_docstring(node)) is not None and doc.strip():
        yield doc
    for child in getattr(node, "body", ()):
        if isinstance(child, _DOC_NODES):
            yield from _docstrings(child)


def iter_corpus() -> Iterator[dict]:
    """The corpus's documents, {"text", "source"}, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(
        (p.relative_to(stdlib).as_posix(), p) for p in stdlib.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts))
    for name, path in modules:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):  # a distribution may ship a file this Python can't parse
            continue
        if docs := list(_docstrings(tree)):
            yield {"text": "\n\n".join(docs), "source": f"stdlib/{name}"}
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield {"text": topics[key], "source": f"pydoc_data.topics/{key}"}


def build_default_corpus(out_dir: str | os.PathLike) -> Path:
    """Writes the corpus as JSONL (field "text") plus corpus.json into `out_dir`; returns the JSONL
    path.

    Deterministic for a given Python installation; the files appear atomically.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{CORPUS_FILE}.", dir=out)
    num_documents = num_bytes = 0
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as f:
        for doc in iter_corpus():
            line = (json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            digest.update(line)
            num_documents += 1
            num_bytes += len(doc["text"].encode("utf-8"))
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / CORPUS_FILE)
    info = {"file": CORPUS_FILE, "sha256": digest.hexdigest(), "num_documents": num_documents,
            "num_text_bytes": num_bytes, "python": platform.python_version(),
            "implementation": platform.python_implementation(), "licence": LICENCE}
    (out / CORPUS_METADATA).write_text(json.dumps(info, indent=1) + "\n")
    return out / CORPUS_FILE


def is_code_paragraph(paragraph: str) -> bool:
    """Whether most of a paragraph's non-blank lines are code: a doctest line (`>>>`, `...`)
    or a line indented by 4 spaces."""
    lines = [line for line in paragraph.splitlines() if line.strip()]
    code = sum(line.lstrip().startswith((">>>", "...")) or line.startswith("    ")
               for line in lines)
    return 2 * code > len(lines)


def split_corpus(corpus: Path, out_dir: Path) -> dict[str, Path]:
    """The corpus's documents split by paragraph into its PARTS: {part: its JSONL file}, each
    written atomically (processes may split at once)."""
    files = {part: out_dir / f"{corpus.stem}-{part}.jsonl" for part in PARTS}
    parts = {part: [] for part in PARTS}
    for line in corpus.read_text("utf-8").splitlines():
        doc = json.loads(line)
        paragraphs = [p for p in doc["text"].split("\n\n") if p.strip()]
        code = [p for p in paragraphs if is_code_paragraph(p)]
        prose = [p for p in paragraphs if not is_code_paragraph(p)]
        for part, kept in zip(PARTS, (code, prose)):
            if kept:
                parts[part].append(json.dumps({"text": "\n\n".join(kept),
                                               "source": doc["source"]}, ensure_ascii=False))
    for part, path in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=out_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in parts[part])
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return files


def resolve_embedded(path: str, cache_dir: str | os.PathLike, seq_len: int | None = None
                     ) -> str | Path:
    """The prepared directory of "embedded" or "embedded:PART" (built on first use); any other
    path as it is."""
    if path == EMBEDDED:
        return default_prepared_data(cache_dir, seq_len)
    if path.startswith(EMBEDDED + ":"):
        part = path[len(EMBEDDED) + 1:]
        if part not in PARTS:
            raise ValueError(f"{path}: no such part of the embedded corpus (expected "
                             f"{', '.join(f'{EMBEDDED}:{p}' for p in PARTS)})")
        return default_prepared_data(cache_dir, seq_len, part=part)
    return path


def default_prepared_data(cache_dir: str | os.PathLike, seq_len: int | None = None,
                          part: str | None = None) -> Path:
    """The default corpus (or one of its PARTS), tokenised with the byte tokenizer, under
    `cache_dir` (built on first use).

    Safe to call from several processes at once. With `seq_len`, checks that both splits hold at
    least one window of seq_len + 1 tokens. Returns the prepared data directory.
    """
    root = Path(cache_dir) / (f"stdlib-{platform.python_implementation().lower()}"
                              f"{platform.python_version()}")
    data_dir = root / ("byte" if part is None else f"byte-{part}")
    if not (data_dir / METADATA).is_file():
        if part is None:
            corpus = build_default_corpus(root)
        else:  # the whole corpus's file, if built (atomically) already
            whole = root / CORPUS_FILE
            corpus = split_corpus(whole if whole.is_file() else build_default_corpus(root),
                                  root)[part]
        try:
            prepare([corpus], data_dir, tokenizer="byte",
                    validation_fraction=0.02 if part is None else 0.05, progress=False)
        except FileExistsError:
            if not (data_dir / METADATA).is_file():  # not a concurrent builder: a stray directory
                raise
    if seq_len is not None:
        splits = json.loads((data_dir / METADATA).read_text())["splits"]
        for split, info in splits.items():
            if info["num_tokens"] < seq_len + 1:
                raise ValueError(f"{data_dir}: split {split!r} has {info['num_tokens']} tokens, "
                                 f"fewer than one window of seq_len + 1 = {seq_len + 1}")
    return data_dir
