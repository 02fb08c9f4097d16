"""Routing analysis: statistics equal those computed from the raw routing weights; the CLI."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from delta_jax import ModelConfig, init_model
from delta_jax.analyze import heatmap_result, plot_heatmap, routing_statistics, source_names
from delta_jax.analyze.__main__ import main
from delta_jax.checkpoint import save_checkpoint
from delta_jax.data.tokenizers import get_tokenizer
from delta_jax.eval import read_stream

TEXT = Path(__file__).parent / "data" / "udhr_article1.txt"
BYTE = get_tokenizer("byte")
T, WINDOWS = 16, 6


def tiny(residual, **kw):
    return ModelConfig.tiny(vocab_size=264, residual=residual, init_std=0.2, **kw)


@pytest.mark.parametrize("cfg", [tiny("delta", null_source=True), tiny("block")],
                         ids=["delta+null", "block"])
def test_statistics_equal_those_of_the_raw_weights(cfg):
    """Batched accumulation (batches of 4 and 2 windows) against one forward pass over all
    windows, reduced by hand from Routing.calls() (compact weights in call order)."""
    model = init_model(cfg, seed=3)
    stream = read_stream([TEXT], tokenizer=BYTE)
    result = routing_statistics(model, stream, seq_len=T, max_windows=WINDOWS, batch_size=4)
    ids = stream.tokens[:WINDOWS * T].reshape(WINDOWS, T)
    routing = jax.jit(lambda x: model.forward(x, return_routing=True))(ids).routing
    calls = [np.asarray(w, np.float64) for w in routing.calls()]  # each [N, B, T]
    assert result["tokens"] == WINDOWS * T
    assert len(result["sites"]) == len(calls)
    for site, weights in zip(result["sites"], calls):
        n = weights.shape[0]
        plogp = np.where(weights > 0, weights * np.log(np.where(weights > 0, weights, 1)), 0)
        entropy = -plogp.sum(0).mean()
        assert site["num_sources"] == n and len(site["sources"]) == n
        np.testing.assert_allclose(site["mean_weights"], weights.mean(axis=(1, 2)), atol=1e-6)
        np.testing.assert_allclose(site["max_weight"], weights.max(0).mean(), atol=1e-6)
        np.testing.assert_allclose(site["entropy"], entropy, atol=1e-5)
        np.testing.assert_allclose(site["normalized_entropy"],
                                   entropy / np.log(n) if n > 1 else 0.0, atol=1e-5)
    names = [s["site"] for s in result["sites"]]
    assert names[:2] == ["L0.attn", "L0.mlp"]
    assert (names[-1] == "final") == cfg.has_final_site


def test_gates_are_reported_per_site():
    model = init_model(tiny("full", num_layers=2, routing_gate=True, gate_base="stream"), seed=3)
    model.layers.mlp_site.gate[...] = np.array([0.25, 0.5], np.float32)
    model.final_site.gate[...] = np.float32(0.75)
    result = routing_statistics(model, read_stream([TEXT], tokenizer=BYTE), seq_len=T,
                                max_windows=2)
    assert {s["site"]: s["gate"] for s in result["sites"]} == {
        "L0.attn": 0.0, "L0.mlp": 0.25, "L1.attn": 0.0, "L1.mlp": 0.5, "final": 0.75}
    assert "gate" not in routing_statistics(init_model(tiny("full", num_layers=2)),
                                            read_stream([TEXT], tokenizer=BYTE), seq_len=T,
                                            max_windows=2)["sites"][0]


def test_source_names():
    assert source_names(tiny("delta"), 4) == ["emb", "a0", "m0", "a1"]
    assert source_names(tiny("delta", null_source=True), 3) == ["null", "emb", "a0"]
    assert source_names(tiny("delta_block"), 3) == ["emb", "b0", "b1"]


def test_baseline_has_nothing_to_analyze():
    with pytest.raises(ValueError, match="residual='baseline' has no routing"):
        routing_statistics(init_model(tiny("baseline")), read_stream([TEXT], tokenizer=BYTE))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze")
    for residual in ("delta_block", "full", "baseline"):
        save_checkpoint(init_model(tiny(residual), seed=0), root / residual)
    return root


def test_cli_writes_json_table_and_figures(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    results = main(["--model", str(checkpoints / "delta_block"), "--model",
                    str(checkpoints / "full"), "--data", str(TEXT), "--tokenizer", "byte",
                    "--seq-len", str(T), "--max-windows", "4", "--out", str(out)])
    table = capsys.readouterr().out
    assert "delta_block (delta_block)" in table and "final" in table
    saved = json.loads((out / "routing.json").read_text())["models"]
    assert [m["label"] for m in saved] == ["delta_block", "full"]
    assert saved == json.loads(json.dumps(results))
    for name in ("max_weight.png", "heatmap_delta_block.png", "heatmap_full.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    full = saved[1]["sites"]
    assert [s["num_sources"] for s in full] == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 2l+1, 2l+2, 2L+1


@pytest.mark.parametrize("args, message", [
    (["--model", "{root}/baseline"], "residual='baseline' has no routing sites"),
    (["--model", "{root}/missing"], "no such model directory"),
    (["--model", "{root}/full", "--label", "a", "--label", "b"], "2 --label for 1 --model"),
])
def test_cli_bad_input_exits_2(checkpoints, tmp_path, capsys, args, message):
    args = [a.format(root=checkpoints) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--data", str(TEXT), "--tokenizer", "byte", "--seq-len", str(T),
              "--max-windows", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("residual", ["delta", "delta_block", "full"])
def test_trainer_heatmap_names_sites_and_sources_as_analyze(residual, tmp_path):
    """The trainer's routing.png is drawn from its probe's weights by heatmap_result: the same
    site and source names as analyze, and one-source sites in a grey layer of their own."""
    cfg = tiny(residual, num_layers=2)
    result = routing_statistics(init_model(cfg), read_stream([TEXT], tokenizer=BYTE), seq_len=T,
                                max_windows=2)
    drawn = heatmap_result(cfg, [np.array(r["mean_weights"]) for r in result["sites"]], "run")
    assert [s["site"] for s in drawn["sites"]] == [r["site"] for r in result["sites"]]
    assert [s["sources"] for s in drawn["sites"]] == [r["sources"] for r in result["sites"]]
    figure = plot_heatmap(drawn, tmp_path / "routing.png")
    single = [col for col, s in enumerate(drawn["sites"]) if s["num_sources"] == 1]
    images = figure.axes[0].images
    assert single or residual != "full"  # its first site sees only the embedding
    assert len(images) == (2 if single else 1)
    if single:
        grey = ~np.ma.getmaskarray(images[1].get_array())
        assert sorted(set(np.nonzero(grey)[1])) == single
        assert np.ma.getmaskarray(images[0].get_array())[:, single].all()
    extra = len(drawn["sites"]) + 1
    with pytest.raises(ValueError, match=f"{extra} routing sites' weights"):
        heatmap_result(cfg, [np.ones(1)] * extra, "run")
