"""The pre-launch planner: compiles the real step for a TPU slice (no TPU) or CPUs, judges fit."""
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from delta_jax.config import RESIDUALS
from delta_jax.plan import knobs, report, topology
from delta_jax.plan.__main__ import main
from delta_jax.plan.compile import StepPlan
from delta_jax.train.config import load_config

TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
        "model.intermediate_size=64", "model.num_blocks=2", "model.dtype=bfloat16",
        "model.remat=none", "train.batch_size=8", "train.seq_len=16"]
CONFIG = ["--config", "configs/220m.yaml"]
# Big enough for the v5p compiler to lay routing out as it would at scale, small enough to
# compile in seconds.
SMALL_V5P = ["model.vocab_size=1024", "model.hidden_size=256", "model.num_layers=8",
             "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=64",
             "model.intermediate_size=512", "train.batch_size=16", "train.seq_len=512"]


def _has_libtpu() -> bool:
    try:
        importlib.import_module("libtpu")
    except ImportError:
        return False
    return True


needs_libtpu = pytest.mark.skipif(
    not _has_libtpu(), reason="libtpu is not installed (pip install -r requirements-test.txt): "
    "compiling for a TPU topology needs it")


def _plan(**overrides) -> StepPlan:
    fields = dict(variant="baseline", remat="none", layer_driver="lean",
                  mesh={"data": 1, "fsdp": 4, "tensor": 1}, batch_size=8, seq_len=16,
                  grad_accum=1, num_devices=4, params_bytes=1, opt_state_bytes=2, batch_bytes=3,
                  argument_bytes=6, output_bytes=6, alias_bytes=6, temp_bytes=94, code_bytes=0,
                  total_bytes=100, flops=1e9, bytes_accessed=1e9, estimated_step_s=0.5,
                  analytic_flops=4e9, compile_s=1.0)
    return StepPlan(**{**fields, **overrides})


def test_fits_on_synthetic_numbers():
    assert report.fits(_plan(), 100) is True
    assert report.fits(_plan(), 99) is False
    assert report.fits(_plan(), None) is None  # CPUs: nothing to judge by
    assert report.fits(_plan(oom="RESOURCE_EXHAUSTED: ..."), 10**12) is False
    # By the bytes live at the peak (what the TPU compiler checks) instead of the total
    live = _plan(live_peak_bytes=80)
    assert report.fits(live, 90) is False and report.fits(live, 90, by="live") is True
    assert report.fits(live, 79, by="live") is False
    assert report.counted_bytes(_plan(), "live") == 100  # no live peak (CPU): the total
    with pytest.raises(ValueError, match="'peak'.*total, live"):
        report.counted_bytes(live, "peak")
    assert report.tokens_per_s(_plan()) == 8 * 16 / 0.5
    assert report.mfu(_plan(), 1e9) == 4e9 / 0.5 / (1e9 * 4)
    assert report.mfu(_plan(estimated_step_s=None), 1e9) is None


def unwrapped(text: str) -> str:
    """`text` with its line breaks and indents as single spaces: the report wraps at 100."""
    return " ".join(text.split())


def test_the_verdict_names_its_count_and_what_the_compiler_accepts():
    over_by_total = unwrapped(report.describe(_plan(live_peak_bytes=80), 90, None))
    assert ("does NOT fit by the total" in over_by_total
            and "the compiler accepts it" in over_by_total and "--fit-by live" in over_by_total)
    assert "fits by the live peak" in unwrapped(report.describe(_plan(live_peak_bytes=80), 90, None,
                                                             by="live"))
    refused = unwrapped(report.describe(_plan(live_peak_bytes=200, oom="RESOURCE_EXHAUSTED"), 90,
                                     None, by="live"))
    assert "the compiler refused it" in refused
    table = report.variants_table([_plan(live_peak_bytes=80)], 90, by="live")
    assert "fits (live)" in table and "yes" in table


@pytest.mark.parametrize("chip, limit_gib, aside", [
    ("v5p", 95.74, "more than the spec's figure, which is rounded down"),
    ("v5e", 15.75, "the runtime keeps the rest")])
