"""Real faults on a tiny run: SIGTERM/SIGINT, kill -9 (also mid-save), damaged checkpoints, NaN
steps, failed preflight checks. Wherever the run can go on, it must end bitwise equal (losses and
parameters) to the uninterrupted run of test_train_loop's config."""
import dataclasses
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from delta_jax.train.checkpoints import Checkpointer
from delta_jax.train.faults import EXIT_NONFINITE, EXIT_PREEMPTED, PreflightError, check_writable
from delta_jax.train.loop import Trainer, run
from delta_jax.train.metrics import read_metrics
from delta_jax.train.state import abstract_state
from test_train_loop import STEPS, config, data_dir, losses, params_at  # noqa: F401


def assert_same_run(out, reference):
    assert losses(out) == losses(reference)
    for a, b in zip(jax.tree.leaves(params_at(out, STEPS)),
                    jax.tree.leaves(params_at(reference, STEPS))):
        np.testing.assert_array_equal(a, b)


def start(cfg, tmp_root) -> subprocess.Popen:
    """`python -m delta_jax.train --config <output_dir>.yaml`. It inherits the test run's
    compilation cache (conftest.py), which already holds the steps this process compiled."""
    return subprocess.Popen([sys.executable, "-m", "delta_jax.train", "--config",
                             cfg.output_dir + ".yaml"], cwd=tmp_root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_line(proc, text, timeout=300) -> str:
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.time() > deadline:
            return "".join(seen)
    raise AssertionError(f"process ended before printing {text!r}:\n{''.join(seen)[-3000:]}")


def interrupt(cfg, tmp_root, sig) -> str:
    """Start a run, send `sig` once its train step has compiled, and expect exit 75; the
    run's output."""
    proc = start(cfg, tmp_root)
    wait_for_line(proc, "train step compiled")
    proc.send_signal(sig)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    return output


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def straight(data_dir, root):  # noqa: F811
    out = root / "straight"
    run(config(data_dir, out))
    return out


def test_sigterm_checkpoints_and_resumes_bitwise(straight, data_dir, root):  # noqa: F811
    cfg = config(data_dir, root / "sigterm")
    # The signal usually lands during the step-0 evaluation: the run trains step 1,
    # checkpoints it and exits.
    output = interrupt(cfg, root, signal.SIGTERM)
    step = int(re.search(r"SIGTERM received: checkpointed step (\d+) at", output)[1])
    assert 1 <= step < STEPS  # usually 1: the signal lands during the step-0 evaluation
    with Checkpointer(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint) as saved:
        assert saved.steps()[0] == step
    run(cfg)
    assert_same_run(cfg.output_dir, straight)


@pytest.mark.slow
def test_sigint_exits_with_the_same_code(data_dir, root):  # noqa: F811
    output = interrupt(config(data_dir, root / "sigint"), root, signal.SIGINT)
    assert re.search(r"SIGINT received: checkpointed step \d+ at", output), output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_resumes_from_the_newest_complete_checkpoint(straight, data_dir, root,  # noqa: F811
                                                            seed):
    """SIGKILL at a random moment; seed 0 kills during the first save (its temporary directory
    exists). The next start cleans up and ends like the uninterrupted run."""
    cfg = config(data_dir, root / f"kill{seed}", "checkpoint.every=1")
    ckpts = Path(cfg.output_dir) / "checkpoints"
    proc = start(cfg, root)
    wait_for_line(proc, "train step compiled")
    if seed == 0:
        deadline = time.time() + 120
        while not any("tmp" in p.name for p in ckpts.iterdir()) and time.time() < deadline:
            time.sleep(0.002)
        assert time.time() < deadline, "never saw a save in progress"
    else:
        time.sleep(random.Random(seed).uniform(0.0, 4.0))
    proc.kill()
    proc.wait(timeout=60)
    left = sorted(p.name for p in ckpts.iterdir())
    if seed == 0:
        assert any("tmp" in name for name in left), left  # the save really was cut short
    run(cfg)
    assert not any("tmp" in p.name for p in ckpts.iterdir()), left
    assert_same_run(cfg.output_dir, straight)


# Orbax leaves the coroutines of the other arrays' reads unawaited when one read fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", *[pytest.param(d, marks=pytest.mark.slow)
                                                  for d in ("delete_item", "bad_metadata")]])
