"""Perplexity and bits per byte: by-hand values, strided windows, every data source, the CLI."""
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from delta_jax import ModelConfig, init_model
from delta_jax.checkpoint import save_checkpoint
from delta_jax.data.corpus import default_prepared_data
from delta_jax.data.prepare import prepare
from delta_jax.data.tokenizers import get_tokenizer
from delta_jax.eval import TokenStream, perplexity, read_stream, window_starts
from delta_jax.eval.__main__ import main

TEXT = Path(__file__).parent / "data" / "udhr_article1.txt"
BYTE = get_tokenizer("byte")
T = 32


@pytest.fixture(scope="module")
def model():
    # vocab 264 holds the byte tokenizer's 257 ids.
    return init_model(ModelConfig.tiny(vocab_size=264, residual="delta", init_std=0.2), seed=0)


@pytest.fixture(scope="module")
def forward(model):
    return jax.jit(model.__call__)


def test_text_file_stream_is_documents_then_eos():
    stream = read_stream([TEXT], tokenizer=BYTE)  # one document per text file
    text = TEXT.read_text("utf-8")
    np.testing.assert_array_equal(stream.tokens, [*text.encode("utf-8"), BYTE.eos_id])
    assert len(read_stream([TEXT], tokenizer=BYTE, max_tokens=50).tokens) == 50


def test_single_window_equals_exp_mean_nll_of_the_forward_pass(model, forward):
    stream = read_stream([TEXT], tokenizer=BYTE, max_tokens=60)
    result = perplexity(model, stream, seq_len=4096)
    tokens = stream.tokens
    logits = np.asarray(forward(tokens[None, :-1]), np.float64)[0]
    nll = np.logaddexp.reduce(logits, axis=-1) - logits[np.arange(59), tokens[1:]]
    assert result["tokens"] == 59 and result["windows"] == 1 and result["seq_len"] == 59
    np.testing.assert_allclose(result["perplexity"], math.exp(nll.mean()), rtol=1e-5)
    assert result["bytes"] == 59
    np.testing.assert_allclose(result["bits_per_byte"], nll.sum() / (math.log(2) * 59),
                               rtol=1e-5)


@pytest.mark.parametrize("stride", [T, 12])
def test_windows_score_every_token_once_with_enough_context(model, forward, stride):
    """By hand: token i is scored by the first window that reaches it, from that window's start."""
    stream = read_stream([TEXT], tokenizer=BYTE, max_tokens=100)
    tokens = stream.tokens
    result = perplexity(model, stream, seq_len=T, stride=stride, batch_size=2)
    total, scored, first = 0.0, np.zeros(len(tokens), int), 1
    for start in range(0, len(tokens) - 1, stride):
        window = np.zeros(T, np.int32)  # right padding cannot change causal logits
        inputs = tokens[start:start + T]
        window[:len(inputs)] = inputs
        logits = np.asarray(forward(window[None]), np.float64)[0]
        stop = min(start + T + 1, len(tokens))
        for i in range(first, stop):
            assert i - start >= min(i, T - stride + 1)  # context of at least T - stride tokens
            total += np.logaddexp.reduce(logits[i - start - 1]) - logits[i - start - 1, tokens[i]]
            scored[i] += 1
        first = max(first, stop)
        if stop == len(tokens):
            break
    np.testing.assert_array_equal(scored[1:], 1)
    assert result["tokens"] == len(tokens) - 1 == 99
    assert result["windows"] == len(window_starts(len(tokens), T, stride))
    np.testing.assert_allclose(result["nll"], total / 99, rtol=1e-5)


def test_stride_changes_the_windows_not_the_scored_tokens(model):
    stream = read_stream([TEXT], tokenizer=BYTE, max_tokens=400)
    disjoint = perplexity(model, stream, seq_len=T)
    strided = perplexity(model, stream, seq_len=T, stride=4)
    assert disjoint["windows"] == math.ceil(399 / T) and strided["tokens"] == 399
    assert strided["windows"] > disjoint["windows"]
    assert strided["nll"] != disjoint["nll"]


def test_prepared_directory_scores_like_the_text_file(model, tmp_path):
    data = tmp_path / "prepared"
    prepare([TEXT], data, tokenizer="byte", validation_fraction=0.0, record_tokens=100,
            progress=False)
    stream = read_stream([data], split="train")
    assert stream.tokenizer.name == "byte"
    np.testing.assert_array_equal(stream.tokens, read_stream([TEXT], tokenizer=BYTE).tokens)
    a = perplexity(model, stream, seq_len=64)
    b = perplexity(model, read_stream([TEXT], tokenizer=BYTE), seq_len=64)
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-6) and a["bytes"] == b["bytes"]
    assert b["bytes"] == len(TEXT.read_text("utf-8").encode("utf-8")) - 1  # the first is context