def test_the_header_names_each_memory_figure_without_contradiction(chip, limit_gib, aside):
    """The chip's HBM by its spec and the compiler's limit for a program are two figures, named
    as such; where the limit is above the spec (v5p's 95 is rounded), the header says so rather
    than calling the limit a part of the spec's HBM."""
    from types import SimpleNamespace

    from delta_jax.plan.chips import CHIPS

    devices = tuple(SimpleNamespace(device_kind="TPU", coords=(i, 0, 0)) for i in range(4))
    tpu = topology.Topology(f"{chip}:2x2", devices, CHIPS[chip])
    tpu.__dict__["compiler_hbm_per_device"] = int(limit_gib * 2**30)  # as libtpu names it
    spec_gib = CHIPS[chip].hbm_bytes / 2**30
    assert tpu.memory() == (f"HBM {spec_gib:g} GiB by the chip's spec; the compiler's limit for "
                            f"a program {limit_gib:.2f} GiB (libtpu's figure; {aside})")
    assert (limit_gib > spec_gib) == (chip == "v5p")
    assert tpu.judged_against() == f"the compiler's limit, {limit_gib:.2f} GiB"
    assert "of it" not in tpu.memory()


def test_grad_accum_alternatives_keep_microbatches_splittable():
    assert knobs.max_grad_accum(64, 16) == 4
    assert knobs.max_grad_accum(8, 8) == 1
    assert knobs.stronger_remat("save_dots") == ("save_sublayer_outputs", "full")


def test_whole_logits_are_offered_in_vocabulary_chunks():
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    whole = load_config("configs/220m.yaml", [*TINY, "train.loss_vocab_chunks=1"])
    offered = dict(knobs.alternatives(whole, mesh))
    assert offered["train.loss_vocab_chunks=8"].train.loss_vocab_chunks == 8
    chunked = load_config("configs/220m.yaml", TINY)  # the config already chunks
    assert not any(c.startswith("train.loss_vocab") for c, _ in knobs.alternatives(chunked, mesh))


def test_delta_under_the_lean_driver_is_offered_rebuilt_states():
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    delta = load_config("configs/220m.yaml", [*TINY, "model.residual=delta"])
    offered = dict(knobs.alternatives(delta, mesh))
    assert offered["model.rebuild_states=true"].model == delta.model.replace(
        rebuild_states=True)
    for others in (["model.residual=delta_block"], ["model.layer_driver=scan"],
                   ["model.rebuild_states=true"]):  # no states to rebuild, or rebuilt already
        run = load_config("configs/220m.yaml", [*TINY, "model.residual=delta", *others])
        assert not any(c.startswith("model.rebuild_states") for c, _ in
                       knobs.alternatives(run, mesh)), others


