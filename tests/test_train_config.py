"""Run configuration: YAML -> frozen dataclasses, typed overrides, rejected unknown keys."""
import dataclasses
from pathlib import Path

import pytest

from delta_jax import count_params
from delta_jax.config import ModelConfig
from delta_jax.train.__main__ import main
from delta_jax.train.config import RunConfig, dump_config, load_config
from delta_jax.train.metrics import device_peak_flops

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# docs/spec.md section 5: parameter counts of the published shapes (the baseline variant).
PAPER_PARAMS = {"220m": 220.5e6, "533m": 533.1e6, "1044m": 1043.9e6, "qwen3_0_6b": 596e6,
                "8b": 7.57e9}


def test_every_shipped_config_loads():
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert {"demo", "finetune_qwen3_0_6b", *PAPER_PARAMS} <= names
    for name in names:
        cfg = load_config(CONFIGS / f"{name}.yaml")
        assert isinstance(cfg, RunConfig) and isinstance(cfg.model, ModelConfig)


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_paper_configs_follow_the_recipe(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    baseline = cfg.model.replace(residual="baseline")
    assert count_params(baseline) == pytest.approx(PAPER_PARAMS[name], rel=2e-3)
    o, t = cfg.optimizer, cfg.train
    assert (o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (t.steps, t.batch_size, t.seq_len) == (10_000, 64, 2048)
    big = name == "8b"
    assert (o.lr, o.min_lr, o.warmup_steps) == ((3e-4, 3e-5, 500) if big else (6e-4, 6e-5, 1000))
    assert cfg.model.vocab_size == 151936 and cfg.model.num_blocks == 4
    assert cfg.model.rope_theta == (1e6 if name == "qwen3_0_6b" else 1e4)
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("bfloat16", "float32")
    # The variant is an override.
    assert load_config(CONFIGS / f"{name}.yaml", ["model.residual=delta"]).model.residual == "delta"


def test_finetune_config_is_the_reference_recipe():
    cfg = load_config(CONFIGS / "finetune_qwen3_0_6b.yaml")
    o = cfg.optimizer
    assert (o.lr, o.routing_lr, o.min_lr, o.routing_min_lr, o.warmup_steps) == (
        5e-5, 5e-3, 3e-5, 3e-5, 500)
    assert cfg.train.steps == 20_000 and cfg.train.init_from
    assert cfg.model.architecture() | {"router_init": "normal"} == ModelConfig.qwen3_0_6b(
        residual="delta_block", routing_gate=True).architecture()


def test_the_routing_stage_is_the_fine_tune_training_the_routing_alone():
    """Stage 1 of docs/training.md#two-stage-fine-tuning: the same model, data and optimizer
    (but a shorter warmup) from the same converted checkpoint; stage 2 trains everything."""
    routing = load_config(CONFIGS / "finetune_qwen3_0_6b_routing.yaml")
    full = load_config(CONFIGS / "finetune_qwen3_0_6b.yaml")
    assert (routing.train.trainable, full.train.trainable) == (("routing",), ("all",))
    assert (routing.model, routing.data) == (full.model, full.data)
    assert dataclasses.replace(routing.optimizer, warmup_steps=500) == full.optimizer
    assert routing.train.init_from == full.train.init_from
    assert routing.output_dir != full.output_dir


def test_overrides_are_typed(tmp_path):
    cfg = load_config(CONFIGS / "demo.yaml", [
        "optimizer.lr=1e-4", "train.steps=7", "model.tie_word_embeddings=false",
        "train.init_from=null", "output_dir=" + str(tmp_path), "mesh.fsdp=2", "seed=3",
        "model.rope_theta=1e6"])
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 7 and cfg.model.tie_word_embeddings is False
    assert cfg.train.init_from is None and cfg.output_dir == str(tmp_path)
    assert (cfg.mesh.fsdp, cfg.seed, cfg.model.rope_theta) == (2, 3, 1e6)
    # Untouched fields keep the file's values, and frozen dataclasses stay frozen.
    assert cfg.model.residual == "delta_block"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 1


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown key(s) train.stepz; valid keys: train.steps, train.batch_size"),
    ("model.hiden_size=3", "valid keys: model.vocab_size, model.hidden_size"),
    ("trian.steps=3", "unknown key(s) trian; valid keys: output_dir, seed, model, data"),
    ("optimizer.lr=fast", "optimizer.lr='fast' is invalid: expected float"),
    ("train.steps=2.5", "train.steps='2.5' is invalid: expected int"),
    ("model.residual=mixture", "ModelConfig.residual='mixture' is invalid"),
    ("train.grad_accum=3", "train.grad_accum=3 is invalid: expected a divisor of"),
    ("optimizer.decay=some", "optimizer.decay='some' is invalid: expected all or matrices"),
    ("mesh.data=-1", None),
    ("mesh.dcn_fsdp=-1", "mesh=(-1, -1, 1) is invalid: expected across-slice (dcn_data, "
                         "dcn_fsdp, dcn_tensor) sizes >= 1 with at most one -1"),
    ("steps", "expected section.key=value"),
])
def test_bad_values_are_rejected_with_the_key(override, message):
    if message is None:
        load_config(CONFIGS / "demo.yaml", [override])
        return
    with pytest.raises(ValueError) as error:
        load_config(CONFIGS / "demo.yaml", [override])
    assert message in str(error.value)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: ten\n")
    with pytest.raises(ValueError, match=f"{bad}: train.steps='ten' is invalid"):
        load_config(bad)
    bad.write_text("train: 3\n")
    with pytest.raises(ValueError, match="train must be a mapping of TrainConfig fields"):
        load_config(bad)


