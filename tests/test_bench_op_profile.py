"""python -m delta_jax.bench.op_profile at a tiny shape: the trace's ops are found and sorted
into kinds whose shares add up, the matmuls among them."""
import json

import pytest

from delta_jax.bench.op_profile import KINDS, main, op_kinds

TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
        "model.intermediate_size=64", "train.batch_size=2", "train.seq_len=16"]


def test_kinds_and_shares(tmp_path, capsys):
    out = tmp_path / "profile.json"
    result = main(["--top", "3", "--json", str(out), *TINY])
    shares = {row["kind"]: row["share"] for row in result["kinds"]}
    assert set(shares) == set(KINDS)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["matmuls"] > 0
    assert len(result["top"]) == 3 and result["top"][0]["op_s"] >= result["top"][-1]["op_s"]
    assert json.loads(out.read_text()) == result
    assert "matmuls" in capsys.readouterr().out


def test_op_kinds_reads_fusion_bodies():
    hlo = """%fused_a (p: f32[2,2]) -> f32[2,2] {
  %p = f32[2,2]{1,0} parameter(0)
  ROOT %t = f32[2,2]{0,1} transpose(%p), dimensions={1,0}
}

%fused_b (p: f32[2,2]) -> f32[2,2] {
  %p = f32[2,2]{1,0} parameter(0)
  ROOT %d = f32[2,2]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[2,2]) -> f32[2,2] {
  %x = f32[2,2]{1,0} parameter(0)
  %fusion.1 = f32[2,2]{0,1} fusion(%x), kind=kLoop, calls=%fused_a
  ROOT %fusion.2 = f32[2,2]{1,0} fusion(%fusion.1), kind=kOutput, calls=%fused_b
}
"""
    assert op_kinds(hlo) == {"fusion.1": "layout changes", "fusion.2": "matmuls"}