def test_cpu_topology_compiles_and_reports(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "cpu:8", "--no-estimate", "--json", str(out),
                 *TINY]) == 0
    (row,) = json.loads(out.read_text())
    assert row["num_devices"] == 8 and row["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert row["total_bytes"] >= row["temp_bytes"] > 0 and row["params_bytes"] > 0
    assert row["fits"] is None  # no HBM figure for a CPU unless --hbm-gib
    assert row["routing_floor"]["num_slots"] == 2  # the config's delta_block, two blocks
    text, err = capsys.readouterr()
    assert "not judged" in text and "routing floor" in text
    assert text.splitlines()[1] == ("  fit judged against nothing: no memory figure for a CPU "
                                    "(--hbm-gib gives one)")
    started = "delta_block (variant 1 of 1): compiling the train step (memory)"
    assert f"{started} ..." in err and f"{started}: done in " in err and "compiling" not in text


@pytest.mark.slow  # two processes start jax (the planner and its compiling child): ~1 minute
def test_progress_goes_to_stderr_and_the_report_to_stdout():
    """A real process, as `> plan.txt` runs it: each compile says on stderr what it compiles
    and, as it ends, its seconds; stdout holds the report alone."""
    done = subprocess.run(
        [sys.executable, "-m", "delta_jax.plan", *CONFIG, "--topology", "cpu:8",
         "--variants", "delta", *TINY], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for what in ("compiling the train step (memory)",
                 "compiling the cost twin (layers unrolled: FLOPs, time)"):
        line = re.escape(f"delta (variant 1 of 1): {what}")
        assert re.search(rf"INFO delta_jax.plan: {line} \.\.\.$", done.stderr, re.M), (
            what, done.stderr)
        assert re.search(rf"{line}: done in \d+\.\d s$", done.stderr, re.M), (what, done.stderr)
    assert re.search(r"planned 1 variant\(s\) in \d+\.\d s$", done.stderr, re.M)
    assert "compiling" not in done.stdout and "done in" not in done.stdout
    assert done.stdout.startswith("topology cpu:8") and "compile time" in done.stdout


@pytest.mark.slow
def test_does_not_fit_names_the_knobs_that_help(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main([*CONFIG, "--topology", "cpu:8", "--hbm-gib", "0.0001", "--no-estimate",
               "--json", str(out), *TINY, "model.remat=save_sublayer_outputs"])
    assert rc == 1
    (row,) = json.loads(out.read_text())
    assert row["fits"] is False
    changes = [alt["change"] for alt in row["alternatives"]]
    assert changes == ["model.remat=full"]  # 8 rows over 8 devices: no room to accumulate
    assert all(alt["total_bytes"] > 0 for alt in row["alternatives"])
    out, err = capsys.readouterr()
    assert "does NOT fit" in out and "alternatives" in out
    assert out.splitlines()[1] == "  fit judged against --hbm-gib, 0.00 GiB"  # no CPU figures
    label = "delta_block, alternative 1 of 1 (model.remat=full): compiling the train step (memory)"
    assert f"{label} ..." in err and f"{label}: done in " in err
    assert "cost twin" not in err  # --no-estimate: memory only


class _Synthetic:
    """In place of the compiling child process: a large StepPlan for each variant, nothing
    compiled (--no-estimate: the step alone)."""

    def __init__(self, function):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def __call__(self, run, *args):
        gib = 2**30
        size = 1 + list(RESIDUALS).index(run.model.residual)
        return _plan(variant=run.model.residual, total_bytes=123 * size * gib,
                     live_peak_bytes=99 * size * gib, bytes_accessed=12345.6 * size * gib,
                     estimated_step_s=12.3456 * size, flops=1e15, compile_s=1234.0)


def test_the_default_tables_fit_100_columns_and_wide_prints_every_column(
        tmp_path, monkeypatch, capsys):
    import delta_jax.plan.__main__ as planner

    monkeypatch.setattr(planner, "Worker", _Synthetic)
    out = tmp_path / "plan.json"
    args = [*CONFIG, "--topology", "cpu:8", "--variants", "all", "--hbm-gib", "400",
            "--no-estimate", "--no-suggest", "--json", str(out), *TINY]
    assert main(args) == 1  # the later variants are over 400 GiB
    default = capsys.readouterr().out
    assert max(len(line) for line in default.splitlines()) <= 100, default
    assert "est. tokens/s" in default and "floor+cot." in default
    for column in ("bytes accessed GiB", "compile s", "live floor GiB"):
        assert column not in default
    rows = json.loads(out.read_text())
    assert all(row["bytes_accessed"] > 0 and row["compile_s"] == 1234.0 for row in rows)

    assert main([*args, "--wide"]) == 1
    wide = capsys.readouterr().out
    headers = [re.split(r"\s{2,}", line) for line in wide.splitlines()
               if line.startswith("variant ")]
    assert headers[0] == ["variant", "HBM/device GiB", "live at peak GiB", "fits",
                          "est. step s", "bytes accessed GiB", "est. tokens/s", "compile s"]
    for column in ("HBM floor GiB", "peak in backward: floor GiB", "live floor GiB",
                   "peak in backward: live floor GiB", "bytes floor GiB"):
        assert column in wide
    assert max(len(line) for line in wide.splitlines()) > 150
    assert json.loads(out.read_text()) == rows  # the JSON is whole either way


@needs_libtpu
def test_tiny_model_compiles_for_v5p(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "v5p:2x2x1", "--variants", "baseline,delta",
                 "--json", str(out), *TINY]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["baseline", "delta"]
    for row in rows:
        # judged against the compiler's limit for a program, 95.74 GiB a v5p chip
        assert row["hbm_bytes"] == int(95.74 * 2**30) and row["fits"] is True
        for key in ("params_bytes", "opt_state_bytes", "temp_bytes", "total_bytes", "flops",
                    "bytes_accessed", "estimated_step_s", "estimated_mfu", "live_peak_bytes"):
            assert row[key] > 0, key
        # The live peak counts the arguments (the state) it holds at once.
        assert row["live_peak_bytes"] >= row["params_bytes"] + row["opt_state_bytes"]
    out = capsys.readouterr().out
    assert out.splitlines()[:4] == [
        "topology v5p:2x2x1 (4 x TPU v5); config configs/220m.yaml",
        "  per device: HBM 95 GiB by the chip's spec; the compiler's limit for a program 95.74 "
        "GiB (libtpu's",
        "      figure; more than the spec's figure, which is rounded down)",
        "  fit judged against the compiler's limit, 95.74 GiB"]
    text = unwrapped(out)
    assert "cost model (not measured)" in text and "delta" in text and "(1.00x)" in text
    assert "live at the peak" in text
    assert rows[0]["routing_floor"] is None and rows[1]["routing_floor"]["slot_reads"] == 7
    assert "routing against its floor" in text


@needs_libtpu
@pytest.mark.slow
def test_v5p_plans_splash_by_default_and_counts_its_flops(tmp_path, capsys):
    # attention auto at T 512: the planner compiles splash, reads that from the program, and
    # adds the kernel's flops (its time at the chip's peak) that XLA's cost model leaves out.
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "v5p:2x2x1", "--variants", "baseline", "--json",
                 str(out), *SMALL_V5P]) == 0
    assert main([*CONFIG, "--topology", "v5p:2x2x1", "--variants", "baseline", "--json",
                 str(tmp_path / "xla.json"), *SMALL_V5P, "model.attention=xla"]) == 0
    (auto,), (xla,) = (json.loads(path.read_text()) for path in (out, tmp_path / "xla.json"))
    assert (auto["attention"], xla["attention"]) == ("splash", "xla")
    assert auto["estimate_method"] == "XLA's cost model, splash attention added at the chip's peak"
    assert xla["estimate_method"] == "XLA's cost model"
    # A layer's attention here: XLA's 8 [T,T] matmuls (2 forward, twice: the lean driver
    # recomputes the layer; 4 backward), splash's 11 (2 forward twice, dq 3, dkv 4), all over the
    # whole square (T is one splash block). Uncounted, splash would make auto's flops 8 fewer.
    square = 2 * (16 // 4) * 4 * 512 * 512 * 64  # rows and heads a device, T, head dim
    assert auto["flops"] - xla["flops"] == pytest.approx(8 * (11 - 8) * square, rel=0.15)
    assert "baseline: 16 x 512 tokens per step" in unwrapped(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["lean"])
def test_cost_twin_counts_every_layer(driver):
    """The twin (the same driver, loops unrolled) grows by the same FLOPs per added layer pair,
    where the real program's while loop is counted once whatever the depth."""
    from delta_jax.plan.compile import _prepare, cost_twin
    from delta_jax.plan.topology import resolve
    from delta_jax.train.config import load_config

    def flops(layers: int, twin: bool) -> float:
        run = load_config("configs/220m.yaml", [*TINY, f"model.num_layers={layers}",
                                                 "model.residual=delta",
                                                 f"model.layer_driver={driver}",
                                                 "model.layer_loops=1"])
        _, compile_fn = _prepare(cost_twin(run) if twin else run, resolve("cpu:1", 1))
        return compile_fn().cost_analysis()["flops"]

    twin = [flops(n, twin=True) for n in (2, 4, 6)]
    assert twin[2] - twin[1] > 0.9 * (twin[1] - twin[0]) > 0
    assert flops(6, twin=False) < twin[1]  # the loop's body counted once


@pytest.mark.slow
def test_cost_twin_counts_every_vocabulary_chunk_of_the_loss():
    """The chunked loss runs the head's matmul four times a token: the forward logits, and in
    the backward pass the logits recomputed from the saved logsumexp, d hidden and d head
    (train/loss.py), each 2 * D flops a vocabulary column. The twin counts all C chunks of
    them, where the real program's chunk loops are counted once."""
    from delta_jax.plan.compile import _prepare, compile_step
    from delta_jax.plan.topology import resolve

    hidden, tokens, chunks = 64, 8 * 64, 4
    shape = [*TINY, f"model.hidden_size={hidden}", "model.head_dim=16", "train.seq_len=64",
             "model.intermediate_size=128", "model.residual=baseline",
             f"train.loss_vocab_chunks={chunks}"]
    cpu = resolve("cpu:1", 1)
    twin, real = {}, {}
    for vocab in (256, 512):
        run = load_config("configs/220m.yaml", [*shape, f"model.vocab_size={vocab}"])
        twin[vocab] = compile_step(run, cpu).flops
        real[vocab] = _prepare(run, cpu)[1]().cost_analysis()["flops"]
    head_matmuls = 4 * 2 * hidden * tokens * (512 - 256)
    # Above the matmuls: the softmax's elementwise flops and the optimizer's (measured 1.046x).
    assert 1.0 <= (twin[512] - twin[256]) / head_matmuls < 1.1
    assert (real[512] - real[256]) / head_matmuls < 1.5 / chunks


@needs_libtpu
@pytest.mark.slow
def test_tiny_model_over_a_small_hbm_override_does_not_fit(tmp_path):
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "v5p:2x2x1", "--hbm-gib", "0.001", "--no-estimate",
                 "--no-suggest", "--json", str(out), *TINY]) == 1
    (row,) = json.loads(out.read_text())
    assert row["fits"] is False and row["total_bytes"] > 0.001 * 2**30


