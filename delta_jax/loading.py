"""The one front door for reading a model: `load_model(path)` -> the model, and
`load_tokenizer(path)` -> its tokenizer or None.

Every model reader returns the model alone (a CausalLM), and the tokenizer is read on its own,
as Hugging Face's AutoModel and AutoTokenizer do. load_model dispatches on what the folder
holds to the reader of that format, which can also be called directly:
delta_jax.checkpoint.load_checkpoint (Orbax) and delta_jax.hf.load.load_pretrained (Hugging
Face safetensors). PATH may be
  - an Orbax model checkpoint directory (delta_jax.checkpoint layout: step directories holding
    `params` and `model_config`), or a trainer run folder keeping them under `PATH/checkpoints`;
  - a Hugging Face folder: config.json plus model.safetensors (or sharded model-*.safetensors).
load_tokenizer gives the one named by `tokenizer` ("byte", "qwen3" or a tokenizer.json path),
else a tokenizer.json found in PATH or in a checkpoint's tokenizer/ folder (hf_to_orbax keeps it
there), else the one a trainer run's data used (its config.yaml), else None (the tools then take
and print token ids).
"""
from __future__ import annotations

import argparse
import json
import urllib.parse
from pathlib import Path
from typing import Any

import yaml
from jax.sharding import Mesh

from delta_jax.checkpoint import TOKENIZER_DIR, load_checkpoint
from delta_jax.cli import mesh_from_args
from delta_jax.data.corpus import EMBEDDED
from delta_jax.data.prepare import METADATA
from delta_jax.data.tokenizers import Tokenizer, get_tokenizer
from delta_jax.hf.load import CONFIG as HF_CONFIG
from delta_jax.hf.load import load_pretrained
from delta_jax.model import CausalLM


def _is_checkpoint_dir(path: Path) -> bool:
    return any(p.is_dir() and p.name.isdigit() for p in path.iterdir())


def load_model(path: str | Path, *, step: int | None = None, mesh: Mesh | None = None,
               **overrides: Any) -> CausalLM:
    """The model of a checkpoint, run folder or Hugging Face folder (its tokenizer:
    load_tokenizer).

    `step` picks a checkpoint step (default: the latest). With a `mesh`, every parameter is
    read directly onto its sharding (the tools then run on that mesh). `overrides` are
    ModelConfig fields;
    a checkpoint takes only runtime ones (dtype, param_dtype, remat, layer_driver); for a
    Hugging Face folder they are load_pretrained's (dtype sets the parameters' dtype too).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model directory (expected an Orbax checkpoint "
                                f"directory, a training run folder or a Hugging Face folder "
                                f"with {HF_CONFIG})")
    if (path / HF_CONFIG).is_file():
        if step is not None:
            raise ValueError(f"{path}: a Hugging Face folder has no steps (got step={step})")
        return load_pretrained(path, mesh=mesh, **overrides)
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not _is_checkpoint_dir(directory):
        raise FileNotFoundError(f"{path}: neither a Hugging Face folder ({HF_CONFIG}) nor an "
                                f"Orbax checkpoint directory (numbered step folders)")
    return load_checkpoint(directory, step, mesh=mesh, **overrides)


def load_tokenizer(path: str | Path, tokenizer: str | None = None) -> Tokenizer | None:
    """The tokenizer for the model at `path`: `tokenizer` if given, else a tokenizer.json in
    `path` or its checkpoint's tokenizer/ folder, else the one its training run's data used,
    else None (see the module doc)."""
    path = Path(path)
    for folder in (path, path / TOKENIZER_DIR, path / "checkpoints" / TOKENIZER_DIR):
        if tokenizer is None and (folder / "tokenizer.json").is_file():
            tokenizer = str(folder)
    if tokenizer is None:
        tokenizer = run_data_tokenizer(path)
    return get_tokenizer(tokenizer) if tokenizer is not None else None


def run_data_tokenizer(path: str | Path) -> str | None:
    """The tokenizer spec the training run of `path` (a run folder or its checkpoint directory)
    tokenised its data with; None without a run or when it cannot be told."""
    run = run_config(path)
    if not run:
        return None
    data = run.get("data") or {}
    if data.get("mixture"):  # its sources share one tokenizer
        return data_tokenizer(data["mixture"][0]["path"])
    return data_tokenizer(data.get("path", EMBEDDED))


def run_config(path: str | Path) -> dict | None:
    """The training run's config.yaml (as a dict) of a run folder, or of a checkpoint directory
    inside one; None for anything else (a Hugging Face folder)."""
    for folder in (Path(path), Path(path).parent):
        if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            return yaml.safe_load((folder / "config.yaml").read_text()) or {}
    return None


def load_model_from_args(args: argparse.Namespace) -> CausalLM:
    """load_model for a command built with cli.add_model_arguments."""
    return load_model(args.model, step=args.step, mesh=mesh_from_args(args),
                      **({"dtype": args.dtype} if args.dtype else {}))


def tokenizer_from_args(args: argparse.Namespace) -> Tokenizer | None:
    """load_tokenizer for a command with --model and a --tokenizer option."""
    return load_tokenizer(args.model, args.tokenizer or None)


def data_tokenizer(data: str) -> str | None:
    """The tokenizer spec a data source was tokenised with: "embedded" (the trainer's default
    corpus, and its parts "embedded:code", ...) and tfds: specs without a tokenizer option use
    "byte"; a prepared directory names its own in metadata.json. None when it cannot be
    told."""
    if data == EMBEDDED or data.startswith(EMBEDDED + ":"):  # the corpus, or a part of it
        return "byte"
    if data.startswith("tfds:"):
        options = urllib.parse.parse_qs(urllib.parse.urlsplit(data[len("tfds:"):]).query)
        return options.get("tokenizer", ["byte"])[0]
    metadata = Path(data) / METADATA
    if metadata.is_file():
        return json.loads(metadata.read_text())["tokenizer"]["spec"]
    return None

