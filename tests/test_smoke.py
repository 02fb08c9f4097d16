"""The first-run script: every variant measured beside the planner's prediction, the kernel's
losses held against xla's, and bad input as one error line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from delta_jax import smoke
from delta_jax.model import attention_kernels
from delta_jax.smoke.__main__ import main
from delta_jax.train.config import load_config
from delta_jax.train.loop import build_mesh

ROOT = Path(__file__).resolve().parent.parent
# d 64, 2 layers on the built-in corpus (byte tokenizer: 257 ids, so vocabulary 384).
TINY = ["model.vocab_size=384", "model.hidden_size=64", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
        "model.intermediate_size=128", "model.dtype=float32", "train.batch_size=8"]


def _smoke(*args: str) -> subprocess.CompletedProcess:
    """`python -m delta_jax.smoke ARGS` as a user runs it (this test process's 8 CPU devices)."""
    return subprocess.run([sys.executable, "-m", "delta_jax.smoke", *args], cwd=ROOT,
                          capture_output=True, text=True, env=os.environ, timeout=900)


@pytest.mark.slow
def test_cli_writes_measured_and_predicted_fields_for_every_variant(tmp_path):
    out = tmp_path / "smoke.json"  # the default: <output_dir>/smoke.json
    done = _smoke("--steps", "2", *TINY, "train.seq_len=32", "train.peak_tflops=1",
                  f"output_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["variant"], r["attention"]) for r in report["rows"]] == [
        ("baseline", "xla"), ("delta", "xla"), ("delta_block", "xla")]
    assert report["kernel"] is None and report["agreement"] == [] and report["ok"]
    assert report["device"]["num_devices"] == 8 and report["mesh"]["data"] == 8
    assert "no attention kernel on cpu: xla attention only" in done.stdout
    for row in report["rows"]:
        assert len(row["losses"]) == len(row["grad_norms"]) == 3  # warmup 1 + 2 timed
        assert row["losses"][-1] < row["losses"][0]  # the steps train
        assert row["tokens_per_s"] == pytest.approx(8 * 32 / row["step_time_s"])
        assert row["mfu"] == pytest.approx(row["analytic_flops"] / row["step_time_s"] / 8e12)
        assert row["predicted_total_bytes"] >= row["predicted_live_peak_bytes"] > 0
        assert row["predicted_oom"] is None and row["compile_s"] > 0
        assert row["device_peak_bytes"] is None  # CPUs keep no memory statistics
    # the same batches and seed: the variants start from the same loss, near log(384)
    first = [r["losses"][0] for r in report["rows"]]
    assert max(first) - min(first) < 0.05
    assert "baseline     xla" in done.stdout and f"written to {out}" in done.stdout


@pytest.mark.slow
def test_splash_losses_agree_with_xla(tmp_path):
    """The real kernel comparison, with splash in Pallas interpret mode on CPU (T 128: its
    smallest block)."""
    run = load_config(None, [*TINY, "train.seq_len=128", "data.packing=concat",
                             f"data.cache_dir={tmp_path / 'cache'}", *smoke.SMOKE_OVERRIDES])
    batches = smoke.fixed_batches(run, build_mesh(run.mesh), 4)
    result = smoke.smoke_variant(run, "baseline", "splash", smoke.local_topology(), batches, 1)
    assert [r["attention"] for r in result["rows"]] == ["xla", "splash"]
    agreement = result["agreement"]
    assert agreement["loss"]["ok"] and agreement["grad_norm"]["ok"], agreement
    assert agreement["loss"]["tolerance"] == smoke.TOLERANCE["float32"]


def _non_causal(q, k, v, *, scale, segment_ids=None):
    return jax.nn.dot_product_attention(q, k, v, is_causal=False, scale=scale,
                                        implementation="xla")


@pytest.mark.slow
def test_a_wrong_kernel_fails_with_exit_status_1(tmp_path, monkeypatch, capsys):
    """A kernel that attends to later tokens, standing in for CPU's missing one: its gradients
    leave xla's, the CLI prints a FAIL line and exits 1."""
    monkeypatch.setattr(smoke, "KERNELS", {"cpu": "splash"})
    monkeypatch.setattr(attention_kernels, "sharded_splash_attention", _non_causal)
    out = tmp_path / "smoke.json"
    status = main(["--variants", "baseline", "--steps", "2", "--json", str(out), *TINY,
                   "train.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}"])
    assert status == 1
    printed = capsys.readouterr().out
    assert "FAIL: baseline splash vs xla" in printed
    (agreement,) = json.loads(out.read_text())["agreement"]
    assert not agreement["grad_norm"]["ok"] and not json.loads(out.read_text())["ok"]


@pytest.mark.parametrize("args, names", [
    (["--variants", "baseline,deltablock"], "deltablock"),
    (["--config", "configs/no_such.yaml"], "configs/no_such.yaml"),
    (["model.no_such_key=1"], "model.no_such_key"),
    (["train.batch_size=3"], "train.batch_size=3"),  # 8 devices: does not split
])
def test_bad_input_is_one_error_line_and_exit_2(args, names, tmp_path):
    done = _smoke(*args, f"data.cache_dir={tmp_path}")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and names in errors[0], \
        done.stderr
    assert done.stdout == ""


def test_each_kernel_takes_only_the_runs_it_can():
    """cudnn: concat packing for both attentions (it takes no segment ids) and bfloat16 or
    float16 compute; splash: a sequence length its smallest block divides. Refused before
    anything compiles."""
    documents = load_config(None, [*TINY, "train.seq_len=128", "model.dtype=bfloat16"])
    run, note = smoke.for_kernel(documents, "cudnn")
    assert run.data.packing == "concat" and "concat" in note
    assert list(smoke.variant_runs(run, "delta", "cudnn")) == ["xla", "cudnn"]
    assert smoke.for_kernel(documents, "splash") == (documents, None)
    with pytest.raises(ValueError, match="dtype=.float32.*--no-kernel"):
        smoke.variant_runs(load_config(None, TINY), "delta", "cudnn")
    with pytest.raises(ValueError, match="T=32"):
        smoke.variant_runs(load_config(None, [*TINY, "train.seq_len=32"]), "delta", "splash")


@pytest.mark.slow
def test_a_run_out_of_memory_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    """The device's refusal (RESOURCE_EXHAUSTED, here raised for the kernel's run as a GPU
    raises it) becomes that row's result beside the planner's prediction; the variant's
    comparison is skipped, not failed."""
    monkeypatch.setattr(smoke, "KERNELS", {"cpu": "splash"})
    allocate = smoke.init_state

    def init_or_refuse(cfg, *args):
        if cfg.attention == "splash":
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB.\ndetails")
        return allocate(cfg, *args)

    monkeypatch.setattr(smoke, "init_state", init_or_refuse)
    out = tmp_path / "smoke.json"
    status = main(["--variants", "baseline", "--steps", "1", "--json", str(out), *TINY,
                   "train.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}"])
    assert status == 0
    report = json.loads(out.read_text())
    xla, refused = report["rows"]
    assert xla["measured_oom"] is None and xla["step_time_s"] > 0
    assert refused["measured_oom"] == ("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 9.00GiB.")
    assert refused["step_time_s"] is None and refused["losses"] is None
    assert refused["predicted_total_bytes"] > 0
    assert report["agreement"] == [{"variant": "baseline", "kernel": "splash",
                                    "skipped": "a run ran out of memory"}]
    printed = capsys.readouterr().out
    assert "skipped: baseline splash vs xla not compared" in printed
    (row,) = [line for line in printed.splitlines() if line.startswith("baseline     splash")]
    assert row.split()[-1] == "OOM"


@pytest.mark.slow
def test_two_processes_measure_what_one_does(tmp_path):
    """launch/local.sh 2 (two JAX processes, one CPU device each, as two hosts): each reads its
    rows of the same batches, the mesh spans both, process 0 alone writes the JSON, and the
    losses are a one-process run's on as many devices."""
    args = ["--variants", "baseline", "--steps", "1", *TINY, "train.seq_len=32",
            f"data.cache_dir={tmp_path / 'cache'}"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([str(ROOT / "launch/local.sh"), "2", "--module", "delta_jax.smoke",
                           "--json", str(tmp_path / "two.json"), *args],
                          env={**env, "CPU_DEVICES": "2", "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[p0] written to" in done.stdout and "[p1] written to" not in done.stdout
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["device"]["num_processes"] == 2 and two["mesh"]["data"] == 2
    one = subprocess.run([sys.executable, "-m", "delta_jax.smoke", "--json",
                          str(tmp_path / "one.json"), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=900,
                         env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert one.returncode == 0, one.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["device"]["num_processes"] == 1 and one["mesh"]["data"] == 2
    (row_two,), (row_one,) = two["rows"], one["rows"]
    assert row_two["losses"] == pytest.approx(row_one["losses"], rel=1e-6)