def test_a_small_cpu_topology_first_leaves_the_forced_devices():
    # jax_num_cpu_devices overrides XLA_FLAGS' device count: had cpu:1 set it to 1 in a fresh
    # process, a later cpu:8 in that process (as in a test worker) could not have its 8.
    code = ("from delta_jax.plan.topology import resolve; "
            "print(len(resolve('cpu:1', 1).devices), len(resolve('cpu:8', 1).devices))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "8"]


@pytest.mark.parametrize("name", ["v9z:2x2", "tpu", "cpu:zero"])
def test_bad_topology_exits_2_listing_valid_names(name, capsys):
    assert main([*CONFIG, "--topology", name, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err
    if not name.startswith("cpu"):
        assert "v5p" in err and "v6e" in err and "cpu:N" in err


@needs_libtpu
def test_invalid_slice_shape_exits_2(capsys):
    assert main([*CONFIG, "--topology", "v5p:3x3x3", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "v5p:3x3x3" in err


def test_missing_libtpu_gives_the_install_hint(monkeypatch, capsys):
    real = importlib.import_module

    def without_libtpu(name, *args):
        if name == "libtpu":
            raise ImportError("No module named 'libtpu'")
        return real(name, *args)

    monkeypatch.setattr(topology.importlib, "import_module", without_libtpu)
    assert main([*CONFIG, "--topology", "v5p:2x2x1", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "jax[tpu]==' in err


def test_bad_override_and_variant_exit_2(capsys):
    assert main([*CONFIG, "--topology", "cpu:8", "model.nope=1"]) == 2
    assert main([*CONFIG, "--topology", "cpu:8", "--variants", "deltaa", *TINY]) == 2
    err = capsys.readouterr().err
    assert "model.nope" in err and "deltaa" in err


@needs_libtpu
@pytest.mark.slow
def test_where_finds_the_smallest_slice(tmp_path, capsys):
    from delta_jax.plan import where

    out = tmp_path / "where.json"
    assert where.main(["--configs", "configs/220m.yaml", "--chips", "v5e", "--json", str(out),
                       *TINY]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["slice"], row["remat"], row["grad_accum"]) == ("1x1", "none", 1)
    assert 0 < row["hbm_bytes"] <= row["hbm_per_device"]
    # progress on stderr: each candidate as its compile starts, and what it holds as it ends
    label = "v5e:1x1 remat=none grad_accum=1 mesh=data1/fsdp1/tensor1 (candidate 1 of 6)"
    err = capsys.readouterr().err
    assert f"{label}: compiling the train step (memory) ..." in err
    assert re.search(rf"{re.escape(label)}: [0-9.]+ GiB \(live at the peak [0-9.]+\) of "
                     r"15\.75, done in \d+\.\d s", err), err


@needs_libtpu
@pytest.mark.slow
def test_multislice_puts_data_across_slices(tmp_path, capsys):
    """The config's sizes are per slice: the shipped one (data 1, fsdp -1) runs on two slices
    unchanged, data 2; sizes that do not fit a slice are one line."""
    out = tmp_path / "plan.json"
    args = [*CONFIG, "--topology", "v5p:2x2x1", "--num-slices", "2", "--no-estimate", *TINY]
    assert main([*args, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["num_devices"] == 8 and row["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert main([*args, "--json", str(out), "mesh.data=2", "mesh.fsdp=-1"]) == 0
    assert json.loads(out.read_text())[0]["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    assert main([*args, "mesh.fsdp=8"]) == 2
    assert "but 4 are available in each of the 2 slices" in capsys.readouterr().err


def test_worker_survives_a_crashing_call():
    import operator
    import os

    from delta_jax.plan.isolated import CompilerCrash, Worker

    with Worker(operator.truediv) as divide:
        assert divide(6, 3) == 2
        with pytest.raises(ZeroDivisionError):  # the child's exception, raised here
            divide(1, 0)
        assert divide(1, 4) == 0.25  # the same child, still serving
    with Worker(os.abort) as abort:
        with pytest.raises(CompilerCrash, match="SIGABRT"):
            abort()
    with Worker(os._exit) as exit_:
        with pytest.raises(CompilerCrash, match="status 3"):
            exit_(3)
        with pytest.raises(CompilerCrash):  # a fresh child each time
            exit_(0)


@needs_libtpu
def test_where_skips_a_candidate_the_compiler_crashes_on():
    from delta_jax.plan import where
    from delta_jax.plan.isolated import CompilerCrash

    run = load_config("configs/220m.yaml", TINY)
    seen = []

    def compile_memory(candidate, topology_name):  # as if remat none crashed the compiler
        seen.append((topology_name, candidate.model.remat))
        if candidate.model.remat == "none":
            raise CompilerCrash("the compiling process was killed by SIGSEGV")
        return _plan(remat=candidate.model.remat, mesh={"data": 1, "fsdp": 1, "tensor": 1},
                     total_bytes=2**30)

    row = where.smallest_fit(run, "v5e", compile_memory)
    assert seen == [("v5e:1x1", "none"), ("v5e:1x1", "save_dots")]
    assert (row["slice"], row["remat"]) == ("1x1", "save_dots")
    assert row["crashed"] == ["v5e:1x1 remat=none grad_accum=1 mesh=data1/fsdp1/tensor1"]
    text = where.table([{"config": "220m", **row}], markdown=False)
    assert "compiler crashed" in text and "220m on v5e:1x1 remat=none" in text


@needs_libtpu
def test_where_judges_by_the_count_asked_for():
    from delta_jax.plan import where

    run = load_config("configs/220m.yaml", TINY)

    def compile_memory(candidate, topology_name):  # over v5e's 15.75 GiB by the total only
        return _plan(remat=candidate.model.remat, mesh={"data": 1, "fsdp": 1, "tensor": 1},
                     total_bytes=16 * 2**30, live_peak_bytes=15 * 2**30)

    by_total = where.smallest_fit(run, "v5e", compile_memory)
    assert by_total["slice"] is None  # nothing fits by the total on any slice
    by_live = where.smallest_fit(run, "v5e", compile_memory, by="live")
    assert (by_live["slice"], by_live["remat"], by_live["fit_by"]) == ("1x1", "none", "live")
    assert by_live["hbm_per_device"] == int(15.75 * 2**30)
    table = where.table([{"config": "220m", **by_live}], markdown=False)
    assert "15.00" in table and max(len(line) for line in table.splitlines()) <= 100
    wide = where.table([{"config": "220m", **by_live}], markdown=False, wide=True)
    assert wide.splitlines()[0].split("  ")[-1] == "compiler's limit GiB" and "v5e  " in wide


def test_a_variant_the_compiler_crashes_on_is_reported_and_the_rest_planned(
        tmp_path, capsys, monkeypatch):
    import delta_jax.plan.__main__ as planner
    from delta_jax.plan.compile import compile_named
    from delta_jax.plan.isolated import CompilerCrash

    class CrashesOnDelta:  # in place of the child process: a real compile, or a crash for delta
        def __init__(self, function):
            assert function is compile_named

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def __call__(self, run, *args):
            if run.model.residual == "delta":
                raise CompilerCrash("the compiling process was killed by SIGSEGV")
            return compile_named(run, *args)

    monkeypatch.setattr(planner, "Worker", CrashesOnDelta)
    out = tmp_path / "plan.json"
    status = main([*CONFIG, "--topology", "cpu:8", "--variants", "baseline,delta",
                   "--no-estimate", "--json", str(out), *TINY])
    assert status == 3
    baseline, delta = json.loads(out.read_text())
    assert baseline["variant"] == "baseline" and baseline["total_bytes"] > 0
    assert delta == {"topology": "cpu:8", "num_slices": 1, "variant": "delta", "fits": None,
                     "compiler_crash": "the compiling process was killed by SIGSEGV"}
    assert "delta: not planned, the compiler crashed (the compiling process was killed by " \
        "SIGSEGV)" in unwrapped(capsys.readouterr().out)


@needs_libtpu
@pytest.mark.slow
def test_more_layer_loops_do_not_cost_delta_memory_on_v5p():
    # The lean backward carries the buffer's cotangent and the final buffer on as each next
    # loop's prefix. When it kept the whole cotangent and XLA took every prefix at once, four
    # loops held 36% more temporaries than one at this shape (0.162 against 0.119 GiB).
    from delta_jax.plan.compile import compile_named

    small = [*SMALL_V5P, "model.num_blocks=2", "model.residual=delta"]
    temp = {loops: compile_named(load_config("configs/220m.yaml",
                                             [*small, f"model.layer_loops={loops}"]),
                                 "v5p:2x2x1", estimate=False).temp_bytes
            for loops in (1, 4)}
    assert temp[4] <= 1.05 * temp[1], temp


@needs_libtpu
@pytest.mark.slow
def test_a_delta_run_that_fits_only_with_rebuilt_states_is_told_so_on_v5p(tmp_path):
    # One layer loop: the lean driver keeps 8 layers' input states, or 1 with rebuild_states.
    # Judged against an HBM between the two, the planner's alternatives name the one that fits.
    # XLA's attention: with splash's smaller temporaries this shape peaks where rebuilding the
    # states does not help (153.98 against 139.54 MB kept).
    from delta_jax.plan.compile import compile_named

    small = [*SMALL_V5P, "model.num_blocks=2", "model.residual=delta", "model.layer_loops=1",
             "model.attention=xla"]
    run = load_config("configs/220m.yaml", small)
    kept, rebuilt = (compile_named(r, "v5p:2x2x1", estimate=False).total_bytes
                     for r in (run, knobs.with_rebuilt_states(run)))
    assert rebuilt < kept
    out, between = tmp_path / "plan.json", (kept + rebuilt) / 2 / 2**30
    assert main([*CONFIG, "--topology", "v5p:2x2x1", "--hbm-gib", repr(between),
                 "--no-estimate", "--json", str(out), *small]) == 1
    (row,) = json.loads(out.read_text())
    offered = {alt["change"]: alt for alt in row["alternatives"]}
    assert offered["model.rebuild_states=true"]["fits"] is True
    assert offered["model.rebuild_states=true"]["total_bytes"] == rebuilt
