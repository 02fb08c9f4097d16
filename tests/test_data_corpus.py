"""The embedded default corpus: deterministic, documented, prepared once and cached."""
import json
import platform
import shutil

import pytest

from delta_jax.data.corpus import CORPUS_METADATA, build_default_corpus, default_prepared_data
from delta_jax.data.pipeline import build_batch_iterator


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, default_prepared_data(cache, seq_len=256)


def test_default_corpus_is_prepared_exactly(cache):
    _, data_dir = cache
    info = json.loads((data_dir.parent / CORPUS_METADATA).read_text())
    assert info["python"] == platform.python_version() and info["licence"].startswith("PSF")
    assert info["num_text_bytes"] > 1_500_000 and info["num_documents"] > 500
    meta = json.loads((data_dir / "metadata.json").read_text())
    assert meta["tokenizer"] == {"spec": "byte", "name": "byte", "vocab_size": 257, "eos_id": 256}
    splits = meta["splits"].values()
    documents = sum(s["num_documents"] for s in splits)
    assert documents + meta["skipped_empty_documents"] == info["num_documents"]
    assert sum(s["num_tokens"] for s in splits) == info["num_text_bytes"] + documents
    batch = next(build_batch_iterator(data_dir, split="validation", seq_len=256,
                                      global_batch_size=8, seed=0, process_index=0,
                                      process_count=1))
    assert batch["input_ids"].shape == (8, 256) and batch["input_ids"].max() <= 256


def test_cached_and_deterministic(cache, tmp_path):
    root, data_dir = cache
    stamp = (data_dir / "metadata.json").stat().st_mtime_ns
    assert default_prepared_data(root) == data_dir
    assert (data_dir / "metadata.json").stat().st_mtime_ns == stamp  # not rebuilt
    rebuilt = build_default_corpus(tmp_path)
    assert rebuilt.read_bytes() == (data_dir.parent / rebuilt.name).read_bytes()


def test_too_long_sequence_is_refused(cache):
    with pytest.raises(ValueError,
                       match=r"split 'validation' has \d+ tokens, fewer than one window"):
        default_prepared_data(cache[0], seq_len=10**6)


def test_a_builder_that_loses_the_race_reads_the_winner_s(cache, tmp_path, monkeypatch):
    """Two processes preparing the corpus at once (a multi-process first run): the one whose
    finished directory cannot replace the other's uses the other's. Linux refuses that rename
    with ENOTEMPTY, which once escaped as an error."""
    from delta_jax.data import prepare as prepare_module

    root, winner = cache
    target = tmp_path / winner.relative_to(root)
    real_find = prepare_module.find_inputs

    def find_then_lose(inputs):
        found = real_find(inputs)
        shutil.copytree(winner, target)  # the other process finishes while this one works
        return found

    monkeypatch.setattr(prepare_module, "find_inputs", find_then_lose)
    assert default_prepared_data(tmp_path) == target
    assert json.loads((target / "metadata.json").read_text()) == json.loads(
        (winner / "metadata.json").read_text())
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]  # nothing left over
