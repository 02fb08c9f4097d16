"""load_pretrained / save_pretrained against transformers' Qwen3ForCausalLM (the oracle, CPU)."""
import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from delta_jax import ModelConfig, init_model, load_pretrained, save_pretrained
from delta_jax.hf import save as save_module
from delta_jax.hf.safetensors_io import read_header
from delta_jax.sharding import make_mesh, state_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.random.RandomState(0).randint(0, 128, (2, 9))
# head_dim 16 differs from hidden/heads = 8; rope_theta as released Qwen3 checkpoints.
GEOMETRY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=64, rope_theta=1e6)


def hf_logits(folder) -> np.ndarray:
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


def logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(IDS)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two transformers checkpoints: tied/float32/one file and untied/bfloat16/sharded."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    tied = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **GEOMETRY, tie_word_embeddings=True))
    tied.save_pretrained(root / "tied")
    untied = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **GEOMETRY, tie_word_embeddings=False))
    untied.to(torch.bfloat16).save_pretrained(root / "untied", max_shard_size="20KB")
    return {"tied": root / "tied", "untied": root / "untied"}


@pytest.fixture(scope="module")
def loaded(folders):
    return {name: load_pretrained(path) for name, path in folders.items()}


def test_checkpoints_cover_the_cases(folders):
    assert (folders["tied"] / "model.safetensors").is_file()
    shards = sorted(folders["untied"].glob("model-*.safetensors"))
    assert len(shards) > 1 and (folders["untied"] / "model.safetensors.index.json").is_file()
    assert {info.dtype.name for shard in shards for info in read_header(shard).values()} == \
        {"bfloat16"}


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_logits_match_transformers(folders, loaded, name):
    model = loaded[name]
    assert model.config.tie_word_embeddings == (name == "tied")
    assert (model.config.head_dim, model.config.rope_theta) == (16, 1e6)
    np.testing.assert_allclose(logits(model), hf_logits(folders[name]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_round_trip_through_transformers(loaded, tmp_path, name):
    model = loaded[name]
    out = save_pretrained(model, tmp_path / "out", max_shard_size="30KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    np.testing.assert_allclose(hf_logits(out), logits(model), atol=1e-4, rtol=0)


def test_bfloat16_save_is_exact_for_bfloat16_weights(folders, loaded, tmp_path):
    out = save_pretrained(loaded["untied"], tmp_path / "bf16", dtype="bfloat16")
    assert {i.dtype.name for i in read_header(out / "model.safetensors").values()} == {"bfloat16"}
    np.testing.assert_array_equal(logits(load_pretrained(out)), logits(loaded["untied"]))


def test_rope_theta_at_top_level(folders, loaded, tmp_path):
    folder = shutil.copytree(folders["tied"], tmp_path / "old_style")
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_pretrained(folder)
    assert model.config.rope_theta == 1e6
    np.testing.assert_array_equal(logits(model), logits(loaded["tied"]))


def test_dtype_sets_storage_and_compute(folders):
    model = load_pretrained(folders["tied"], dtype=jnp.bfloat16)
    assert (model.config.param_dtype, model.config.dtype) == ("bfloat16", "bfloat16")
    assert model.layers.mlp.up_proj[...].dtype == jnp.bfloat16
    mixed = load_pretrained(folders["tied"], dtype="bfloat16", param_dtype="float32")
    assert (mixed.config.param_dtype, mixed.config.dtype) == ("float32", "bfloat16")


def test_mesh_places_each_parameter_on_its_sharding(folders, loaded):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    params = nnx.state(load_pretrained(folders["untied"], mesh=mesh), nnx.Param)
    reference = dict(nnx.state(loaded["untied"], nnx.Param).flat_state())
    expected = dict(state_shardings(params, mesh).flat_state())
    for path, variable in params.flat_state():
        assert variable[...].sharding == expected[path], path
        np.testing.assert_array_equal(variable[...], reference[path][...], err_msg=str(path))
    assert params["layers"]["mlp"]["up_proj"][...].sharding.spec == P(None, "fsdp", "tensor")


def test_interrupted_save_keeps_the_previous_folder(loaded, tmp_path, monkeypatch):
    target = save_pretrained(loaded["tied"], tmp_path / "model")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module, "write_file", fail)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(loaded["untied"], target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging folder left


def test_save_refuses_to_replace_a_folder_that_is_not_a_model(loaded, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="notes: exists and is not a model folder"):
        save_pretrained(loaded["tied"], tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_saved_token_ids_exist_in_the_vocabulary(tmp_path):
    """Qwen3's bos/eos ids (151643/151645) stay where the vocabulary holds them; a small
    vocabulary gets its tokenizer's EOS where it holds that, else null."""
    def ids(folder):
        config = json.loads((folder / "config.json").read_text())
        return config["bos_token_id"], config["eos_token_id"]

    small = ModelConfig(vocab_size=384, hidden_size=16, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8, intermediate_size=32, residual="baseline")
    model = init_model(small)
    assert ids(save_pretrained(model, tmp_path / "none")) == (None, None)
    with_byte = save_pretrained(model, tmp_path / "byte", tokenizer="byte")
    assert ids(with_byte) == (256, 256)
    copied = save_pretrained(model, tmp_path / "copied", tokenizer=with_byte / "tokenizer.json")
    assert (copied / "tokenizer.json").read_bytes() == (with_byte / "tokenizer.json").read_bytes()
    assert (copied / "tokenizer_config.json").is_file() and ids(copied) == (256, 256)
    tiny = init_model(dataclasses.replace(small, vocab_size=200))  # EOS 256 is not in it
    assert ids(save_pretrained(tiny, tmp_path / "tiny", tokenizer="byte")) == (None, None)
    qwen_sized = init_model(dataclasses.replace(small, vocab_size=151936))
    assert ids(save_pretrained(qwen_sized, tmp_path / "qwen", tokenizer="byte")) == (151643, 151645)
