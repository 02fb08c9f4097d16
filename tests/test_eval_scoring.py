"""Log-likelihood scoring (context, continuation) and the lm-eval-harness adapter."""
import json

import jax
import numpy as np
import pytest

from delta_jax import ModelConfig, init_model
from delta_jax.checkpoint import save_checkpoint
from delta_jax.data.tokenizers import get_tokenizer
from delta_jax.generate import generate
from delta_jax.scoring import encode_pair, loglikelihood, loglikelihood_text

BYTE = get_tokenizer("byte")
REQUESTS = [([1, 2, 3], [4, 5]), ([9], [8, 7, 6, 5, 4]), ([3, 3, 3, 3, 3, 3], [1]),
            ([100, 20], [30, 40, 50])]


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.tiny(vocab_size=264, residual="delta_block", init_std=0.2), 0)


@pytest.fixture(scope="module")
def forward(model):
    return jax.jit(model.__call__)


def by_hand(forward, context, continuation, max_length=None):
    sequence = np.asarray(context + continuation, np.int32)
    if max_length is not None:
        sequence = sequence[-(max_length + 1):]
    inputs = np.zeros((1, 32), np.int32)  # one compiled shape; right padding is harmless
    inputs[0, :len(sequence) - 1] = sequence[:-1]
    logits = np.asarray(forward(inputs), np.float64)[0, :len(sequence) - 1]
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    places = np.arange(len(sequence) - 1 - len(continuation), len(sequence) - 1)
    targets = sequence[places + 1]
    return logprobs[places, targets].sum(), bool((logits[places].argmax(-1) == targets).all())


def test_loglikelihood_equals_the_forward_pass(model, forward):
    results = loglikelihood(model, REQUESTS, batch_size=3, pad_multiple=16)
    for (context, continuation), (logprob, greedy) in zip(REQUESTS, results):
        expected, expected_greedy = by_hand(forward, context, continuation)
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
    # Batching and padding do not change a score.
    again = loglikelihood(model, REQUESTS[::-1], batch_size=8, pad_multiple=16)[::-1]
    np.testing.assert_allclose([r[0] for r in again], [r[0] for r in results], atol=1e-5)


def test_is_greedy_for_the_greedy_continuation(model):
    context = [10, 11, 12]
    greedy = generate(model, [context], max_new_tokens=4).row(0)
    other = greedy[:-1] + [(greedy[-1] + 1) % 264]
    results = loglikelihood(model, [(context, greedy), (context, other)], pad_multiple=16)
    assert results[0][1] and not results[1][1]
    assert results[0][0] > results[1][0]


def test_long_requests_keep_their_last_tokens(model, forward):
    context, continuation = list(range(20, 40)), [7, 8, 9]
    (logprob, _), = loglikelihood(model, [(context, continuation)], max_length=12,
                                  pad_multiple=16)
    assert logprob == pytest.approx(by_hand(forward, context, continuation, 12)[0], abs=1e-4)


def test_bad_requests(model):
    with pytest.raises(ValueError, match="request 0: empty context"):
        loglikelihood(model, [([], [1])])
    with pytest.raises(ValueError, match="request 1: continuation of 0 tokens"):
        loglikelihood(model, [([1], [2]), ([1], [])])
    with pytest.raises(ValueError, match="request 0: token id 999"):
        loglikelihood(model, [([1], [999])])


def test_encode_pair_moves_trailing_space_and_fills_an_empty_context():
    assert encode_pair(BYTE, "The sky is ", "blue") == (list(b"The sky is"), list(b" blue"))
    assert encode_pair(BYTE, "", "Hi") == ([BYTE.eos_id], list(b"Hi"))
    assert encode_pair(BYTE, "  ", "Hi") == ([BYTE.eos_id], list(b"  Hi"))


# lm-eval-harness ---------------------------------------------------------------------------
DOCS = [{"question": "The sky is", "choices": ["blue", "green", "loud"], "label": 0},
        {"question": "Two plus two is", "choices": ["four", "five"], "label": 1},
        {"question": "Cats say", "choices": ["meow", "woof", "moo"], "label": 2},
        {"question": "Water is", "choices": ["wet", "dry"], "label": 0}]


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    pytest.importorskip("lm_eval")
    from delta_jax.lm_eval_adapter import DeltaJaxLM

    path = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    save_checkpoint(model, path)
    return DeltaJaxLM(pretrained=str(path), tokenizer="byte", batch_size=4, max_length=64)


def test_lm_eval_multiple_choice_task(adapter, model, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    task = {"task": "tiny_mc", "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data)},
                               "cache_dir": str(tmp_path / "hf_cache")},
            "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    out = lm_eval.simple_evaluate(model=adapter, tasks=[task], task_manager=TaskManager(),
                                  log_samples=True, bootstrap_iters=0)
    correct = []
    for doc in DOCS:
        # lm-eval joins question and choice with its target delimiter, a space.
        scores = loglikelihood_text(model, BYTE,
                                    [(doc["question"] + " ", c) for c in doc["choices"]])
        correct.append(int(np.argmax([s for s, _ in scores])) == doc["label"])
        sample = next(s for s in out["samples"]["tiny_mc"] if s["doc"] == doc)
        np.testing.assert_allclose([r[0][0] for r in sample["resps"]],
                                   [s for s, _ in scores], atol=1e-5)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(correct))


def test_lm_eval_rolling_and_generation(adapter, model, forward):
    from lm_eval.api.instance import Instance

    text = "Hello, world. Hello again."
    rolling, = adapter.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)])
    tokens = [BYTE.eos_id, *text.encode("utf-8")]
    assert rolling == pytest.approx(by_hand(forward, tokens[:1], tokens[1:])[0], abs=1e-3)

    context = "Hi"
    greedy = generate(model, [list(b"Hi")], max_new_tokens=6, eos_id=BYTE.eos_id).row(0)
    full = BYTE.decode([t for t in greedy if t != BYTE.eos_id])
    stop = full[2] if len(full) > 2 else "\n"
    generated, = adapter.generate_until(
        [Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 6}), 0)])
    assert generated == full.split(stop)[0]
