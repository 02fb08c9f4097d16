"""`prepare`: exact token accounting on real files, the held-out split, the CLI, bad inputs."""
import ast
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_jax.data.pipeline import PreparedSplit
from delta_jax.data.prepare import in_validation, prepare

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
OPTIONS = dict(validation_fraction=0.3, record_tokens=1000, shard_tokens=5000)  # many shards


def _module_docstrings(*modules):
    return [ast.get_docstring(ast.parse((STDLIB / m).read_text("utf-8"))) for m in modules]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Real files of each kind; returns (paths, the non-empty documents in input order)."""
    root = tmp_path_factory.mktemp("inputs")
    texts = [(REPO / "tests/data/udhr_article1.txt").read_text("utf-8"),
             (STDLIB / "textwrap.py").read_text("utf-8")]
    for name, text in zip(["a_udhr.txt", "b_textwrap.txt"], texts):
        (root / name).write_text(text, encoding="utf-8")
    jsonl = _module_docstrings("json/__init__.py", "argparse.py", "string.py")
    with (root / "c_docs.jsonl").open("w", encoding="utf-8") as f:
        for i, text in enumerate(jsonl + [""]):  # an empty document: skipped, counted
            f.write(json.dumps({"id": i, "text": text}) + "\n\n")
    parquet = _module_docstrings("collections/__init__.py", "heapq.py", "functools.py", "random.py")
    pq.write_table(pa.table({"text": parquet, "n": range(4)}), root / "d_docs.parquet",
                   row_group_size=2)
    return sorted(root.iterdir()), texts + jsonl + parquet


@pytest.fixture(scope="module")
def prepared(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "out"
    return out, prepare(inputs[0], out, tokenizer="byte", progress=False, **OPTIONS)


def test_no_token_lost_or_invented(inputs, prepared):
    _, docs = inputs
    out, meta = prepared
    splits = meta["splits"]
    assert meta["skipped_empty_documents"] == 1
    assert sum(s["num_documents"] for s in splits.values()) == len(docs) == 9
    assert sum(s["num_tokens"] for s in splits.values()) == sum(len(d.encode()) + 1 for d in docs)
    for split, info in splits.items():
        held = [d for d in docs
                if in_validation(d, OPTIONS["validation_fraction"]) == (split == "validation")]
        assert 0 < len(held) < len(docs)
        expected = b"".join(d.encode() + b"\0" for d in held)  # \0 marks EOS (256) below
        stream = PreparedSplit(out, split, verify_checksums=True).read(0, info["num_tokens"])
        assert (stream % 256).astype(np.uint8).tobytes() == expected
        assert (stream == 256).sum() == len(held) and stream.max() == 256
        assert info["num_records"] == -(-info["num_tokens"] // 1000)
        assert len(info["shards"]) == -(-info["num_records"] // 5)


def test_directory_input_equals_its_sorted_files(inputs, prepared, tmp_path):
    meta = prepare([inputs[0][0].parent], tmp_path / "out", progress=False, **OPTIONS)
    assert meta["splits"] == prepared[1]["splits"]


def test_cli_with_worker_processes_matches_in_process(inputs, prepared, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "delta_jax.data", "prepare", "--input", *map(str, inputs[0]),
           "--output", str(out), "--workers", "2", "--record-tokens", "1000",
           "--shard-tokens", "5000", "--validation-fraction", "0.3"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout and "prepare (byte)" in run.stderr  # summary and progress bar
    assert json.loads((out / "metadata.json").read_text()) == prepared[1]  # shard checksums too
    helped = subprocess.run(cmd[:4] + ["--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--validation-fraction" in helped.stdout


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), path)


BAD_INPUTS = {
    "empty.txt": (lambda p: p.write_bytes(b""), "empty.txt: empty file"),
    "bad.txt": (lambda p: p.write_bytes(b"fine \xff\xfe"), r"bad.txt: invalid UTF-8 at byte 5"),
    "blank.jsonl": (lambda p: p.write_text("\n\n"), r"blank.jsonl: empty file \(no JSON lines\)"),
    "bad_utf8.jsonl": (lambda p: p.write_bytes(b'{"text": "ok"}\n{"text": "\xc3("}\n'),
                       r"bad_utf8.jsonl:2: invalid UTF-8 at byte 10"),
    "no_field.jsonl": (lambda p: p.write_text('{"text": "ok"}\n{"body": "x", "id": 1}\n'),
                       r"no_field.jsonl:2: no field 'text' \(fields: body, id\)"),
    "not_json.jsonl": (lambda p: p.write_text('{"text": "ok"}\n{"text": \n'),
                       r"not_json.jsonl:2: invalid JSON"),
    "number.jsonl": (lambda p: p.write_text('{"text": 3}\n'),
                     r"number.jsonl:1: field 'text' is int, expected a string"),
    "no_column.parquet": (lambda p: _parquet(p, body=["x"]),
                          r"no_column.parquet: no column 'text' \(columns: body\)"),
    "no_rows.parquet": (lambda p: _parquet(p, text=pa.array([], pa.string())),
                        r"no_rows.parquet: empty file \(no rows\)"),
    "null.parquet": (lambda p: _parquet(p, text=["a", None]),
                     r"null.parquet: row 1: 'text' is null"),
    "binary.parquet": (lambda p: _parquet(p, text=[b"\xff"]),
                       r"binary.parquet: row 0: invalid UTF-8 at byte 0"),
    "ints.parquet": (lambda p: _parquet(p, text=[1, 2]),
                     r"ints.parquet: column 'text' has type int64"),
    "garbage.parquet": (lambda p: p.write_bytes(b"not parquet at all"),
                        r"garbage.parquet: not a readable Parquet file"),
    "notes.csv": (lambda p: p.write_text("a,b\n"), r"notes.csv: unsupported file type '.csv'"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_names_file_and_fault(name, tmp_path):
    make, message = BAD_INPUTS[name]
    make(tmp_path / name)
    with pytest.raises(ValueError, match=message):
        prepare([tmp_path / name], tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no output, no temporary left


def test_missing_input_and_existing_output(tmp_path, inputs):
    with pytest.raises(FileNotFoundError, match="nothing.txt: no such file or directory"):
        prepare([tmp_path / "nothing.txt"], tmp_path / "out", progress=False)
    (tmp_path / "out").mkdir()
    shutil.copy(inputs[0][0], tmp_path / "out" / "keep.txt")
    with pytest.raises(FileExistsError, match="out: exists and is not an empty directory"):
        prepare(inputs[0][:1], tmp_path / "out", progress=False)
