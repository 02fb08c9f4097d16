"""The reference's qwen3_attnres folders, and converting a plain Qwen3 into every variant."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from delta_jax import ModelConfig, init_model, load_pretrained, save_pretrained
from delta_jax.hf.keymap import ConversionError, expected_hf_keys
from delta_jax.hf.safetensors_io import read_header, read_tensor
from numerics import assert_float32_equal

GOLDEN = Path(__file__).parent / "golden"
VARIANTS = ["baseline", "block", "full", "delta", "delta_block"]
IDS = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 9)))
# The fields of the reference's Qwen3AttnResConfig that a saved routing model must carry.
ATTNRES_FIELDS = ("attnres_mode", "attnres_num_blocks", "attnres_use_null_source",
                  "attnres_gate_type")


def golden_folder(mode: str, root: Path) -> tuple[Path, dict]:
    """A folder as the reference writes it: config.json + model.safetensors (safetensors lib)."""
    meta = json.loads((GOLDEN / f"golden_{mode}.json").read_text())
    data = np.load(GOLDEN / f"golden_{mode}.npz")
    config = dict(meta["config"])
    if mode == "baseline":
        config["model_type"] = "qwen3"
    else:
        config.update(model_type="qwen3_attnres", attnres_mode=mode,
                      attnres_num_blocks=meta["num_blocks"], attnres_gate_type="bias")
    folder = root / mode
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    state_dict = {k[len("sd/"):]: data[k] for k in data.files if k.startswith("sd/")}
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, {"state_dict": state_dict, "ids": data["input_ids"], "logits": data["logits"]}


@pytest.mark.parametrize("mode", VARIANTS)
def test_reference_folder_gives_golden_logits_and_saves_back_identically(mode, tmp_path):
    folder, golden = golden_folder(mode, tmp_path)
    model = load_pretrained(folder)
    assert model.config.residual == mode
    np.testing.assert_allclose(model(jnp.asarray(golden["ids"])), golden["logits"], atol=1e-4,
                               rtol=0)
    out = save_pretrained(model, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    if mode != "baseline":
        assert config["model_type"] == "qwen3_attnres"
        assert {k: config[k] for k in ATTNRES_FIELDS} == {
            "attnres_mode": mode, "attnres_num_blocks": 2, "attnres_use_null_source": False,
            "attnres_gate_type": "bias"}
    header = read_header(out / "model.safetensors")
    expected = {k: v for k, v in golden["state_dict"].items() if k != "lm_head.weight"}  # tied
    assert set(header) == set(expected)
    for name, info in header.items():
        np.testing.assert_array_equal(read_tensor(out / "model.safetensors", info),
                                      expected[name], err_msg=name)


@pytest.mark.parametrize("residual,extra", [
    ("delta_block", dict(null_source=True, routing_gate=True)), ("delta", {}), ("block", {}),
    ("full", dict(routing_gate=True)), ("block", dict(routing_gate=True, gate_base="stream"))])
def test_routing_model_saves_in_the_reference_layout(residual, extra, tmp_path, caplog):
    cfg = ModelConfig.tiny(residual=residual, tie_word_embeddings=False, **extra)
    model = init_model(cfg, seed=3)
    out = save_pretrained(model, tmp_path / "m")
    # delta_jax's own gate is said out loud: the reference code would drop it
    assert ("the reference code would run it without its gates" in caplog.text) == (
        cfg.gate_base == "stream")
    header = read_header(out / "model.safetensors")
    assert sorted(header) == sorted(expected_hf_keys(cfg))
    L, d = cfg.num_layers, cfg.hidden_size
    per_layer = {"attn_res_proj.weight": ((1, d), L), "mlp_res_norm.weight": ((d,), L),
                 "attn_null_source": ((d,), L if cfg.null_source else 0),
                 "mlp_res_alpha": ((), L if cfg.routing_gate else 0)}
    for suffix, (shape, count) in per_layer.items():
        names = [n for n in header if n.startswith("model.layers.") and n.endswith(suffix)]
        assert len(names) == count and all(header[n].shape == shape for n in names), suffix
    assert ("model.final_res_proj.weight" in header) == (residual in ("block", "full"))
    assert ("model.final_res_alpha" in header) == (cfg.gate_base == "stream")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_attnres"
    assert config["attnres_gate_type"] == {(False, "live"): "bias",
                                           (True, "live"): "learnable_alpha",
                                           (True, "stream"): "learnable_alpha_stream"}[
        (cfg.routing_gate, cfg.gate_base)]
    assert config["attnres_use_null_source"] == cfg.null_source
    reloaded = load_pretrained(out)
    assert reloaded.config.architecture() == cfg.architecture()
    theirs = dict(nnx.state(reloaded, nnx.Param).flat_state())
    for path, ours in nnx.state(model, nnx.Param).flat_state():
        np.testing.assert_array_equal(ours[...], theirs[path][...], err_msg=str(path))


# Converting a plain Qwen3 ------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain Qwen3 folders with the same weights: RMSNorm eps 1e-6, and a negligible 1e-12."""
    root = tmp_path_factory.mktemp("plain")
    return {eps: save_pretrained(init_model(ModelConfig.tiny(residual="baseline",
                                                             rms_norm_eps=eps), seed=5),
                                 root / f"eps{eps}")
            for eps in (1e-6, 1e-12)}