def test_a_damaged_newest_checkpoint_falls_back(straight, data_dir, root, damage,  # noqa: F811
                                                caplog):
    out = root / f"damaged_{damage}"
    shutil.copytree(straight, out)
    newest = out / "checkpoints" / str(STEPS)
    if damage == "truncate":
        victim = max((p for p in (newest / "params").rglob("*") if p.is_file()),
                     key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "delete_item":
        shutil.rmtree(newest / "opt_state")
    else:
        (newest / "model_config" / "metadata").write_text("{not json")
    cfg = config(data_dir, out, "checkpoint.retry_wait_s=0.01")
    with Trainer(cfg) as trainer, jax.set_mesh(trainer.mesh):
        state, origin = trainer.initial_state()
    assert origin == f"resumed from {out / 'checkpoints' / '3'}"
    assert int(state.step) == 3
    messages = [r.getMessage() for r in caplog.records]
    # Read three times (checkpoint.read_retries=2 by default) before it counts as damaged.
    assert [m.split("; ")[1] for m in messages if str(newest) in m and "failed" in m] == [
        "retry 1 of 2 in 0.0 s", "retry 2 of 2 in 0.0 s"]
    [line] = [m for m in messages if "damaged checkpoint" in m]
    assert str(newest) in line and (out / "checkpoints" / f"{STEPS}.corrupt").is_dir()
    if damage == "truncate":  # training on from step 3 rewrites step 6 as before
        run(cfg)
        assert_same_run(out, straight)


class FilesAppearOnRetry(logging.Handler):
    """A store whose first read of a checkpoint finds files missing (as an object store that is
    not yet consistent, or a flaky network filesystem, does): `hidden` is moved back into place
    when the checkpointer logs its first retry."""

    def __init__(self, hidden: Path, place: Path):
        super().__init__()
        self.hidden, self.place, self.failures = hidden, place, 0

    def emit(self, record):
        if "retry 1 of" in record.getMessage():
            self.failures += 1
            self.hidden.rename(self.place)


def test_a_read_that_fails_at_first_is_retried_not_called_damaged(straight, data_dir,  # noqa: F811
                                                                  root, caplog):
    out = root / "flaky_read"
    shutil.copytree(straight, out)
    item = out / "checkpoints" / str(STEPS) / "opt_state"
    item.rename(item.with_name("opt_state.unavailable"))
    flaky = FilesAppearOnRetry(item.with_name("opt_state.unavailable"), item)
    logging.getLogger("delta_jax.train.checkpoints").addHandler(flaky)
    try:
        with (Trainer(config(data_dir, out, "checkpoint.retry_wait_s=0.01")) as trainer,
              jax.set_mesh(trainer.mesh)):
            state, origin = trainer.initial_state()
    finally:
        logging.getLogger("delta_jax.train.checkpoints").removeHandler(flaky)
    assert flaky.failures == 1  # the first read did fail
    assert origin == f"resumed from {out / 'checkpoints' / str(STEPS)}" and int(state.step) == STEPS
    assert not any("damaged" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", str(STEPS)]
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)),
                    jax.tree.leaves(params_at(straight, STEPS))):
        np.testing.assert_array_equal(a, b)


def test_nan_steps_are_skipped_without_touching_the_state(data_dir, root):  # noqa: F811
    cfg = config(data_dir, root / "nan", "train.steps=3", "checkpoint.every=1",
                 "train.inject_nan_steps=[2]")
    run(cfg)
    train = {r["step"]: r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
             if "skipped" in r}
    assert [train[s]["skipped"] for s in (1, 2, 3)] == [0, 1, 0]
    assert train[2]["loss"] is None and np.isfinite(train[3]["loss"])
    with Trainer(cfg) as trainer, jax.set_mesh(trainer.mesh):
        target = abstract_state(cfg.model, trainer.tx, trainer.shardings)
        one, two = (jax.device_get(trainer.checkpointer.restore(s, target, trainer.train_iter)[0])
                    for s in (1, 2))
    for a, b in zip(jax.tree.leaves((one.params, one.opt_state)),
                    jax.tree.leaves((two.params, two.opt_state))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_consecutive_nan_steps_stop_the_run(data_dir, root):  # noqa: F811
    cfg = config(data_dir, root / "nan_stop", "checkpoint.every=1",
                 "train.inject_nan_steps=[2,3,4]", "train.max_nonfinite_steps=2")
    proc = start(cfg, root)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_NONFINITE, output[-3000:]
    assert "stopped at step 3: 2 consecutive steps had a non-finite loss" in output
    assert "step 2: non-finite loss nan" in output
    # The checkpoint it names restores, and it holds step 1's parameters.
    ckpts = Path(cfg.output_dir) / "checkpoints"
    named = int(output.split("the checkpoint ")[1].split()[0].rstrip("/").split("/")[-1])
    for a, b in zip(jax.tree.leaves(params_at(cfg.output_dir, named)),
                    jax.tree.leaves(params_at(cfg.output_dir, 1))):
        np.testing.assert_array_equal(a, b)
    assert (ckpts / str(named)).is_dir()


def test_preflight_refusals(straight, data_dir, root, tmp_path):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(PreflightError, match=f"{blocker}/run is not writable"):
        Trainer(dataclasses.replace(config(data_dir, tmp_path / "ok"),
                                    output_dir=str(blocker / "run")))
    with pytest.raises(PreflightError, match="MiB free, a checkpoint needs about"):
        check_writable(tmp_path, 2**62)
    with pytest.raises(PreflightError, match="data.path='/nonexistent' is not readable"):
        Trainer(config(data_dir, tmp_path / "nodata", "data.path=/nonexistent"))
    with pytest.raises(PreflightError, match=r"mesh data=3 x fsdp=1 x tensor=1 = 3 devices, "
                                             "but 8"):
        Trainer(config(data_dir, tmp_path / "mesh", "mesh.data=3"))
    # A changed model shape is refused with the differing fields, before Orbax reads arrays.
    out = tmp_path / "changed"
    shutil.copytree(straight, out)
    with (Trainer(config(data_dir, out, "model.hidden_size=64", "model.num_blocks=4")) as trainer,
          pytest.raises(PreflightError, match=r"hidden_size \(checkpoint 32, run 64\), "
                                              r"num_blocks \(checkpoint 2, run 4\)")):
        trainer.initial_state()


def _read_only(folder, on: bool) -> None:
    """chmod for a normal user; root ignores permissions, so it sets the immutable flag."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555 if on else 0o755)


def test_read_only_output_dir_is_refused(data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "ro"
    out.mkdir()
    _read_only(out, True)
    try:
        with pytest.raises(PreflightError, match=f"{out / 'run'} is not writable"):
            Trainer(dataclasses.replace(config(data_dir, tmp_path / "ok"),
                                        output_dir=str(out / "run")))
    finally:
        _read_only(out, False)
