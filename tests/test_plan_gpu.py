"""The planner on NVIDIA GPUs: compile-only H100 and H200 nodes from jax's CUDA plugin (no GPU, no
driver), judged against the device's memory with a roofline step estimate (plan/gpus.py).

`make test` installs the GPU compiler (`make gpu-compiler`), as it installs libtpu; elsewhere the
tests that compile skip, naming that command. Even a tiny step takes about half a minute to
compile for a GPU on a CPU host (ptxas included), so those tests are marked slow.
"""
import json

import numpy as np
import pytest

from delta_jax.plan import gpus, kernel_flops
from delta_jax.plan.__main__ import main
from delta_jax.plan.chips import CHIPS
from delta_jax.sharding import make_hybrid_mesh
from tests.test_plan import unwrapped

TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
        "model.intermediate_size=64", "model.num_blocks=2", "model.dtype=bfloat16",
        "model.remat=none", "train.batch_size=16", "train.seq_len=16"]
CONFIG = ["--config", "configs/220m.yaml"]


def _has_gpu_compiler() -> bool:
    try:
        gpus.require_compiler()
    except gpus.MissingCompiler:
        return False
    return True


needs_gpu_compiler = pytest.mark.skipif(
    not _has_gpu_compiler(), reason=f"the GPU compiler is not installed: {gpus.INSTALL}")


def test_a_missing_gpu_compiler_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DELTA_JAX_GPU_COMPILER", str(tmp_path))  # an empty folder
    assert main([*CONFIG, "--topology", "h100:1x8", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make gpu-compiler" in err and str(tmp_path) in err
    assert "requirements-gpu-compiler.txt" in err


@pytest.mark.parametrize("name", ["h100:8", "h100:1x2x8", "h200:0x8"])
def test_a_bad_gpu_shape_exits_2(name, capsys):
    assert main([*CONFIG, "--topology", name, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err and "x8" in err


def test_the_roofline_takes_whichever_of_flops_and_bytes_binds():
    h100 = CHIPS["h100"]
    assert gpus.roofline_s(989e12, 0.0, h100) == 1.0  # one second of peak flops
    assert gpus.roofline_s(0.0, 3.35e12 * 2, h100) == 2.0  # two seconds of HBM bandwidth
    assert gpus.roofline_s(989e12, 4.8e12 * 3, CHIPS["h200"]) == 3.0


def test_cudnn_attention_is_counted_for_each_call():
    # Two forward calls and one backward call, as in optimized HLO.
    hlo = ('custom_call_target="__cudnn$fmhaSoftmax" ... custom_call_target="__cudnn$fmhaSoftmax"'
           ' ... custom_call_target="__cudnn$fmhaSoftmaxBackward" ... '
           'custom_call_target="__cublas$gemm"')
    rows, seq, heads, head_dim = 2, 128, 4, 64
    one_matmul = rows * heads * seq * seq * head_dim  # 2 flops x the causal half of [T,T]
    assert kernel_flops.cudnn_attention_flops(hlo, rows, seq, heads, head_dim) == (
        2 * 2 * one_matmul + 5 * one_matmul)
    assert kernel_flops.cudnn_attention_flops("no attention here", rows, seq, heads, head_dim) == 0


@needs_gpu_compiler
def test_gpu_nodes_are_compile_only_devices_one_host_a_node():
    from delta_jax.plan.topology import resolve

    two_nodes = resolve("h100:2x8")
    assert two_nodes.num_devices == 16 and two_nodes.num_slices == 1
    assert {d.device_kind for d in two_nodes.devices} == {"NVIDIA H100 80GB HBM3"}
    # One process a node, one slice: a mesh builder tells the nodes apart by process_index.
    assert [d.process_index for d in two_nodes.devices] == [0] * 8 + [1] * 8
    assert {d.slice_index for d in two_nodes.devices} == {0}
    grid = make_hybrid_mesh((1, 4, 2), devices=two_nodes.devices).devices  # data spans nodes
    nodes = np.vectorize(lambda d: d.process_index)(grid)
    assert grid.shape == (2, 4, 2) and [set(row.flat) for row in nodes] == [{0}, {1}]
    assert two_nodes.hbm_per_device == 84_942_979_072  # the compiler names no limit on GPU
    assert two_nodes.peak_flops_per_device == 989e12
    h200 = resolve("h200:1x8")
    assert h200.devices[0].device_kind == "NVIDIA H200 141GB HBM3e"
    assert h200.hbm_per_device == 151_397_597_184
    assert h200.memory().startswith("memory 141.00 GiB as the GPU reports it")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in h200.memory()
    assert h200.judged_against() == "the GPU's memory, 141.00 GiB"


@needs_gpu_compiler
@pytest.mark.slow
def test_h100_node_plans_memory_and_a_labelled_roofline_estimate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "h100:1x8", "--variants", "baseline,delta",
                 "--json", str(out), *TINY]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["baseline", "delta"]
    for row in rows:
        assert row["num_devices"] == 8 and row["hbm_bytes"] == 84_942_979_072
        assert row["fits"] is True and 0 < row["total_bytes"] < row["hbm_bytes"]
        assert row["estimate_method"].startswith("a roofline")
        roofline = max(row["flops"] / 989e12, row["bytes_accessed"] / 3.35e12)
        assert row["estimated_step_s"] == pytest.approx(roofline) and roofline > 0
        assert row["estimated_tokens_per_s"] > 0 and 0 < row["estimated_mfu"] < 1
    text = unwrapped(capsys.readouterr().out)
    assert "estimated by a roofline over XLA's cost analysis" in text
    assert "(not measured)" in text and "(an estimate)" in text and "of 79.11 GiB" in text


@needs_gpu_compiler
@pytest.mark.slow
def test_two_h100_nodes_put_data_across_the_nodes_and_fsdp_inside(tmp_path):
    """The shipped config (fsdp -1 within a node) on two nodes: the nodes go on data."""
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "h100:2x8", "--no-estimate", "--json", str(out),
                 *TINY]) == 0
    (row,) = json.loads(out.read_text())
    assert row["num_devices"] == 16 and row["mesh"] == {"data": 2, "fsdp": 8, "tensor": 1}
    assert 0 < row["total_bytes"] < row["hbm_bytes"] and row["fits"] is True


@needs_gpu_compiler
@pytest.mark.slow
def test_an_over_budget_step_compiles_and_is_judged_by_the_planner(tmp_path, capsys):
    # The GPU compiler accepts it: the verdict is the planner's, against the memory asked for.
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "h200:1x8", "--hbm-gib", "0.0001", "--no-estimate",
                 "--no-suggest", "--json", str(out), *TINY]) == 1
    (row,) = json.loads(out.read_text())
    assert row["fits"] is False and row["oom"] is None and row["total_bytes"] > 0.0001 * 2**30
    assert "does NOT fit by the total" in unwrapped(capsys.readouterr().out)


