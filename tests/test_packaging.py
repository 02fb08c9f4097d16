"""pyproject.toml's test and tpu-plan extras list requirements-test.txt's pins, and the package's
dependencies are requirements.txt's; an installed libtpu stays quiet on a host without a TPU."""
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import delta_jax

REPO = Path(__file__).resolve().parents[1]


def _pins(name):
    lines = (REPO / name).read_text().splitlines()
    return [line for line in map(str.strip, lines) if line and not line.startswith(("#", "-r"))]


def test_pyproject_pins_are_the_requirements_files():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert extras["test"] + extras["tpu-plan"] == _pins("requirements-test.txt")
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"] == {
        "file": ["requirements.txt"]}
    assert _pins("requirements.txt")  # read by setuptools: comments and requirements only


@pytest.mark.skipif(not delta_jax._no_tpu_here(),
                    reason="libtpu is not installed (nothing would print its start-up errors), "
                    "or this host may have a TPU (where libtpu is meant to start)")
def test_a_cpu_command_prints_nothing_of_libtpu_on_a_host_without_a_tpu():
    """libtpu, installed for the tests and the planner, prints initialisation errors when jax
    probes for a TPU that is not there; importing delta_jax keeps jax off that probe."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import delta_jax, jax; print(jax.devices()[0].platform)"
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True)
    assert quiet.stdout.strip() == "cpu"
    assert quiet.stderr == ""
    # the same process without delta_jax's guard: what a user saw before it
    noisy = subprocess.run([sys.executable, "-c", code.replace("delta_jax, ", "")], env=env,
                           capture_output=True, text=True, check=True)
    assert "TPU_WORKER_HOSTNAMES" in noisy.stderr or "host bounds" in noisy.stderr
