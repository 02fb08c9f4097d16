"""Generation: cached decoding equals the full forward pass, sampling rules, EOS, CLI and errors."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax import ModelConfig, init_model
from delta_jax.checkpoint import save_checkpoint
from delta_jax.generate import Sampling, decode_memory, generate, left_pad, sample
from delta_jax.generate.__main__ import main
from delta_jax.loading import load_model, load_tokenizer

VARIANTS = ["baseline", "block", "full", "delta", "delta_block"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [42]]  # left-padded to 7
NEW = 6


def tiny(residual: str, **kw) -> ModelConfig:
    # init_std 0.2: peaked routing and logits, so a wrong cache or position shows.
    return ModelConfig.tiny(residual=residual, init_std=0.2, **kw)


@pytest.mark.parametrize("residual", [
    r if r in ("delta", "delta_block") else pytest.param(r, marks=pytest.mark.slow)
    for r in VARIANTS])
def test_cached_decoding_equals_full_forward(residual):
    """Logits of every generated position within 1e-5 of a full forward pass over each row's
    own tokens (prompt + generated, unpadded on the left), for prompts of different lengths."""
    cfg = tiny(residual, null_source=residual.startswith("delta"),
               routing_gate=residual in ("block", "full"),
               gate_base="stream" if residual == "full" else "live")
    model = init_model(cfg, seed=1)
    for site in (getattr(model.layers, "mlp_site", None), model.final_site):
        if site is not None and site.gate is not None:  # open the gates: both inputs count
            site.gate[...] = jnp.full(site.gate.shape, 0.5)
    out = generate(model, PROMPTS, max_new_tokens=NEW, keep_logits=True)
    chex.assert_shape(out.tokens, (3, NEW))
    chex.assert_shape(out.logits, (3, NEW, cfg.vocab_size))
    assert out.steps == NEW
    # One causal forward over right-padded rows: padding after a token cannot change its logits.
    rows = [prompt + out.row(b) for b, prompt in enumerate(PROMPTS)]
    ids = np.zeros((3, max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    full = np.asarray(jax.jit(model.__call__)(ids))
    for b, prompt in enumerate(PROMPTS):
        expected = full[b, len(prompt) - 1:len(prompt) - 1 + NEW]
        np.testing.assert_allclose(out.logits[b], expected, atol=1e-5, rtol=0,
                                   err_msg=f"{residual} row {b}")
        # Greedy: each token is the argmax of the logits it came from.
        np.testing.assert_array_equal(out.row(b), expected.argmax(-1))


@pytest.fixture(scope="module")
def delta_model():
    return init_model(tiny("delta"), seed=0)


def test_eos_stops_rows_and_the_loop(delta_model):
    free = generate(delta_model, PROMPTS, max_new_tokens=NEW)
    eos = int(free.tokens[1, 2])  # make row 1's third token the stop token
    out = generate(delta_model, PROMPTS, max_new_tokens=NEW, eos_id=eos)
    for b in range(3):
        row = free.tokens[b].tolist()
        stop = row.index(eos) + 1 if eos in row else NEW
        assert out.row(b) == row[:stop]
        assert (out.tokens[b, stop:] == eos).all()
    if all(eos in free.tokens[b] for b in range(3)):
        assert out.steps < NEW


def test_greedy_ignores_seed_and_sampling_depends_on_it(delta_model):
    a = generate(delta_model, PROMPTS, max_new_tokens=NEW, seed=0)
    b = generate(delta_model, PROMPTS, max_new_tokens=NEW, seed=1)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    hot = Sampling(temperature=5.0)
    runs = [generate(delta_model, PROMPTS, max_new_tokens=NEW, sampling=hot, seed=s).tokens
            for s in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def _draws(logits, sampling, n=4000):
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.jit(jax.vmap(lambda k: sample(logits, k, sampling)))
    return np.asarray(draw(keys))[:, 0]


LOGITS = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def test_greedy_is_argmax():
    assert (_draws(LOGITS, Sampling(greedy=True), n=8) == 1).all()


def test_temperature_sampling_matches_softmax():
    counts = np.bincount(_draws(LOGITS, Sampling(temperature=2.0)), minlength=5) / 4000
    expected = np.asarray(jax.nn.softmax(LOGITS[0] / 2.0))
    np.testing.assert_allclose(counts, expected, atol=0.03)


def test_top_k_keeps_the_k_most_likely():
    counts = np.bincount(_draws(LOGITS, Sampling(top_k=2)), minlength=5) / 4000
    assert set(np.flatnonzero(counts)) == {1, 3}
    np.testing.assert_allclose(counts[[1, 3]], [0.4 / 0.7, 0.3 / 0.7], atol=0.03)


def test_top_p_keeps_the_nucleus():
    # Sorted 0.4, 0.3, 0.15, ...: mass before the 3rd token is 0.7 < 0.75, so three stay.
    counts = np.bincount(_draws(LOGITS, Sampling(top_p=0.75)), minlength=5) / 4000
    assert set(np.flatnonzero(counts)) == {1, 3, 4}
    only_first = _draws(LOGITS, Sampling(top_p=0.1), n=50)
    assert (only_first == 1).all()


def test_left_pad():
    ids, start = left_pad([[1, 2, 3], [4]], multiple=4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [0, 0, 0, 4]])
    np.testing.assert_array_equal(start, [1, 3])


def test_bad_prompts(delta_model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(delta_model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 has 10 tokens.*context length 12"):
        generate(delta_model, [list(range(10))], max_new_tokens=4, max_length=12)
    with pytest.raises(ValueError, match="token id 500 is outside"):
        generate(delta_model, [[1, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_decode_memory_with_routing():
    """The cache (keys and values) is the same for every variant; what routing adds to a
    decode step is the current token's source buffer, whatever the context length."""
    cfg = tiny("delta")
    extra = {}
    for capacity in (64, 1024):
        base, delta = (decode_memory(init_model(tiny(r)), batch=2, capacity=capacity)
                       for r in ("baseline", "delta"))
        kv_bytes = 2 * cfg.num_layers * 2 * capacity * cfg.num_kv_heads * cfg.head_dim * 4
        assert base["cache_bytes"] == delta["cache_bytes"] == kv_bytes + 12  # + length, start
        extra[capacity] = delta["step_temp_bytes"] - base["step_temp_bytes"]
    assert abs(extra[1024] - extra[64]) <= 1024, extra
    sources = (2 * cfg.num_layers + 1) * 2 * cfg.hidden_size * 4  # [S, B, 1, D] float32
    assert 0 < extra[64] < 10 * sources, extra


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "delta_block"
    save_checkpoint(init_model(tiny("delta_block", vocab_size=300)), path)
    return path


