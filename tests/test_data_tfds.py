"""A TFDS dataset in ArrayRecord format, built here without TensorFlow, read through
build_batch_iterator."""
from pathlib import Path

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from delta_jax.data.pipeline import build_batch_iterator
from delta_jax.data.tokenizers import get_tokenizer

T, B = 32, 4
PARAGRAPHS = [p for p in (Path(__file__).parent / "data/udhr_article1.txt").read_text("utf-8")
              .split("\n\n") if p]
# Numbered documents, one much longer than a window, so that windows cross and split documents.
DOCS = [f"[doc {i}] {PARAGRAPHS[i % len(PARAGRAPHS)]}" * (12 if i == 5 else 1) for i in range(40)]


class TinyDocs(tfds.core.GeneratorBasedBuilder):
    """Real sentences in several scripts, one example per document."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "id": tfds.features.Scalar(np.int32)}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(DOCS[:30]),
                "validation": self._generate_examples(DOCS[30:])}

    def _generate_examples(self, docs):
        for text in docs:
            yield text, {"text": text, "id": DOCS.index(text)}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyDocs(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    assert list(data_dir.rglob("*.array_record-*"))
    return f"tfds:tiny_docs?data_dir={data_dir}&tokenizer=byte"


def _batches(spec, n=None, **kw):
    kw = dict(split="train", seq_len=T, global_batch_size=B, seed=5, process_index=0,
              process_count=1) | kw
    it = build_batch_iterator(spec, **kw)
    return it, (list(it) if n is None else [next(it) for _ in range(n)])


def _stream(batches):
    """The token stream the windows were cut from (consecutive windows share one token)."""
    rows = [np.append(x, y[-1]) for b in batches for x, y in zip(b["input_ids"], b["labels"])]
    return np.concatenate([rows[0]] + [r[1:] for r in rows[1:]])


def _documents(stream):
    """Texts of the documents that end (with EOS) in `stream`."""
    parts = np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
    return [get_tokenizer("byte").decode(part[:-1]) for part in parts]


def test_packing_keeps_every_token_in_order(spec):
    _, batches = _batches(spec, shuffle=False, num_epochs=1)
    data_dir = spec.split("data_dir=")[1].split("&")[0]
    source = tfds.data_source("tiny_docs", split="train", data_dir=data_dir)
    expected = np.concatenate([np.append(list(source[i]["text"]), 256) for i in range(len(source))])
    stream = _stream(batches)
    assert batches[0]["input_ids"].shape == (B, T) and batches[0]["labels"].dtype == np.int32
    np.testing.assert_array_equal(stream, expected[:len(stream)])
    assert len(expected) - len(stream) < B * T + T  # dropped: the tail of the last batch only


def test_same_seed_same_batches_and_exact_restore(spec, tmp_path):
    _, reference = _batches(spec, 12)
    it, first = _batches(spec, 5)
    for want, got in zip(reference, first):
        np.testing.assert_array_equal(want["input_ids"], got["input_ids"])
    # restarts mid-document, from a document index and an offset
    assert it.get_state()["offset"] > 0
    grain.checkpoint.CheckpointHandler().save(tmp_path, it)  # what the Orbax checkpoint holds
    restored = grain.checkpoint.CheckpointHandler().restore(tmp_path, _batches(spec, 0)[0])
    for want in reference[5:]:
        np.testing.assert_array_equal(want["labels"], next(restored)["labels"])
    _, other_seed = _batches(spec, 1, seed=6)
    assert not np.array_equal(other_seed[0]["input_ids"], reference[0]["input_ids"])


def test_process_slices_are_disjoint_and_cover(spec):
    seen = []
    for p in range(2):
        _, batches = _batches(spec, process_index=p, process_count=2, num_epochs=1)
        assert batches[0]["input_ids"].shape == (B // 2, T)
        docs = _documents(_stream(batches))  # a stream starts at a document boundary
        assert len(set(docs)) == len(docs)
        seen.append(set(docs))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(DOCS[:30]) and len(seen[0] | seen[1]) >= 30 - 2 * 3


def test_tfds_errors(spec):
    with pytest.raises(ValueError,
                       match=r"split 'train': no feature 'body' \(features: id, text\)"):
        _batches(spec + "&text_field=body", 1)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tokeniser'\]"):
        _batches(spec + "&tokeniser=byte", 1)
