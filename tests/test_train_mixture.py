"""Training on a data.mixture with W&B logging offline, end to end on real files: each source's
validation loss, the realised shares, a bitwise resume, and the W&B run's files holding what
metrics.jsonl holds."""
import ast
import json
import math
import os
import re
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import yaml

from delta_jax.data.pipeline import MixtureSchedule
from delta_jax.data.prepare import prepare
from delta_jax.loading import run_data_tokenizer
from delta_jax.train.config import load_config
from delta_jax.train.loop import run
from delta_jax.train.metrics import read_metrics

pytestmark = pytest.mark.slow  # each run compiles its step

STEPS, SPLIT, BATCH = 4, 2, 8
SOURCES = {"text": ("argparse.py", "textwrap.py", "string.py"), "paths": ("pathlib.py",)}
WEIGHTS = {"text": 3.0, "paths": 1.0}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prepared sources: docstrings of different stdlib modules (byte tokenizer)."""
    root, stdlib = tmp_path_factory.mktemp("mixture"), Path(sysconfig.get_paths()["stdlib"])
    for name, modules in SOURCES.items():
        with (root / f"{name}.jsonl").open("w") as f:
            for module in modules:
                for node in ast.walk(ast.parse((stdlib / module).read_text("utf-8"))):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                        if doc := ast.get_docstring(node):
                            f.write(json.dumps({"text": doc}) + "\n")
        prepare([root / f"{name}.jsonl"], root / name, validation_fraction=0.2, progress=False)
    return root


def config(sources, output_dir, *overrides):
    tree = {"output_dir": str(output_dir), "seed": 0,
            "model": dict(vocab_size=260, hidden_size=32, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=16, intermediate_size=64, num_blocks=2),
            "data": {"mixture": [{"name": n, "path": str(sources / n), "weight": w}
                                 for n, w in WEIGHTS.items()], "num_threads": 1},
            "train": {"steps": STEPS, "batch_size": BATCH, "seq_len": 32, "log_every": 1,
                      "eval_every": 2, "eval_batches": 2, "routing_every": 2,
                      "wandb": {"project": "delta-tests", "mode": "offline",
                                "group": "mixture"}},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1, "decay_steps": STEPS},
            "checkpoint": {"every": 2, "keep": 3}}
    path = Path(output_dir).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(tree))
    return load_config(path, list(overrides))


@pytest.fixture(scope="module")
def straight(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "straight"
    run(config(sources, out))
    return out


def test_each_source_is_validated_and_the_shares_logged(straight):
    records = read_metrics(straight / "metrics.jsonl")
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        losses = [r[f"val/{name}/loss"] for name in WEIGHTS]
        assert all(np.isfinite(losses)) and losses[0] != losses[1]
        for name in WEIGHTS:
            assert r[f"val/{name}/ppl"] == pytest.approx(math.exp(r[f"val/{name}/loss"]))
        # the mixture's loss: the sources' weighted as in training
        assert r["val_loss"] == pytest.approx(np.dot(losses, [0.75, 0.25]))
    assert evals[-1]["val/paths/loss"] < evals[0]["val/paths/loss"]
    assert run_data_tokenizer(straight) == "byte"  # what the tools decode its model's ids with
    schedule = MixtureSchedule(list(WEIGHTS.values()), seed=0)
    for r in (r for r in records if "loss" in r):
        counts = schedule.counts((r["step"] - 1) * BATCH, r["step"] * BATCH)
        assert [r[f"mix/{name}"] for name in WEIGHTS] == (counts / BATCH).tolist()


def test_resume_is_bitwise(straight, sources, tmp_path):
    out = tmp_path / "interrupted"
    run(config(sources, out, f"train.steps={SPLIT}"))
    summary = run(config(sources, out))
    assert summary["start_step"] == SPLIT
    mine, reference = (read_metrics(o / "metrics.jsonl") for o in (out, straight))
    keys = lambda r: {k: v for k, v in r.items() if k.startswith(("loss", "val", "mix"))}  # noqa: E731
    assert [keys(r) for r in mine] == [keys(r) for r in reference]
    # the resumed run continues the same W&B run
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in runs}) == 1


def test_two_processes_match_one_and_only_process_0_logs_to_wandb(sources, tmp_path):
    """launch/local.sh 2 on a mixture: both processes report the losses of a one-process run
    on as many devices (each reads its half of every global batch), and the W&B run is one."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    overrides = ["train.steps=3", "train.eval_every=3", "mesh.data=2", "train.plots=false"]
    outputs = {}
    for name, command, extra in (
            ("two", [str(repo / "launch/local.sh"), "2"],
             {"CPU_DEVICES": "2", "PYTHON": sys.executable}),
            ("one", [sys.executable, "-m", "delta_jax.train"],
             {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})):
        config(sources, tmp_path / name, *overrides)
        done = subprocess.run([*command, "--config", str(tmp_path / f"{name}.yaml"),
                               *overrides], env={**env, **extra}, capture_output=True,
                              text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs[name] = done.stdout
    reported = {p: re.findall(rf"^\[{p}\] step (\d+)/3 \| loss ([\d.]+)", outputs["two"], re.M)
                for p in ("p0", "p1")}
    assert len(reported["p0"]) == 3 and reported["p0"] == reported["p1"]
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                     if "loss" in r] for name in outputs}
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=0, atol=1e-6)
    assert len(list((tmp_path / "two" / "wandb").glob("offline-run-*"))) == 1