def test_tfds_dataset_through_the_pipeline(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    paragraphs = [p for p in TEXT.read_text("utf-8").split("\n\n") if p]
    docs = [f"[{i}] {paragraphs[i % len(paragraphs)]}" for i in range(30)]

    class EvalDocs(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"validation": self._generate_examples()}

        def _generate_examples(self):
            for i, text in enumerate(docs):
                yield i, {"text": text}

    EvalDocs(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    stream = read_stream([f"tfds:eval_docs?data_dir={tmp_path}&tokenizer=byte"])
    total = sum(len(d.encode("utf-8")) + 1 for d in docs)
    # Whole 256-token chunks of the stream (plus one token) come through: documents + EOS, in
    # TFDS's stored order.
    assert len(stream.tokens) == (total - 1) // 256 * 256 + 1
    complete = BYTE.decode(stream.tokens).split("<|endoftext|>")[:-1]
    assert len(complete) >= 25 and set(complete) <= set(docs)
    assert len(set(complete)) == len(complete)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("eval") / "ckpt"
    save_checkpoint(model, path)
    return path


def test_cli_json(checkpoint, model, tmp_path, capsys):
    output = tmp_path / "ppl.json"
    result = main(["--model", str(checkpoint), "--data", str(TEXT), "--tokenizer", "byte",
                   "--seq-len", "64", "--stride", "32", "--max-tokens", "150",
                   "--output", str(output)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(output.read_text()) == json.loads(json.dumps(result))
    expected = perplexity(model, read_stream([TEXT], tokenizer=BYTE, max_tokens=150),
                          seq_len=64, stride=32)
    assert printed["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6)
    assert printed["tokens"] == 149 and printed["stride"] == 32


def test_cli_reads_a_checkpoint_without_orbax_read_only_warnings(checkpoint):
    """Each read-only checkpoint manager made Orbax print three WARNINGs (read_only=True,
    setting ...; Given directory is read only=...), six per model read; none is left."""
    done = subprocess.run([sys.executable, "-m", "delta_jax.eval", "--model", str(checkpoint),
                           "--data", str(TEXT), "--tokenizer", "byte", "--seq-len", "32",
                           "--max-tokens", "64"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["tokens"] == 63
    assert "read_only" not in done.stderr and "read only" not in done.stderr, done.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/missing", "--data", str(TEXT)], "no such model directory"),
    (["--model", "{ckpt}", "--data", str(TEXT)], "text files need a tokenizer"),
    (["--model", "{ckpt}", "--data", "{tmp}/none.txt", "--tokenizer", "byte"],
     "no such file or directory"),
    (["--model", "{ckpt}", "--data", str(TEXT), "--tokenizer", "byte", "--stride", "0"],
     "--stride=0"),
    (["--model", "{ckpt}", "--data", str(TEXT), "--tokenizer", "qwen3"],
     "outside the model's vocabulary"),
])
def test_cli_bad_input_exits_2(checkpoint, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, ckpt=checkpoint) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_documents_packing_scores_each_document_as_if_alone(model):
    """Three documents in one window: with packing="documents" the summed NLL is the sum of each
    document scored alone (the token after each EOS, the next document's first, unscored), and
    it differs from concat, where the documents see each other."""
    texts = ["All human beings are born free.", "They are endowed with reason.", "Article 2."]
    docs = [np.append(BYTE.encode_array(t), BYTE.eos_id).astype(np.int32) for t in texts]
    stream = TokenStream(np.concatenate(docs), BYTE, "three documents")
    packed = perplexity(model, stream, seq_len=4096, packing="documents")
    alone = [perplexity(model, TokenStream(d, BYTE, "one"), seq_len=4096) for d in docs]
    assert packed["tokens"] == sum(r["tokens"] for r in alone) == len(stream.tokens) - 3
    np.testing.assert_allclose(packed["nll"] * packed["tokens"],
                               sum(r["nll"] * r["tokens"] for r in alone), rtol=1e-5)
    concat = perplexity(model, stream, seq_len=4096)
    assert concat["tokens"] == len(stream.tokens) - 1 and concat["nll"] != packed["nll"]
    with pytest.raises(ValueError, match="packing='documents' needs the tokenizer"):
        perplexity(model, TokenStream(stream.tokens, None, "no tokenizer"), packing="documents")


def test_cli_reads_the_embedded_corpus_with_the_run_s_packing(model, tmp_path, monkeypatch,
                                                              capsys):
    """--data embedded is the trainer's default corpus (prepared under ./data/cache), and a
    training run's packing is eval's default, said on stderr."""
    run = tmp_path / "run"
    save_checkpoint(model, run / "checkpoints")
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"path": "embedded", "packing": "documents"}, "train": {"seq_len": 32}}))
    monkeypatch.chdir(tmp_path)
    args = ["--model", str(run), "--seq-len", "32", "--max-tokens", "300"]
    result = main([*args, "--data", "embedded"])
    assert result["packing"] == "documents"
    assert "packing: documents, seq_len: 32 (the run's" in capsys.readouterr().err
    by_default = main(args[:2] + args[4:] + ["--data", "embedded"])  # seq_len: the run's
    assert {**by_default, "seconds": None} == {**result, "seconds": None}
    prepared = default_prepared_data(tmp_path / "data" / "cache")
    assert main([*args, "--data", str(prepared)])["perplexity"] == result["perplexity"]
    assert main([*args, "--data", "embedded", "--packing", "concat"])["packing"] == "concat"
    # a checkpoint directory inside the run reads the run's; a bare one is scored as concat
    assert main(["--model", str(run / "checkpoints"), *args[2:], "--data", "embedded"])[
        "packing"] == "documents"
    bare = tmp_path / "bare"
    save_checkpoint(model, bare)
    assert main(["--model", str(bare), *args[2:], "--data", "embedded"])["packing"] == "concat"
    assert "packing: concat, seq_len: 2048 (no training run's" in capsys.readouterr().err