@needs_gpu_compiler
@pytest.mark.slow
def test_cudnn_attention_flops_are_added_by_formula(tmp_path):
    # At this shape the attention is most of the model's flops: without the cuDNN calls'
    # flops (HloCostAnalysis counts none for a custom call) the count would fall far below
    # the model's own (which leaves out remat's recompute, so it is a floor).
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "h100:1x8", "--variants", "baseline", "--json",
                 str(out), *TINY, "model.attention=cudnn", "train.seq_len=1024"]) == 0
    (row,) = json.loads(out.read_text())
    model_flops = row["analytic_flops"] / row["num_devices"]
    assert model_flops <= row["flops"] < 2 * model_flops


@needs_gpu_compiler
@pytest.mark.slow
@pytest.mark.parametrize("overrides,attention", [
    ([], "cudnn"),
    (["data.packing=documents"], "xla"),  # cuDNN takes no segment ids
    (["model.dtype=float32"], "xla"),     # nor float32
])
def test_auto_compiles_cudnn_attention_for_h100_where_the_inputs_allow(tmp_path, overrides,
                                                                         attention):
    # model.attention is auto (the default); the planner reads the kernel from the program.
    out = tmp_path / "plan.json"
    assert main([*CONFIG, "--topology", "h100:1x8", "--variants", "baseline", "--no-estimate",
                 "--json", str(out), *TINY, *overrides]) == 0
    (row,) = json.loads(out.read_text())
    assert row["attention"] == attention


@needs_gpu_compiler
def test_where_tries_gpu_nodes_of_eight_smallest_first():
    from delta_jax.plan import where
    from delta_jax.plan.compile import StepPlan
    from delta_jax.train.config import load_config

    seen = []

    def compile_memory(candidate, topology_name):  # as if only two nodes held the step
        seen.append((topology_name, candidate.model.remat, candidate.train.grad_accum))
        devices = 16 if topology_name == "h100:2x8" else 8
        return StepPlan(
            variant="delta_block", remat=candidate.model.remat, layer_driver="lean",
            mesh={"data": 1, "fsdp": devices, "tensor": 1}, batch_size=16, seq_len=16,
            grad_accum=candidate.train.grad_accum, num_devices=devices, params_bytes=1,
            opt_state_bytes=2, batch_bytes=3, argument_bytes=6, output_bytes=0, alias_bytes=0,
            temp_bytes=0, code_bytes=0, total_bytes=(2 if devices == 16 else 100) * 2**30,
            flops=None, bytes_accessed=None, estimated_step_s=None, analytic_flops=1.0,
            compile_s=0.0)

    row = where.smallest_fit(load_config("configs/220m.yaml", TINY), "h100", compile_memory)
    assert seen == [("h100:1x8", "none", 1), ("h100:1x8", "save_dots", 1),
                    ("h100:1x8", "full", 1), ("h100:1x8", "full", 2), ("h100:2x8", "none", 1)]
    assert (row["slice"], row["devices"], row["hbm_per_device"]) == ("2x8", 16, 84_942_979_072)