def test_cli_prints_the_resolved_config_and_round_trips(tmp_path, capsys):
    main(["--config", str(CONFIGS / "demo.yaml"), "--print-config", "train.steps=11"])
    printed = capsys.readouterr().out
    (tmp_path / "resolved.yaml").write_text(printed)
    again = load_config(tmp_path / "resolved.yaml")
    assert again == load_config(CONFIGS / "demo.yaml", ["train.steps=11"])
    assert dump_config(again) == printed
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(CONFIGS / "demo.yaml"), "train.nope=1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "train.nope" in err


def test_a_run_config_naming_retired_and_renamed_fields_loads(tmp_path, caplog):
    """An earlier run's config.yaml names every model field, retired runtime ones and old names
    included: it still loads, as the same run; a retired field set to another way of running
    is reported."""
    old = tmp_path / "config.yaml"
    written = dump_config(load_config(CONFIGS / "220m.yaml"))
    assert "  layer_loops: 4\n" in written
    old.write_text(written.replace("  layer_loops: 4\n", "  buffer_segments: 4\n").replace(
        "model:\n", "model:\n  routing_kernel: xla\n  routing_logits: write\n"
        "  peel_block_starts: false\n  hoist_block_writes: true\n"))
    with caplog.at_level("WARNING", logger="delta_jax.config"):
        assert load_config(old) == load_config(CONFIGS / "220m.yaml")
    assert "model.routing_logits='write' is retired" in caplog.text
    for name in ("routing_kernel", "peel_block_starts", "hoist_block_writes"):
        assert name not in caplog.text
    with pytest.raises(ValueError, match="model.buffer_segments and model.layer_loops both set"):
        load_config(CONFIGS / "220m.yaml", ["model.buffer_segments=2"])


@pytest.mark.parametrize("device_kind, tflops", [
    ("TPU v5 lite", 197), ("TPU v5", 459), ("TPU v6 lite", 918), ("TPU v4", 275),
    ("NVIDIA H100 80GB HBM3", 989), ("cpu", None)])
def test_peak_flops_by_device_kind(device_kind, tflops):
    """MFU's denominator: v5p reports "TPU v5", v5e "TPU v5 lite"."""
    peak = device_peak_flops(device_kind)
    assert (peak is None) if tflops is None else peak == tflops * 1e12