def test_cli_prompt_ids_json(checkpoint, capsys):
    result = main(["--model", str(checkpoint), "--prompt-ids", "1,2,3", "--prompt-ids", "7",
                   "--max-new-tokens", "5", "--greedy", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["results"] == result["results"]
    assert [r["prompt_ids"] for r in printed["results"]] == [[1, 2, 3], [7]]
    model = load_model(checkpoint)
    expected = generate(model, [[1, 2, 3], [7]], max_new_tokens=5)
    assert [r["ids"] for r in printed["results"]] == [expected.row(0), expected.row(1)]
    assert printed["results"][0]["text"] is None  # no tokenizer in the folder


def test_cli_text_prompt_with_tokenizer(checkpoint, capsys):
    main(["--model", str(checkpoint), "--tokenizer", "byte", "--prompt", "Hi", "--greedy",
          "--max-new-tokens", "3", "--json"])
    item = json.loads(capsys.readouterr().out)["results"][0]
    assert item["prompt_ids"] == [72, 105]
    assert len(item["ids"]) <= 3 and isinstance(item["text"], str)


@pytest.mark.parametrize("args, message", [
    (["--tokenizer", "byte", "--prompt", ""], "prompt 0 is empty"),
    (["--prompt-ids", "1,2,3,4,5", "--max-length", "6"], "exceeds the context length 6"),
    (["--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["--prompt", "Hi"], "no tokenizer found"),
])
def test_cli_bad_input_exits_2(checkpoint, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(checkpoint), "--max-new-tokens", "2", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_model_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "nope"), "--prompt-ids", "1"])
    assert exit_info.value.code == 2
    assert "no such model directory" in capsys.readouterr().err


def test_load_model_reads_a_run_folder_and_its_tokenizer(tmp_path):
    model = init_model(tiny("delta", vocab_size=300))
    save_checkpoint(model, tmp_path / "run" / "checkpoints", step=7)
    (tmp_path / "run" / "config.yaml").write_text("data:\n  path: embedded\n")
    loaded, tokenizer = load_model(tmp_path / "run"), load_tokenizer(tmp_path / "run")
    assert tokenizer.name == "byte" and loaded.config == model.config
    assert load_tokenizer(tmp_path / "run", "qwen3").name == "qwen3"  # the one asked for wins
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face folder"):
        load_model(tmp_path)
