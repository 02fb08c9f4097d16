"""The training run end to end on real files: metrics, plots, checkpoints, exact resume (also
onto another mesh), fine-tuning from a model checkpoint."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from delta_jax import ModelConfig, init_model, load_pretrained, save_pretrained
from delta_jax.checkpoint import load_checkpoint, save_checkpoint
from delta_jax.data.prepare import prepare
from delta_jax.sharding import make_mesh
from delta_jax.train.checkpoints import Checkpointer
from delta_jax.train.config import RunConfig, dump_config, load_config
from delta_jax.train.faults import PreflightError
from delta_jax.train.loop import Trainer, run
from delta_jax.train.metrics import read_metrics
from delta_jax.train.optimizer import make_optimizer
from delta_jax.train.state import abstract_state, state_specs, to_shardings
from numerics import assert_float32_equal

STEPS, SPLIT = 6, 3
MODEL = dict(vocab_size=260, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=8, intermediate_size=64, num_blocks=2, residual="delta_block")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Docstrings of a few stdlib modules, prepared with the byte tokenizer."""
    root = tmp_path_factory.mktemp("train_data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with (root / "docs.jsonl").open("w") as f:
        for module in ("argparse.py", "textwrap.py", "string.py", "functools.py", "pathlib.py"):
            for node in ast.walk(ast.parse((stdlib / module).read_text("utf-8"))):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                    if doc := ast.get_docstring(node):
                        f.write(json.dumps({"text": doc}) + "\n")
    prepare([root / "docs.jsonl"], root / "data", validation_fraction=0.1, progress=False)
    return root / "data"


def config(data_dir, output_dir, *overrides) -> RunConfig:
    """A tiny run on all 8 fake devices, also written to <output_dir>.yaml; the lr schedule is
    fixed to STEPS whatever train.steps."""
    tree = {"output_dir": str(output_dir), "seed": 0, "model": MODEL,
            "data": {"path": str(data_dir), "num_threads": 1},
            "train": {"steps": STEPS, "batch_size": 8, "seq_len": 32, "log_every": 1,
                      "eval_every": 3, "eval_batches": 2, "routing_every": 3},
            "optimizer": {"lr": 1e-2, "routing_lr": 3e-2, "warmup_steps": 2,
                          "decay_steps": STEPS},
            "checkpoint": {"every": 3, "keep": 5}}
    path = Path(output_dir).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path, list(overrides))
    path.write_text(dump_config(cfg))  # resolved, for runs in subprocesses
    return cfg


def losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(output_dir) / "metrics.jsonl")
            if "loss" in r}


def params_at(output_dir, step):
    model = load_checkpoint(Path(output_dir) / "checkpoints", step)
    return jax.device_get(nnx.state(model, nnx.Param).to_pure_dict())


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "straight"
    summary = run(config(data_dir, out))
    return out, summary


@pytest.fixture(scope="module")
def interrupted(data_dir, tmp_path_factory):
    """SPLIT steps, then a copy of the run folder as it stood then."""
    out = tmp_path_factory.mktemp("runs") / "interrupted"
    run(config(data_dir, out, f"train.steps={SPLIT}"))
    copy = out.with_name("interrupted_copy")
    shutil.copytree(out, copy)
    return out, copy


