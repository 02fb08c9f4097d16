"""The Orbax model checkpoint (delta_jax/checkpoint.py): configs written by earlier versions."""
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from delta_jax import ModelConfig, init_model
from delta_jax.checkpoint import (
    MODEL_CONFIG,
    PARAMS,
    config_to_json,
    load_checkpoint,
    load_checkpoint_config,
    manager,
    save_checkpoint,
)

# What checkpoints saved before these runtime fields were retired hold besides today's fields.
RETIRED = {"routing_kernel": "pallas", "routing_logits": "write", "peel_block_starts": True,
           "hoist_block_writes": False}


def _save_with_config(model, directory, fields):
    """A model checkpoint as save_checkpoint writes it, but with `fields` as its model_config."""
    params = nnx.state(model, nnx.Param).to_pure_dict()
    with manager(directory, enable_async_checkpointing=False) as mgr:
        mgr.save(0, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardSave(params),
                                               MODEL_CONFIG: ocp.args.JsonSave(fields)}))
        mgr.wait_until_finished()


def test_a_checkpoint_naming_retired_and_renamed_fields_loads(tmp_path, caplog):
    """Runtime fields choose how the same function is computed, so a checkpoint saved with a
    retired one loads as the same model, the choice reported; an old name loads as the new."""
    model = init_model(ModelConfig.tiny(residual="delta_block", layer_loops=2), 3)
    fields = config_to_json(model.config)
    fields["buffer_segments"] = fields.pop("layer_loops")
    _save_with_config(model, tmp_path, {**fields, **RETIRED})
    with caplog.at_level(logging.WARNING, logger="delta_jax.config"):
        assert load_checkpoint_config(tmp_path) == model.config
        loaded = load_checkpoint(tmp_path)
    assert "model.routing_logits='write' is retired" in caplog.text
    assert str(tmp_path) in caplog.text
    ids = jax.random.randint(jax.random.key(0), (2, 8), 0, 128)
    np.testing.assert_array_equal(loaded(ids), model(ids))


def test_an_unknown_field_is_still_refused(tmp_path):
    model = init_model(ModelConfig.tiny(), 3)
    _save_with_config(model, tmp_path, {**config_to_json(model.config), "mystery": 1})
    with pytest.raises(ValueError, match=r"unknown model_config field\(s\) \['mystery'\]"):
        load_checkpoint(tmp_path)


@pytest.mark.slow
def test_a_checkpoint_carries_no_attention_kernel(tmp_path):
    """A kernel is the platform's: a model saved with cuDNN's attention (a GPU's) is written
    with attention auto, and one written before that, naming cudnn, still loads and runs on
    this CPU, as the same function."""
    cfg = ModelConfig.tiny(dtype="bfloat16", attention="cudnn")
    model = init_model(cfg, 3)
    save_checkpoint(model, tmp_path / "new")
    assert load_checkpoint_config(tmp_path / "new").attention == "auto"
    _save_with_config(model, tmp_path / "old", {**config_to_json(model.config),
                                                 "attention": "cudnn"})
    loaded = load_checkpoint(tmp_path / "old")
    assert loaded.config == cfg.replace(attention="auto")
    ids = jax.random.randint(jax.random.key(0), (2, 8), 0, 128)
    expected = init_model(cfg.replace(attention="xla"), 3)(ids)
    np.testing.assert_array_equal(loaded(ids), expected)
