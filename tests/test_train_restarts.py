"""Restarts that lose little and do not recompile: temporary checkpoints by wall time (a real
kill -9 between two permanent checkpoints; two processes agreeing on when to save), the
persistent compilation cache across two processes, and the profiler window's trace."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from delta_jax.cli import enable_compilation_cache
from delta_jax.train.checkpoints import Checkpointer, KeepPermanentAndNewest
from delta_jax.train.loop import run
from test_train_loop import config, data_dir, params_at  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
# The variables through which conftest.py gives every test one shared cache; a test of the
# trainer's own cache settings must run without them.
CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                   "JAX_COMPILATION_CACHE_MAX_SIZE")


def train(cfg, *overrides, env=None, **popen) -> subprocess.Popen:
    """`python -m delta_jax.train --config <output_dir>.yaml [overrides]`, output piped."""
    return subprocess.Popen([sys.executable, "-m", "delta_jax.train", "--config",
                             cfg.output_dir + ".yaml", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, **popen)


def finish(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    return output


def committed_steps(checkpoints: Path) -> list[int]:
    """Step directories Orbax has committed (not those of a save in progress)."""
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def test_the_newest_checkpoint_and_the_newest_permanent_ones_are_kept():
    policy = KeepPermanentAndNewest(every=100, keep=2, last_step=1050)
    saved = [100, 200, 250, 300, 340]  # 250 and 340 temporary (or saved on a stop signal)
    infos = [SimpleNamespace(step=s) for s in saved]
    assert policy.should_preserve(infos, context=None) == [False, True, False, True, True]
    # The run's last step is permanent: a later temporary one does not replace it.
    infos = [SimpleNamespace(step=s) for s in (1000, 1050, 1070)]
    assert policy.should_preserve(infos, context=None) == [True, True, True]
    assert KeepPermanentAndNewest(every=0, keep=3, last_step=None).should_preserve(
        [SimpleNamespace(step=s) for s in (5, 9)], context=None) == [False, True]


@pytest.mark.slow
def test_kill_9_between_permanent_checkpoints_resumes_from_the_temporary_one(data_dir,  # noqa: F811
                                                                           tmp_path):
    """A temporary checkpoint every 0.6 s, permanent ones every 200 steps. SIGKILL once a
    temporary one is committed early in an interval (no permanent one can come before the kill
    lands); the restart resumes from the newest committed step, a temporary one, and the
    permanent ones are all still there and readable."""
    every = 200
    cfg = config(data_dir, tmp_path / "run", "train.steps=100000", f"checkpoint.every={every}",
                 "checkpoint.every_minutes=0.01", "train.log_every=50", "train.eval_every=0",
                 "train.routing_every=0", "train.plots=false", "train.tensorboard=false")
    checkpoints = Path(cfg.output_dir) / "checkpoints"
    proc = train(cfg, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            steps = committed_steps(checkpoints) if checkpoints.exists() else []
            permanent = [s for s in steps if s % every == 0]
            if permanent and steps[-1] % every and steps[-1] % every < every * 3 // 4:
                break
            time.sleep(0.005)
        proc.kill()
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    assert time.time() < deadline, f"no temporary checkpoint after a permanent one: {steps}"
    assert "temporary checkpoint" in output
    left = committed_steps(checkpoints)
    permanent = [s for s in left if s % every == 0]
    newest = left[-1]
    assert newest % every and newest > permanent[-1], left
    # At most the newest temporary one and the one it replaces (deleted after its commit).
    assert len(left) - len(permanent) <= 2, left

    output = finish(train(cfg, f"train.steps={newest + 2}"))
    assert f"resumed from {checkpoints / str(newest)} (step {newest})" in output, output[-3000:]
    # The temporary checkpoint gave way to the final one; every permanent one is intact.
    assert committed_steps(checkpoints) == permanent + [newest + 2]
    with Checkpointer(checkpoints, cfg.checkpoint) as reader:
        assert [reader.restore_configs(s)[1]["step"] for s in permanent] == permanent
    params_at(cfg.output_dir, permanent[-1])


@pytest.mark.slow
def test_two_processes_take_temporary_checkpoints_together(data_dir, tmp_path):  # noqa: F811
    """launch/local.sh 2, a temporary checkpoint due every 0.3 s: process 0's clock decides for
    both (a process saving alone would wait forever in the collective write), and the run ends
    with its permanent checkpoints only."""
    cfg = config(data_dir, tmp_path / "two", "train.steps=40", "checkpoint.every=20",
                 "checkpoint.every_minutes=0.005", "mesh.data=2", "train.log_every=10",
                 "train.eval_every=0", "train.routing_every=0", "train.plots=false")
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "CPU_DEVICES": "2", "PYTHON": sys.executable}
    done = subprocess.run([str(REPO / "launch/local.sh"), "2", "--config",
                           cfg.output_dir + ".yaml"], env=env, capture_output=True, text=True,
                          timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert re.search(r"^\[p0\] .* step \d+: temporary checkpoint", output, re.M), output[-3000:]
    assert committed_steps(Path(cfg.output_dir) / "checkpoints") == [20, 40]


@pytest.mark.slow
def test_a_second_start_loads_the_train_step_from_the_compilation_cache(data_dir,  # noqa: F811
                                                                       tmp_path):
    """Two processes, with the trainer's own cache settings (not the test run's shared cache)
    and train.compilation_cache_dir in tmp_path: the first compiles and fills the directory,
    the second loads its train step from it. HOME is moved so that a write to the default
    location would show."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    env = {**{k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES},
           "HOME": str(home)}
    cfg = config(data_dir, tmp_path / "run", "train.steps=2", "train.eval_every=0",
                 "train.routing_every=0", "train.plots=false", "train.tensorboard=false",
                 f"train.compilation_cache_dir={cache}")
    compiled = re.compile(r"train step compiled in [\d.]+ s(.*)")
    first = compiled.search(finish(train(cfg, env=env)))[1]
    assert first == "" and any(cache.iterdir())
    entries = set(cache.iterdir())
    second = compiled.search(finish(train(cfg, "checkpoint.resume=false",
                                          f"output_dir={tmp_path / 'again'}", env=env)))[1]
    assert second == " (loaded from the persistent compilation cache)"
    assert entries <= set(cache.iterdir()) and not (home / ".cache" / "delta_jax").exists()


def test_jax_environment_variables_win_over_the_cache_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/set/by/the/user")
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    before = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
        enable_compilation_cache(str(tmp_path / "cache"))
        assert jax.config.jax_compilation_cache_dir == before["jax_compilation_cache_dir"]
        # Not set in the environment: every program is stored.
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.mark.slow
def test_the_profile_window_writes_a_trace_tensorboard_opens(data_dir, tmp_path):  # noqa: F811
    cfg = config(data_dir, tmp_path / "run", "train.steps=3", "train.profile_steps=2,3",
                 "train.eval_every=0", "train.routing_every=0", "train.plots=false")
    run(cfg)
    traces = list((Path(cfg.output_dir) / "tensorboard" / "plugins" / "profile").glob(
        "*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


@pytest.mark.parametrize("steps", ["3", "0,2", "4,2", "1,2,3"])
def test_a_profile_window_must_be_first_and_last_step(data_dir, tmp_path, steps):  # noqa: F811
    with pytest.raises(ValueError, match=r"train.profile_steps=.* expected FIRST,LAST"):
        config(data_dir, tmp_path / "run", f"train.profile_steps={steps}")
