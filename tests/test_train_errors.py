"""A user's mistake in `python -m delta_jax.train` ends as one `error:` line on stderr (the last,
naming the key, value or path at fault and what was expected) and exit code 2, before anything
is compiled, with nothing written: the run's folder is never created."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from delta_jax.data.prepare import prepare

ROOT = Path(__file__).resolve().parent.parent
# The demo's model, made small; 2 CPU devices.
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.intermediate_size=64", "train.batch_size=4",
        "train.seq_len=32", "data.num_threads=1"]
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tiny prepared corpus (byte tokenizer: 257 ids, the demo's vocabulary is 384)."""
    root = tmp_path_factory.mktemp("errors_data")
    with (root / "docs.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document {i}: " + "some words to read " * 8}) + "\n")
    prepare([root / "docs.jsonl"], root / "data", validation_fraction=0.25, progress=False)
    return root / "data"


def train(run_dir: Path, data_dir: Path, *overrides: str,
          config: Path = ROOT / "configs/demo.yaml", env: dict | None = None
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "delta_jax.train", "--config", str(config),
                           f"output_dir={run_dir}", f"data.path={data_dir}", *TINY, *overrides],
                          cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=300)


def assert_refused(done: subprocess.CompletedProcess, run_dir: Path, *named: str) -> str:
    """Exit 2, the last stderr line `error: ...` holding every string of `named`, no
    traceback, and no run folder; returns the error line."""
    output = done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode == 2, output
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: "), output
    for text in named:
        assert text in last, last
    assert "Traceback" not in done.stderr, output
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))
    return last


def _slow(*args):  # make test keeps one case of a kind; make test-all runs every case
    return pytest.param(*args, marks=pytest.mark.slow)


@pytest.mark.parametrize("overrides, named", [
    (["train.batch_size=3"], ["train.batch_size=3", "2 devices", "train.batch_size=2",
                              "train.batch_size=4"]),
    _slow(["train.batch_size=6", "train.grad_accum=2"], ["train.grad_accum=2", "a multiple of 4",
                                                         "train.batch_size=8"]),
    (["mesh.data=4"], ["data=4", "but 2 are available", "mesh.data=-1"]),
    _slow(["mesh.fsdp=3"], ["data=-1", "2 devices do not split over the other axes' 3",
                            "mesh.data=-1 mesh.fsdp=1"]),
    _slow(["mesh.dcn_data=2"], ["across slices", "mesh.dcn_data"]),
    (["train.bogus=1"], ["unknown key(s) train.bogus", "valid keys: train.steps"]),
    _slow(["train.steps=x"], ["train.steps='x' is invalid: expected int"]),
    _slow(["model.residual=nope"], ["residual='nope' is invalid", "delta_block"]),
    _slow(["model.vocab_size=200"], ["model.vocab_size=200", "'byte' tokenizer",
                                     "expected model.vocab_size >= 257"]),
    _slow(["data.validation_split=nope"], ["no split 'nope'"]),
    _slow(["train.trainable=layers/nope"], ["train.trainable pattern 'layers/nope' matches no "
                                            "parameter", "layers/attn_site/query"]),
])
def test_config_misfits(data_dir, tmp_path, overrides, named):
    assert_refused(train(tmp_path / "run", data_dir, *overrides), tmp_path / "run", *named)


def test_missing_data_path(tmp_path):
    missing = tmp_path / "no_data"
    done = train(tmp_path / "run", missing)
    assert_refused(done, tmp_path / "run", f"data.path='{missing}' is not readable",
                   "metadata.json: missing")
    assert not missing.exists()


@pytest.mark.slow
def test_missing_tokenizer_file(tmp_path):
    spec = f"tfds:tiny_docs?tokenizer={tmp_path / 'tokenizer.json'}"
    assert_refused(train(tmp_path / "run", spec), tmp_path / "run", "data.path='tfds:tiny_docs",
                   f"{tmp_path / 'tokenizer.json'}: no such tokenizer file")


@pytest.mark.slow
def test_wandb_without_the_package_names_the_install(data_dir, tmp_path):
    """A `wandb` that fails to import (as a missing one does) ahead on the path."""
    (tmp_path / "shadow" / "wandb").mkdir(parents=True)
    (tmp_path / "shadow" / "wandb" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    done = train(tmp_path / "run", data_dir, "train.wandb.project=delta",
                 env={**ENV, "PYTHONPATH": path})
    assert_refused(done, tmp_path / "run", "train.wandb.project='delta' needs the wandb package",
                   "pip install wandb==")


@pytest.mark.slow
def test_a_mixture_with_data_path_is_refused(data_dir, tmp_path):
    assert_refused(train(tmp_path / "run", data_dir, config=ROOT / "configs/demo_mixture.yaml"),
                   tmp_path / "run", f"data.path='{data_dir}' and data.mixture are exclusive")


@pytest.mark.slow
def test_missing_init_from(data_dir, tmp_path):
    assert_refused(train(tmp_path / "run", data_dir, f"train.init_from={tmp_path / 'ckpt'}"),
                   tmp_path / "run", f"train.init_from='{tmp_path / 'ckpt'}' is not a model "
                   "checkpoint")


@pytest.mark.slow
def test_missing_config_file(data_dir, tmp_path):
    assert_refused(train(tmp_path / "run", data_dir, config=tmp_path / "missing.yaml"),
                   tmp_path / "run", str(tmp_path / "missing.yaml"))


@pytest.mark.slow
def test_output_dir_below_a_file(data_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("kept")
    assert_refused(train(blocker / "run", data_dir), blocker / "run",
                   f"{blocker / 'run'} is not writable")
    assert blocker.read_text() == "kept" and sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.slow
def test_checkpoint_directory_not_writable_leaves_no_output_dir(data_dir, tmp_path):
    """The output folder is writable but the checkpoint folder is not: neither is created."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert_refused(train(tmp_path / "run", data_dir, f"checkpoint.directory={blocker / 'ckpt'}"),
                   tmp_path / "run", f"{blocker / 'ckpt'} is not writable")


@pytest.mark.slow
def test_resuming_with_another_trainable_subset(data_dir, tmp_path):
    """The checkpoint's optimizer state holds the routing parameters alone: resuming with every
    parameter is refused, naming both subsets and how to train the new one, saving nothing."""
    run_dir = tmp_path / "run"
    first = train(run_dir, data_dir, "train.trainable=routing", "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    done = train(run_dir, data_dir, "train.steps=4")
    assert done.returncode == 2, done.stderr[-3000:]
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "saved with train.trainable='routing', resuming with 'all'" in last, last
    assert f"train.init_from='{run_dir / 'checkpoints'}'" in last, last
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
