"""Bad input: one clear ConversionError from the API, one line and exit code 2 from the CLI."""
import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from delta_jax import ModelConfig, init_model, load_pretrained, save_pretrained
from delta_jax.convert.__main__ import main
from delta_jax.hf.keymap import ConversionError
from delta_jax.hf.safetensors_io import read_header, read_tensor

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid plain Qwen3 folder (tiny, untied) and its tensors."""
    model = init_model(ModelConfig.tiny(residual="baseline", tie_word_embeddings=False))
    folder = save_pretrained(model, tmp_path_factory.mktemp("good") / "model")
    header = read_header(folder / WEIGHTS)
    return folder, {name: read_tensor(folder / WEIGHTS, info) for name, info in header.items()}


def variant(good, tmp_path, *, tensors=None, config=None):
    """A copy of the good folder with other tensors and/or config fields."""
    folder = shutil.copytree(good[0], tmp_path / "bad")
    if tensors is not None:
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    if config is not None:
        hf = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf, **config}))
    return folder


def test_good_folder_loads(good):
    assert load_pretrained(good[0]).config.num_layers == 4


def test_missing_tensor(good, tmp_path):
    tensors = dict(good[1])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError,
                       match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"):
        load_pretrained(variant(good, tmp_path, tensors=tensors))


def test_unexpected_tensor(good, tmp_path):
    tensors = {**good[1], "model.layers.0.extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(ConversionError,
                       match=r"unexpected tensor\(s\) model.layers.0.extra.weight"):
        load_pretrained(variant(good, tmp_path, tensors=tensors))


def test_wrong_shape_says_expected_and_found(good, tmp_path):
    tensors = {**good[1], "model.layers.2.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}
    with pytest.raises(ConversionError, match=r"tensor model.layers.2.self_attn.k_proj.weight "
                                              r"has shape \[8, 32\], expected \[16, 32\]"):
        load_pretrained(variant(good, tmp_path, tensors=tensors))


def test_unsupported_dtype(good, tmp_path):
    tensors = {**good[1], "model.norm.weight": good[1]["model.norm.weight"].astype(np.float64)}
    with pytest.raises(ConversionError, match="tensor model.norm.weight has dtype F64, which is "
                                              "not supported: expected one of F32, BF16, F16"):
        load_pretrained(variant(good, tmp_path, tensors=tensors))


def test_truncated_file(good, tmp_path):
    folder = variant(good, tmp_path)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:-100])
    with pytest.raises(ConversionError, match=r"model.safetensors: not a valid safetensors file: "
                                              r"tensor .* ends at byte \d+ but the file has "
                                              r"\d+ bytes \(truncated\?\)"):
        load_pretrained(folder)


@pytest.mark.parametrize("content,why", [
    (b"\x00" * 4, "4 bytes, shorter than the 8-byte header length"),
    ((10**9).to_bytes(8, "little") + b"{}", "header length 1000000000 exceeds the file size"),
    ((6).to_bytes(8, "little") + b"{oops}", "header is not valid JSON"),
])
def test_corrupt_file(good, tmp_path, content, why):
    folder = variant(good, tmp_path)
    (folder / WEIGHTS).write_bytes(content)
    with pytest.raises(ConversionError, match=f"not a valid safetensors file: {why}"):
        load_pretrained(folder)


def test_index_naming_a_missing_shard(good, tmp_path):
    folder = save_pretrained(load_pretrained(good[0]), tmp_path / "sharded",
                             max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(ConversionError, match=f"names shard {shards[1].name}, which is missing"):
        load_pretrained(folder)


def test_unknown_model_type(good, tmp_path):
    with pytest.raises(ConversionError, match="model_type='llama' is not supported: expected "
                                              "'qwen3' or 'qwen3_attnres'"):
        load_pretrained(variant(good, tmp_path, config={"model_type": "llama"}))


@pytest.mark.parametrize("config,message", [
    ({"hidden_size": 64}, r"tensor model.embed_tokens.weight has shape \[128, 32\], "
                          r"expected \[128, 64\]"),
    ({"num_hidden_layers": 3}, r"unexpected tensor\(s\) model.layers.3.input_layernorm.weight"),
    ({"model_type": "qwen3_attnres", "attnres_mode": "delta"},
     r"missing tensor\(s\) model.layers.0.attn_res_norm.weight"),
])
def test_config_contradicting_the_tensors(good, tmp_path, config, message):
    with pytest.raises(ConversionError, match=message):
        load_pretrained(variant(good, tmp_path, config=config))


def test_tied_config_with_a_different_lm_head(good, tmp_path):
    embed = good[1]["model.embed_tokens.weight"]
    tensors = {**good[1], "lm_head.weight": embed + 1}
    folder = variant(good, tmp_path, tensors=tensors, config={"tie_word_embeddings": True})
    with pytest.raises(ConversionError, match="tie_word_embeddings=True but lm_head.weight "
                                              "differs from model.embed_tokens.weight"):
        load_pretrained(folder)


def test_pickle_checkpoint_is_refused_with_a_way_out(good, tmp_path):
    folder = variant(good, tmp_path)
    (folder / WEIGHTS).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConversionError, match=r"only PyTorch pickle weights \(pytorch_model.bin"
                                              r"\).*convert them to safetensors first"):
        load_pretrained(folder)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        load_pretrained(tmp_path)
    with pytest.raises(ConversionError, match="not a folder"):
        load_pretrained(tmp_path / "absent")


def test_bad_overrides(good):
    with pytest.raises(ConversionError, match="unknown override.* residul"):
        load_pretrained(good[0], residul="delta")
    with pytest.raises(ConversionError, match="dtype='int8' is not supported"):
        load_pretrained(good[0], dtype="int8")


@pytest.mark.parametrize("case,message", [
    ("missing", r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"),
    ("model_type", "model_type='llama' is not supported"),
])
def test_cli_reports_one_line_and_exit_code_2(good, tmp_path, capsys, case, message):
    if case == "missing":
        tensors = dict(good[1])
        del tensors["model.layers.1.mlp.up_proj.weight"]
        folder = variant(good, tmp_path, tensors=tensors)
    else:
        folder = variant(good, tmp_path, config={"model_type": "llama"})
    assert main(["hf-to-orbax", str(folder), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("delta_jax.convert: error: ")
    assert re.search(message, lines[0])
    assert not (tmp_path / "out").exists()