def wandb_records(run_dir: Path):
    """The records of an offline run's run-<id>.wandb: a LevelDB-style log (a 7-byte file
    header, then 32 KiB blocks of records <crc32, length u16, type u8> + payload, a payload cut
    over blocks as FIRST, MIDDLE..., LAST) of wandb_internal_pb2.Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block, pos, pieces = path.read_bytes(), 32768, 7, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pieces.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def test_wandb_offline_files_hold_the_metrics_config_and_plots(straight):
    (run_dir,) = (straight / "wandb").glob("offline-run-*")
    records = list(wandb_records(run_dir))
    (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (header.project, header.run_group, header.display_name) == ("delta-tests", "mixture",
                                                                      "straight")
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert [s["name"] for s in config["data"]["mixture"]] == list(WEIGHTS)
    assert config["train"]["wandb"]["mode"] == "offline"
    logged = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                     for i in r.history.item}
            logged.setdefault(items["_step"], {}).update(items)
    for record in read_metrics(straight / "metrics.jsonl"):
        step = logged[record["step"]]
        for key in ("loss", "grad_norm", "mix/paths"):
            if key in record:
                assert step[f"train/{key}"] == pytest.approx(record[key], rel=1e-6), key
        for key in ("val_loss", "val/text/loss", "val/paths/ppl"):
            if key in record:
                assert step[f"eval/{key}"] == pytest.approx(record[key], rel=1e-6), key
        if "routing" in record:
            assert any(k.startswith("routing/max_weight/layer1_") for k in step)
    images = {k.split("/")[1] for k in logged[STEPS] if k.startswith("plots/")
              and k.endswith("/_type")}
    assert images == {"loss", "routing"}
    assert len(list((run_dir / "files" / "media" / "images").rglob("*.png"))) == 2


def test_the_mixture_demo_logs_both_validation_losses(tmp_path):
    """configs/demo_mixture.yaml, its model made small: the embedded corpus's two parts are
    built, and each part's validation loss is logged and printed."""
    root = Path(__file__).resolve().parent.parent
    tiny = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
            "model.num_kv_heads=1", "model.head_dim=16", "model.intermediate_size=64"]
    done = subprocess.run(
        [sys.executable, "-m", "delta_jax.train", "--config", "configs/demo_mixture.yaml",
         f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
         "train.steps=2", "train.log_every=1", "train.eval_every=2", "train.plots=false",
         *tiny], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(np.isfinite(r["val/code/loss"]) and np.isfinite(r["val/prose/loss"])
               for r in evals)
    assert "val_loss code " in done.stdout and " prose " in done.stdout
    assert re.search(r"by source +code loss [\d.]+, prose loss [\d.]+", done.stdout)
