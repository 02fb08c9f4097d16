"""python -m delta_jax.bench.versus_torch at a tiny shape: every row is measured, and the two
frameworks run the same model (same weights, logits within 1e-4) and the same attention
(gradients within 1e-4)."""
import json

import pytest

from delta_jax.bench.versus_torch import main

TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
        "model.intermediate_size=64", "train.batch_size=8", "train.seq_len=16"]


@pytest.mark.slow
def test_rows_and_parity(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = main(["--steps", "1", "--warmup", "1", "--json", str(out), *TINY])
    assert [r["what"].split(" ")[0] for r in rows] == ["matmul", "attention", "forward",
                                                       "forward", "forward", "train"]
    for r in rows:
        assert r["torch_s"] > 0 and r["jax_s"] > 0 and r["ratio"] == r["jax_s"] / r["torch_s"]
    assert rows[1]["max_grad_gap"] < 1e-4
    assert rows[2]["max_logit_gap"] < 1e-4
    assert json.loads(out.read_text()) == rows
    assert "torch" in capsys.readouterr().out
