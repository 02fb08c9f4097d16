"""pyproject.toml's test extra lists requirements-test.txt's pins, and the package's
dependencies are requirements.txt's."""
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pins(name):
    lines = (REPO / name).read_text().splitlines()
    return [line for line in map(str.strip, lines) if line and not line.startswith(("#", "-r"))]


def test_pyproject_pins_are_the_requirements_files():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["test"] == _pins("requirements-test.txt")
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"] == {
        "file": ["requirements.txt"]}
    assert _pins("requirements.txt")  # read by setuptools: comments and requirements only
