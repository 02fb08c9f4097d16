"""Readers of prepared shards: windows, determinism, exact resume, process slices, shard errors."""
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import grain
import jax
import numpy as np
import pytest

from delta_jax.data.pipeline import (
    IGNORE_LABEL,
    PreparedSplit,
    build_batch_iterator,
    build_eval_iterator,
    make_window_source,
    to_global_array,
)
from delta_jax.data.prepare import prepare
from delta_jax.sharding import make_mesh

REPO = Path(__file__).resolve().parents[1]
T, B = 64, 8
MODULES = ["argparse.py", "textwrap.py", "string.py", "heapq.py", "functools.py", "random.py",
           "collections/__init__.py", "json/__init__.py", "pathlib.py", "typing.py", "enum.py"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Docstrings of a few stdlib modules (real prose, ~200 KB) prepared with the byte tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("pipeline")
    with (root / "docs.jsonl").open("w") as f:
        for m in MODULES:
            for node in ast.walk(ast.parse((stdlib / m).read_text("utf-8"))):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                    continue
                if doc := ast.get_docstring(node):
                    f.write(json.dumps({"text": doc}) + "\n")
    prepare([root / "docs.jsonl"], root / "data", validation_fraction=0.1, record_tokens=4096,
            shard_tokens=4096 * 8, progress=False)
    return root / "data"


@pytest.fixture(scope="module")
def windows(data_dir):
    """Every training window [T + 1] as bytes -> its index (a precondition: all distinct)."""
    source = make_window_source(data_dir, split="train", seq_len=T)
    index = {source[i].tobytes(): i for i in range(len(source))}
    assert len(index) == len(source) > 20 * B
    return index


def _rows(batch):
    """Window bytes of each row, rebuilt from input_ids and labels."""
    assert batch["input_ids"].dtype == batch["labels"].dtype == np.int32
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    return [np.append(x, y[-1]).astype(np.int32).tobytes()
            for x, y in zip(batch["input_ids"], batch["labels"])]


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _iterator(data_dir, **kw):
    kw = dict(split="train", seq_len=T, global_batch_size=B, seed=3, process_index=0,
              process_count=1) | kw
    return build_batch_iterator(data_dir, **kw)


def test_windows_tile_the_stream(data_dir):
    split = PreparedSplit(data_dir, "train")
    stream = split.read(0, split.num_tokens)
    source = make_window_source(data_dir, split="train", seq_len=T)
    assert len(split.shards) > 1 and len(source) == (split.num_tokens - 1) // T
    stitched = np.concatenate([source[0]] + [source[i][1:] for i in range(1, len(source))])
    np.testing.assert_array_equal(stitched, stream[:len(stitched)])
    assert 0 <= split.num_tokens - len(stitched) < T  # only the documented tail is dropped


def test_epochs_are_permutations(data_dir, windows):
    batches = list(_iterator(data_dir, num_epochs=2))
    steps = 2 * len(windows) // B
    assert len(batches) == steps
    seen = [windows[r] for b in batches for r in _rows(b)]
    first, second = seen[:len(windows)], seen[len(windows):]
    assert sorted(first) == list(range(len(windows)))  # each window once per epoch
    assert first != sorted(first) and second != first[:len(second)]  # shuffled, differently


def test_same_seed_and_step_give_the_same_batch_in_a_fresh_process(data_dir):
    digest = lambda b: hashlib.sha256(b["input_ids"].tobytes() + b["labels"].tobytes()).hexdigest()
    here = [digest(b) for b in _take(_iterator(data_dir, seed=11), 6)]
    script = ("import hashlib, sys; from delta_jax.data.pipeline import build_batch_iterator as b\n"
              f"it = b(sys.argv[1], split='train', seq_len={T}, global_batch_size={B}, seed=11, "
              "process_index=0, process_count=1)\n"
              "for _ in range(6):\n x = next(it)\n"
              " print(hashlib.sha256(x['input_ids'].tobytes()"
              " + x['labels'].tobytes()).hexdigest())")
    run = subprocess.run([sys.executable, "-c", script, str(data_dir)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == here
    assert digest(next(_iterator(data_dir, seed=12))) != here[0]


def test_restore_mid_run_gives_the_uninterrupted_batches(data_dir):
    reference = _take(_iterator(data_dir), 9)
    it = _iterator(data_dir)
    _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    restored = _iterator(data_dir)
    restored.set_state(state)
    for want, got in zip(reference[4:], _take(restored, 5)):
        np.testing.assert_array_equal(want["input_ids"], got["input_ids"])
    jump = _iterator(data_dir)
    jump.set_state({"next_index": 7})  # batch s is a pure function of (seed, s)
    np.testing.assert_array_equal(next(jump)["labels"], reference[7]["labels"])


@pytest.mark.parametrize("processes", [2, 4])
def test_process_slices_are_disjoint_and_cover_the_global_batch(data_dir, processes):
    whole = _take(_iterator(data_dir), 5)
    slices = [_take(_iterator(data_dir, process_index=p, process_count=processes), 5)
              for p in range(processes)]
    for step, batch in enumerate(whole):
        rows = [_rows(s[step]) for s in slices]
        assert all(len(r) == B // processes for r in rows)
        # in order: the same global batch for any process count
        assert sum(rows, []) == _rows(batch)
        assert len(set(sum(rows, []))) == B


def test_eval_iterator_is_ordered_and_finite(data_dir):
    source = make_window_source(data_dir, split="validation", seq_len=T)
    for p in range(2):
        batches = list(build_eval_iterator(data_dir, seq_len=T, global_batch_size=B,
                                           process_index=p, process_count=2))
        assert len(batches) == len(source) // B > 0
        for s, batch in enumerate(batches):
            want = [source[s * B + p * B // 2 + j].tobytes() for j in range(B // 2)]
            assert _rows(batch) == want


def test_to_global_array(data_dir):
    batch = next(_iterator(data_dir))
    mesh = make_mesh(data=-1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    arrays = to_global_array(batch, sharding)
    for key in ("input_ids", "labels"):
        assert arrays[key].shape == (B, T) and arrays[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(arrays[key]), batch[key])


def test_concat_packing_is_the_plain_windows(data_dir):
    """data.packing=concat gives exactly input_ids = window[:-1], labels = window[1:]: the
    batches of every run before packing existed."""
    source = make_window_source(data_dir, split="train", seq_len=T)
    order = list(grain.MapDataset.source(source).shuffle(3))
    for step, batch in enumerate(_take(_iterator(data_dir, packing="concat"), 3)):
        assert sorted(batch) == ["input_ids", "labels"]
        windows = np.stack([order[step * B + j] for j in range(B)])
        np.testing.assert_array_equal(batch["input_ids"], windows[:, :-1])
        np.testing.assert_array_equal(batch["labels"], windows[:, 1:])
        assert batch["input_ids"].dtype == batch["labels"].dtype == np.int32


@pytest.mark.parametrize("split", ["train", "validation"])
def test_documents_packing_follows_the_eos(data_dir, split):
    """The same windows in the same order; segments start at each window and after every EOS,
    positions count from there, and the label of an EOS input (the next document's first
    token) is ignored."""
    eos = PreparedSplit(data_dir, split).metadata["tokenizer"]["eos_id"]
    kw = dict(split=split, seed=0, shuffle=False, num_epochs=1)
    concat = list(_iterator(data_dir, **kw, packing="concat"))
    documents = list(_iterator(data_dir, **kw, packing="documents"))
    assert len(concat) == len(documents) > 3
    seen_eos = 0
    for plain, packed in zip(concat, documents):
        assert sorted(packed) == ["input_ids", "labels", "positions", "segment_ids"]
        assert all(v.dtype == np.int32 and v.shape == (B, T) for v in packed.values())
        np.testing.assert_array_equal(packed["input_ids"], plain["input_ids"])
        is_eos = plain["input_ids"] == eos
        np.testing.assert_array_equal(packed["labels"],
                                      np.where(is_eos, IGNORE_LABEL, plain["labels"]))
        for ids, segments, positions in zip(plain["input_ids"], packed["segment_ids"],
                                            packed["positions"]):
            ends = np.flatnonzero(ids == eos)
            starts = np.concatenate([[0], ends[ends < T - 1] + 1])
            np.testing.assert_array_equal(segments, np.searchsorted(starts, np.arange(T),
                                                                    side="right") - 1)
            np.testing.assert_array_equal(positions, np.arange(T) - starts[segments])
            seen_eos += len(ends)
    assert seen_eos > 20  # the windows do hold several documents


def test_documents_packing_resumes_mid_run(data_dir):
    reference = _take(_iterator(data_dir, packing="documents"), 6)
    restored = _iterator(data_dir, packing="documents")
    restored.set_state({"next_index": 4})
    for want, got in zip(reference[4:], _take(restored, 2)):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_bad_arguments(data_dir, tmp_path):
    with pytest.raises(ValueError, match="packing='docs' is invalid: expected one of concat, "
                                         "documents"):
        _iterator(data_dir, packing="docs")
    with pytest.raises(ValueError, match="global_batch_size 8 must split evenly over 3 processes"):
        _iterator(data_dir, process_count=3)
    with pytest.raises(ValueError, match="fewer than one global batch of 4096"):
        _iterator(data_dir, global_batch_size=4096, num_epochs=1)
    with pytest.raises(ValueError, match="no split 'test'"):
        _iterator(data_dir, split="test")
    prepare([REPO / "tests/data/udhr_article1.txt"], tmp_path / "d", validation_fraction=0,
            progress=False)
    with pytest.raises(ValueError, match=r"metadata.json: split 'validation' is empty"):
        build_eval_iterator(tmp_path / "d", seq_len=T, global_batch_size=B)
    with pytest.raises(FileNotFoundError, match="nowhere/metadata.json: missing"):
        _iterator(tmp_path / "nowhere")


def _damaged(data_dir, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    shard = copy / "train" / "shard-00001.array_record"
    damage(shard)
    return copy, shard


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # inside the first chunk (the file ends in padding and an index)
    path.write_bytes(bytes(data))


def test_missing_shard(data_dir, tmp_path):
    copy, shard = _damaged(data_dir, tmp_path, os.remove)
    with pytest.raises(FileNotFoundError, match=f"{shard}: missing"):
        _iterator(copy)


def test_truncated_shard(data_dir, tmp_path):
    copy, shard = _damaged(data_dir, tmp_path, lambda p: os.truncate(p, p.stat().st_size - 100))
    size = shard.stat().st_size
    with pytest.raises(ValueError, match=rf"{shard}: truncated or altered \(metadata says "
                                         rf"{size + 100} bytes, file has {size}\)"):
        _iterator(copy)


def test_checksum_mismatch(data_dir, tmp_path):
    copy, shard = _damaged(data_dir, tmp_path, _flip_byte)
    metadata = json.loads((copy / "metadata.json").read_text())
    want = metadata["splits"]["train"]["shards"][1]["sha256"]
    have = hashlib.sha256(shard.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=f"{shard}: checksum mismatch \\(metadata says sha256 "
                                         f"{want}, file has {have}\\)"):
        _iterator(copy, verify_checksums=True)
    # Unverified, ArrayRecord's own chunk hashes still stop the damaged record from being read.
    source = make_window_source(copy, split="train", seq_len=T)
    with pytest.raises(ValueError, match=f"{shard}: record .*: unreadable"):
        [source[i] for i in range(len(source))]
    run = subprocess.run([sys.executable, "-m", "delta_jax.data", "verify", str(copy)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "checksum mismatch" in run.stderr