@pytest.fixture(scope="module")
def plain_logits(plain):
    return {eps: np.asarray(load_pretrained(folder)(IDS)) for eps, folder in plain.items()}


def routing_values(model, name: str) -> np.ndarray:
    return np.asarray(nnx.state(model, nnx.Param)["layers"]["attn_site"][name][...])


@pytest.mark.parametrize("residual,num_blocks,null_source,gate_base", [
    ("delta", 2, False, "live"), ("delta", 2, True, "live"), ("delta_block", 2, False, "live"),
    ("delta_block", 4, True, "live"), ("block", 2, False, "stream"),
    ("block", 4, False, "stream"), ("full", 2, False, "stream")])
def test_preserving_conversion_is_exact_for_every_variant(plain, plain_logits, residual,
                                                          num_blocks, null_source, gate_base):
    """The plain model's logits at the real eps 1e-6, through the default, scan and unrolled
    drivers (to float32 rounding: the routing model is another program)."""
    model = load_pretrained(plain[1e-6], residual=residual, null_source=null_source,
                            num_blocks=num_blocks, preserve_function=True)
    assert (model.config.router_init, model.config.routing_gate) == ("zeros", True)
    assert model.config.gate_base == gate_base
    assert not routing_values(model, "gate").any() and not routing_values(model, "query").any()
    if gate_base == "stream":
        assert float(model.final_site.gate[...]) == 0.0
    assert_float32_equal(model(IDS), plain_logits[1e-6])
    base = load_pretrained(plain[1e-6])
    for driver in ("scan", "unrolled"):
        assert_float32_equal(model(IDS, driver=driver), base(IDS, driver=driver), err_msg=driver)


@pytest.mark.parametrize("residual", ["block", "full"])
def test_zero_queries_alone_keep_replacement_variants_only_up_to_eps(plain, plain_logits,
                                                                     residual):
    # Why the stream gate: uniform weights feed the sublayer RMSNorm(h/N), which is RMSNorm(h)
    # but for the eps in the norm; invisible at eps 1e-12, a real change at the real 1e-6.
    for eps, low, high in ((1e-12, 0, 1e-5), (1e-6, 1e-4, np.inf)):
        model = load_pretrained(plain[eps], residual=residual, num_blocks=2,
                                router_init="zeros")
        assert low <= np.abs(np.asarray(model(IDS)) - plain_logits[eps]).max() < high, eps


def test_delta_block_with_zero_queries_alone_changes_the_function(plain, plain_logits):
    model = load_pretrained(plain[1e-6], residual="delta_block", num_blocks=2,
                            router_init="zeros")
    assert np.abs(np.asarray(model(IDS)) - plain_logits[1e-6]).max() > 1e-3


def test_plain_conversion_keeps_the_backbone_and_initialises_routing(plain):
    base = load_pretrained(plain[1e-6])
    model = load_pretrained(plain[1e-6], residual="block", num_blocks=4)
    assert (model.config.residual, model.config.num_blocks) == ("block", 4)
    queries = routing_values(model, "query")
    assert queries.shape == (4, 32) and 0.01 < queries.std() < 0.04  # router_init normal
    np.testing.assert_array_equal(routing_values(model, "norm"), 1.0)
    converted = dict(nnx.state(model, nnx.Param).flat_state())
    for path, variable in nnx.state(base, nnx.Param).flat_state():
        np.testing.assert_array_equal(converted[path][...], variable[...], err_msg=str(path))


@pytest.mark.parametrize("overrides,message", [
    (dict(residual="block", routing_gate=False),
     "preserve_function with residual='block' needs routing_gate=True"),
    (dict(residual="full", gate_base="live"),
     "preserve_function with residual='full' needs gate_base='stream'"),
    (dict(residual="delta_block", routing_gate=False),
     "preserve_function with residual='delta_block' needs routing_gate=True"),
    (dict(residual="delta", router_init="normal"),
     "preserve_function with residual='delta' needs router_init='zeros'"),
])
def test_preserving_conversion_refuses_contradicting_overrides(plain, overrides, message):
    with pytest.raises(ConversionError, match=message):
        load_pretrained(plain[1e-6], preserve_function=True, **overrides)


def test_trained_routing_cannot_be_overridden(tmp_path):
    folder, _ = golden_folder("delta_block", tmp_path)
    with pytest.raises(ConversionError, match="override residual='delta' contradicts the "
                                              "qwen3_attnres checkpoint"):
        load_pretrained(folder, residual="delta")
    with pytest.raises(ConversionError, match="preserve_function applies to converting a plain"):
        load_pretrained(folder, preserve_function=True)
