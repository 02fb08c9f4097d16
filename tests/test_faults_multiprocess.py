"""Faults across processes: two-process runs through launch/local.sh 2 (two JAX processes joined
by jax.distributed, one CPU device each, mesh data=2), on test_train_loop's tiny config.

SIGTERM to one process, SIGKILL of one process, and a damaged newest checkpoint; after each, the
restarted run must end bitwise equal (losses and parameters) to an uninterrupted two-process run.
Each test prints its row of the fault table (fault, what happened, time to exit, bitwise)."""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from test_train_loop import config, data_dir, losses, params_at  # noqa: F401

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 40  # long enough to be interrupted mid-run; the lr schedule is test_train_loop's
OVERRIDES = (f"train.steps={STEPS}", "checkpoint.every=10", "train.eval_every=20",
             "train.routing_every=0", "train.log_every=1", "mesh.data=2", "train.plots=false",
             "checkpoint.retry_wait_s=0.01")


def two_process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "CPU_DEVICES": "2", "KILL_AFTER": "10", "STOP_GRACE": "60"}


def launch(cfg) -> subprocess.Popen:
    return subprocess.Popen([str(REPO / "launch/local.sh"), "2", "--config",
                             cfg.output_dir + ".yaml"], env=two_process_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc, timeout=600) -> tuple[int, str]:
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, output


def train_process(output_dir: str, index: int) -> int:
    """The pid of process `index` of the run writing `output_dir` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"delta_jax.train" in argv and f"{output_dir}.yaml".encode() in argv
                    and f"distributed.process_id={index}".encode() in argv):
                return int(entry.name)
    raise AssertionError(f"no process {index} of {output_dir}")


def wait_for_step(proc, step: int, seen: list[str], timeout=300) -> None:
    """Read the launcher's output until both processes have printed `step`."""
    deadline, printed = time.time() + timeout, set()
    for line in proc.stdout:
        seen.append(line)
        if match := re.match(rf"\[(p[01])\] step {step}/", line):
            printed.add(match.group(1))
            if len(printed) == 2:
                return
        if time.time() > deadline:
            break
    raise AssertionError(f"step {step} not reached:\n{''.join(seen)[-3000:]}")


def assert_bitwise(out, reference) -> None:
    assert losses(out) == losses(reference)
    for a, b in zip(jax.tree.leaves(params_at(out, STEPS)),
                    jax.tree.leaves(params_at(reference, STEPS))):
        np.testing.assert_array_equal(a, b)


def started_from(output: str) -> dict[str, str]:
    """{process: where it started}, from each process's `process N: ...` line."""
    return dict(re.findall(r"process (\d): (.+?) \(step", output))


def restart_resumes_bitwise(cfg, step: int, reference) -> str:
    """Launch `cfg` again: both processes resume from checkpoint `step` and the run ends bitwise
    equal to `reference`; the launcher's output."""
    returncode, output = finish(launch(cfg))
    assert returncode == 0, output[-3000:]
    where = f"resumed from {Path(cfg.output_dir).absolute() / 'checkpoints' / str(step)}"
    assert started_from(output) == {"0": where, "1": where}, output[-3000:]
    assert_bitwise(cfg.output_dir, reference)
    return output


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("two_process")
    cfg = config(data_dir, root / "straight", *OVERRIDES)
    returncode, output = finish(launch(cfg))
    assert returncode == 0, output[-3000:]
    return root, cfg.output_dir


def test_sigterm_to_one_process_checkpoints_both_at_one_step(uninterrupted, data_dir):  # noqa: F811
    root, reference = uninterrupted
    cfg = config(data_dir, root / "sigterm", *OVERRIDES)
    proc, seen = launch(cfg), []
    wait_for_step(proc, 3, seen)
    os.kill(train_process(cfg.output_dir, 1), signal.SIGTERM)
    sent = time.time()
    returncode, output = finish(proc)
    took = time.time() - sent
    output = "".join(seen) + output
    assert returncode == 75, output[-3000:]
    saved = re.findall(r"^\[(p[01])\] .*checkpointed step (\d+)", output, re.M)
    assert sorted(p for p, _ in saved) == ["p0", "p1"] and saved[0][1] == saved[1][1], saved
    step = int(saved[0][1])
    assert 3 <= step < STEPS
    data_state = Path(cfg.output_dir) / "checkpoints" / str(step) / "data"
    assert sorted(p.name for p in data_state.glob("*.json")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    restart_resumes_bitwise(cfg, step, reference)
    print(f"\nFAULT SIGTERM to process 1 at step 3: both saved step {step} and exited 75 "
          f"(launcher exit {took:.1f} s after the signal); resumed bitwise: yes")


def test_sigkill_of_one_process_stops_the_other_and_resumes(uninterrupted, data_dir):  # noqa: F811
    root, reference = uninterrupted
    cfg = config(data_dir, root / "sigkill", *OVERRIDES)
    proc, seen = launch(cfg), []
    wait_for_step(proc, 12, seen)  # after the checkpoint of step 10
    os.kill(train_process(cfg.output_dir, 1), signal.SIGKILL)
    killed = time.time()
    returncode, output = finish(proc, timeout=120)
    took = time.time() - killed
    assert returncode == 137, ("".join(seen) + output)[-3000:]  # 128 + SIGKILL, process 1's
    assert took < 30, took  # KILL_AFTER=10 bounds it; no hang in a collective
    with pytest.raises(AssertionError, match="no process 0"):
        train_process(cfg.output_dir, 0)
    last = max(int(p.name) for p in (Path(cfg.output_dir) / "checkpoints").iterdir()
               if p.name.isdigit())
    restart_resumes_bitwise(cfg, last, reference)
    print(f"\nFAULT SIGKILL of process 1 at step 12+: launcher exit 137, process 0 stopped "
          f"{took:.1f} s after the kill; resumed from step {last}, bitwise: yes")


# Orbax leaves the coroutines of the other arrays' reads unawaited when one read fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_is_skipped_by_both(uninterrupted, data_dir):  # noqa: F811
    """Every params file of step 40 truncated: both processes retry, call it damaged, fall back
    to step 30 together, and train on to the same result."""
    root, reference = uninterrupted
    out = root / "damaged"
    shutil.copytree(reference, out)
    newest = out / "checkpoints" / str(STEPS)
    for path in (newest / "params").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    cfg = config(data_dir, out, *OVERRIDES)
    started = time.time()
    output = restart_resumes_bitwise(cfg, 30, reference)
    assert "damaged checkpoint" in output and (out / "checkpoints" / f"{STEPS}.corrupt").is_dir()
    print(f"\nFAULT newest checkpoint damaged: both fell back to step 30 "
          f"(run done in {time.time() - started:.1f} s); bitwise: yes")