def test_run_writes_metrics_checkpoints_and_plots(straight):
    out, summary = straight
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eta_s"):
            assert np.isfinite(r[key]), key
        assert "mfu" in r  # null on CPU: no peak in the table and none given
    assert train[-1]["loss"] < train[0]["loss"]
    evals = {r["step"]: r["val_ppl"] for r in records if "val_ppl" in r}
    assert sorted(evals) == [0, 3, 6] and evals[6] < evals[0]
    routing = [r["routing"] for r in records if "routing" in r]
    assert len(routing) == 2
    max_weight = np.array(routing[-1]["max_weight"], dtype=float)  # null -> nan
    assert max_weight.shape == (4, 2) and np.isnan(max_weight[0, 0])  # layer 0's unused site
    assert np.all((max_weight[1:] > 0) & (max_weight[1:] <= 1))
    # Checkpoints every 3 steps, the run's config beside them, plots, TensorBoard events.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "6"]
    assert load_config(out / "config.yaml") == load_config(out.with_suffix(".yaml"))
    for name in ("loss.png", "routing.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert summary["checkpoint"] == str((out / "checkpoints" / "6").absolute())
    assert summary["final"]["val_ppl"] == evals[6]


def test_resume_is_bitwise(straight, interrupted, data_dir):
    """STEPS straight == SPLIT steps, stop, resume, STEPS - SPLIT steps: losses and parameters
    (with the default data.packing, documents)."""
    out, _ = interrupted
    summary = run(config(data_dir, out))
    assert summary["start_step"] == SPLIT
    assert losses(out) == losses(straight[0])  # metrics.jsonl holds steps 1..6 once each
    for a, b in zip(jax.tree.leaves(params_at(out, STEPS)),
                    jax.tree.leaves(params_at(straight[0], STEPS))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_resume_onto_another_mesh(straight, interrupted, data_dir):
    _, copy = interrupted
    # The restored state is bitwise the saved one, laid out on the new mesh.
    cfg = config(data_dir, copy)
    tx = make_optimizer(cfg.optimizer, STEPS)
    restored = {}
    for shape in ((8, 1, 1), (2, 2, 2)):
        mesh = make_mesh(*shape)
        shardings = to_shardings(state_specs(cfg.model, tx, mesh), mesh)
        target = abstract_state(cfg.model, tx, shardings)
        iterator = Trainer(cfg).train_iter
        with Checkpointer(copy / "checkpoints", cfg.checkpoint) as saved:
            state, _, _, data_restored = saved.restore(SPLIT, target, iterator)
        assert data_restored
        assert state.params["layers"]["mlp"]["up_proj"].sharding == (
            shardings.params["layers"]["mlp"]["up_proj"])
        assert iterator.get_state() == {"next_index": SPLIT}
        restored[shape] = jax.device_get(state)
    for a, b in zip(*map(jax.tree.leaves, restored.values())):
        np.testing.assert_array_equal(a, b)
    # Training on from there gives the straight run's losses up to float reassociation, also
    # when the checkpoint came from another number of processes (its data state is then the
    # step: batch s is a function of (seed, s) alone).
    data_state = copy / "checkpoints" / str(SPLIT) / "data"
    (data_state / "process_0-of-1.json").rename(data_state / "process_0-of-2.json")
    run(config(data_dir, copy, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"))
    resumed, reference = losses(copy), losses(straight[0])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([resumed[s] for s in range(SPLIT + 1, STEPS + 1)],
                               [reference[s] for s in range(SPLIT + 1, STEPS + 1)], atol=1e-5)


def test_resume_refuses_a_different_data_order(interrupted, data_dir):
    out, _ = interrupted
    with (Trainer(config(data_dir, out, "seed=1")) as trainer,
          pytest.raises(PreflightError, match="saved with seed=0, resuming with 1 would change")):
        trainer.initial_state()
    with (Trainer(config(data_dir, out, "data.packing=concat")) as trainer,
          pytest.raises(PreflightError, match="saved with data.packing='documents', resuming "
                                              "with 'concat' would change")):
        trainer.initial_state()


@pytest.fixture(scope="module")
def straight_concat(data_dir, tmp_path_factory):
    """The straight run with data.packing=concat (the runs above use the default, documents)."""
    out = tmp_path_factory.mktemp("runs") / "straight_concat"
    run(config(data_dir, out, "data.packing=concat"))
    return out


def test_packing_changes_what_a_step_trains_on(straight, straight_concat):
    documents, concat = losses(straight[0]), losses(straight_concat)
    assert documents[1] != concat[1]


def _forget_packing(checkpoint: Path) -> None:
    """Rewrites a checkpoint's saved run config as it was before data.packing existed."""
    edited = 0
    for path in (checkpoint / "run").rglob("*"):
        try:
            record = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError, IsADirectoryError):
            continue
        if isinstance(record, dict) and "config" in record:
            del record["config"]["data"]["packing"]
            path.write_text(json.dumps(record))
            edited += 1
    assert edited == 1


def test_a_checkpoint_saved_before_packing_resumes_as_concat(straight_concat, data_dir,
                                                               tmp_path):
    """Its saved config has no data.packing: it ran with concat, so it resumes with concat
    only, bitwise the uninterrupted concat run."""
    old = tmp_path / "old"
    shutil.copytree(straight_concat, old)
    shutil.rmtree(old / "checkpoints" / str(STEPS))
    _forget_packing(old / "checkpoints" / str(SPLIT))
    with (Trainer(config(data_dir, old)) as trainer,
          pytest.raises(PreflightError, match="saved with data.packing='concat', resuming with "
                                              "'documents' would change")):
        trainer.initial_state()
    summary = run(config(data_dir, old, "data.packing=concat"))
    assert summary["start_step"] == SPLIT
    assert losses(old) == losses(straight_concat)
    for a, b in zip(jax.tree.leaves(params_at(old, STEPS)),
                    jax.tree.leaves(params_at(straight_concat, STEPS))):
        np.testing.assert_array_equal(a, b)


def test_fine_tuning_starts_from_a_model_checkpoint(data_dir, tmp_path):
    cfg_model = ModelConfig(**MODEL)
    saved = init_model(cfg_model, seed=7)
    save_checkpoint(saved, tmp_path / "pretrained")
    # lr is 0 at step 0 (warmup), so one step leaves the parameters as they were loaded.
    out = tmp_path / "finetune"
    run(config(data_dir, out, f"train.init_from={tmp_path / 'pretrained'}", "train.steps=1",
               "optimizer.warmup_steps=5"))
    expected = jax.device_get(nnx.state(saved, nnx.Param).to_pure_dict())
    for a, b in zip(jax.tree.leaves(params_at(out, 1)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    # Refused by the preflight, before the run's folder exists.
    with pytest.raises(PreflightError, match=r"differs from the run's model in num_layers "
                                             r"\(checkpoint 4, run 2\)"):
        Trainer(config(data_dir, tmp_path / "bad", f"train.init_from={tmp_path / 'pretrained'}",
                       "model.num_layers=2"))
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_fine_tuning_a_preserving_conversion_starts_at_the_plain_loss(data_dir, tmp_path):
    """Qwen3 -> block (gated against the residual stream) -> trainer: the first loss is the
    plain model's (to float32 rounding: another program); then the gates open and the two
    runs part."""
    plain = init_model(ModelConfig(**{**MODEL, "residual": "baseline"}), seed=7)
    save_checkpoint(plain, tmp_path / "plain")
    converted = load_pretrained(save_pretrained(plain, tmp_path / "qwen3"), residual="block",
                                num_blocks=2, preserve_function=True)
    save_checkpoint(converted, tmp_path / "converted")
    steps = ["train.steps=3", "checkpoint.every=3"]
    run(config(data_dir, tmp_path / "base", f"train.init_from={tmp_path / 'plain'}",
               "model.residual=baseline", *steps))
    run(config(data_dir, tmp_path / "block", f"train.init_from={tmp_path / 'converted'}",
               "model.residual=block", "model.router_init=zeros", "model.routing_gate=true",
               "model.gate_base=stream", *steps))
    base, block = losses(tmp_path / "base"), losses(tmp_path / "block")
    assert_float32_equal(block[1], base[1])
    assert block[3] != base[3]
    gates = params_at(tmp_path / "block", 3)["layers"]["mlp_site"]["gate"]
    assert np.all(gates != 0), gates
    # the routing record reports the gates (how far each site has moved off the plain model)
    logged = [r["routing"] for r in read_metrics(tmp_path / "block" / "metrics.jsonl")
              if "routing" in r and r["step"] == 3][0]
    np.testing.assert_allclose(np.asarray(logged["gate"])[:, 1], gates, rtol=1e-6)
    assert np.asarray(logged["gate"]).shape == (4, 2) and np.isfinite(logged["final_gate"])


@pytest.mark.slow
def test_two_processes_match_one(data_dir, tmp_path):
    """launch/local.sh 2: both processes report the losses of a one-process run on as many
    devices (2), and together they write one checkpoint with each process's data state."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    overrides = ["train.steps=4", "checkpoint.every=2", "train.eval_every=2", "mesh.data=2"]
    multi = config(data_dir, tmp_path / "two", *overrides).output_dir
    single = config(data_dir, tmp_path / "one", *overrides).output_dir
    two = subprocess.run([str(repo / "launch/local.sh"), "2", "--config", multi + ".yaml"],
                         env={**env, "CPU_DEVICES": "2"}, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "delta_jax.train", "--config", single + ".yaml"],
                         env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    reported = {p: re.findall(rf"^\[{p}\] step (\d+)/4 \| loss ([\d.]+)", two.stdout, re.M)
                for p in ("p0", "p1")}
    assert len(reported["p0"]) == 4 and reported["p0"] == reported["p1"]
    assert "2 cpu device(s) in 2 process(es)" in two.stdout
    np.testing.assert_allclose([losses(multi)[s] for s in range(1, 5)],
                               [losses(single)[s] for s in range(1, 5)], rtol=0, atol=1e-6)
    data_state = Path(multi) / "checkpoints" / "4" / "data"
    assert sorted(p.name for p in data_state.glob("*.json")) == [
        "process_0-of-2.json", "process_1-of-2.json"]


def test_the_device_peak_is_logged_beside_the_compiled_counts():
    from delta_jax.train.loop import _compiled_memory, device_peak_text
    x = jax.numpy.ones((256, 256))
    compiled = jax.jit(lambda a: (a @ a).sum()).lower(x).compile()
    total, live = _compiled_memory(compiled)
    assert total >= x.nbytes  # its argument at least
    gib = 2**30
    text = device_peak_text({"peak_bytes_in_use": 3 * gib, "bytes_limit": 16 * gib},
                            (4 * gib, 2 * gib))
    assert text == ("device 0 peak memory in use 3.00 GiB of 16.00 (the compiled step: 4.00 GiB "
                    "by memory_analysis, 2.00 live at the peak)")
    assert device_peak_text(None, (4 * gib, 2 * gib)) is None  # CPUs keep no statistics
    assert device_peak_text({"bytes_in_use": 1}, None) is None
