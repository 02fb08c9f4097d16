"""python -m delta_jax.convert: Hugging Face folder -> Orbax -> Hugging Face folder."""
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax import ModelConfig, init_model, load_pretrained, save_pretrained
from delta_jax.checkpoint import load_checkpoint
from delta_jax.convert.__main__ import main
from numerics import assert_float32_equal

ROOT = Path(__file__).parent.parent
IDS = jnp.asarray(np.random.RandomState(2).randint(0, 128, (2, 7)))
TOKENIZER = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A plain Qwen3 folder with tokenizer files, and its logits."""
    model = init_model(ModelConfig.tiny(residual="baseline"), seed=4)
    folder = save_pretrained(model, tmp_path_factory.mktemp("plain") / "qwen3")
    for name, text in TOKENIZER.items():
        (folder / name).write_text(text)
    return folder, np.asarray(model(IDS))


def test_help(capsys):
    done = subprocess.run([sys.executable, "-m", "delta_jax.convert", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "hf-to-orbax" in done.stdout and "orbax-to-hf" in done.stdout
    for command in ("hf-to-orbax", "orbax-to-hf"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert f"usage: python -m delta_jax.convert {command}" in capsys.readouterr().out


@pytest.mark.parametrize("residual,gate_base", [("delta_block", "live"), ("block", "stream")])
def test_round_trip_with_a_preserving_conversion(plain, tmp_path, capsys, residual, gate_base):
    folder, logits = plain
    orbax = tmp_path / "orbax"
    assert main(["hf-to-orbax", str(folder), str(orbax), "--residual", residual,
                 "--num-blocks", "2", "--preserve-function"]) == 0
    assert "loading qwen3" in capsys.readouterr().err  # the progress bar over tensors
    model = load_checkpoint(orbax)
    assert (model.config.residual, model.config.routing_gate, model.config.gate_base) == (
        residual, True, gate_base)
    assert_float32_equal(model(IDS), logits)  # the plain model's: a preserving conversion
    assert {p.name: p.read_text() for p in (orbax / "tokenizer").iterdir()} == TOKENIZER

    back = tmp_path / "hf"
    assert main(["orbax-to-hf", str(orbax), str(back), "--dtype", "float32"]) == 0
    assert "saving hf" in capsys.readouterr().err
    config = json.loads((back / "config.json").read_text())
    assert (config["model_type"], config["attnres_mode"]) == ("qwen3_attnres", residual)
    assert {name: (back / name).read_text() for name in TOKENIZER} == TOKENIZER
    assert_float32_equal(load_pretrained(back)(IDS), logits)


def test_hf_to_orbax_refuses_a_used_directory(plain, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    assert main(["hf-to-orbax", str(plain[0]), str(tmp_path / "used")]) == 2
    assert "used: exists and is not empty" in capsys.readouterr().err


def test_orbax_to_hf_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["orbax-to-hf", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("delta_jax.convert: error: ") and "no checkpoint step" in err[-1]
