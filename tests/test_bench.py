"""The benchmark harness runs every variant and writes the promised fields."""
import json

import pytest

from delta_jax.bench.__main__ import main

TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=3",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
        "model.intermediate_size=64", "model.num_blocks=2", "train.batch_size=8",
        "train.seq_len=16"]


@pytest.mark.slow
def test_bench_writes_one_row_per_variant_and_driver(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["--config", "configs/bench_cpu.yaml", "--variants", "baseline,delta",
          "--drivers", "lean,scan", "--steps", "2", "--warmup", "1", "--json", str(out), *TINY])
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["driver"]) for r in rows] == [
        ("baseline", "lean"), ("baseline", "scan"), ("delta", "lean"), ("delta", "scan")]
    for row in rows:
        for key in ("step_time_s", "tokens_per_s", "compile_time_s", "temp_bytes", "flops",
                    "analytic_flops"):
            assert row[key] > 0, (key, row)
        assert row["tokens_per_s"] == 8 * 16 / row["step_time_s"]
    # the lean driver's backward keeps one buffer, not one per layer
    by = {(r["variant"], r["driver"]): r["temp_bytes"] for r in rows}
    assert by[("delta", "lean")] < by[("delta", "scan")]
    table = capsys.readouterr().out
    assert "delta        scan" in table and "x)" in table


def test_bench_compile_only_needs_no_run(tmp_path):
    rows = main(["--config", "configs/bench_cpu.yaml", "--variants", "delta_block",
                 "--compile-only", *TINY])
    assert rows[0]["step_time_s"] is None and rows[0]["temp_bytes"] > 0
