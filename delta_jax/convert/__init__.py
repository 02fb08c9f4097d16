"""Convert checkpoints: a Hugging Face folder <-> an Orbax checkpoint the trainer fine-tunes from.

hf_to_orbax writes step 0 in the layout of delta_jax.checkpoint and copies the folder's
tokenizer files into <orbax dir>/tokenizer; orbax_to_hf copies them back from there (or from
tokenizer_from), or writes the tokenizer a trainer run's data used. With a mesh, the model is
placed on its shardings as it is read, so no device holds more than its share; orbax_to_hf also
runs in every process of a multi-process run (process 0 writes). Bad input raises
ConversionError naming the path. The command line `python -m delta_jax.convert
{hf-to-orbax,orbax-to-hf}` is in __main__.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from delta_jax.checkpoint import TOKENIZER_DIR, load_checkpoint, save_checkpoint
from delta_jax.hf.keymap import ConversionError
from delta_jax.hf.load import TOKENIZER_FILES, load_pretrained
from delta_jax.hf.save import save_pretrained
from delta_jax.loading import run_data_tokenizer
from delta_jax.model import CausalLM


def hf_to_orbax(source: Path, target: Path, *, param_dtype: str = "float32",
                preserve_function: bool = False, progress: bool = False,
                mesh: Mesh | None = None, **overrides: Any) -> CausalLM:
    """Hugging Face folder `source` -> step 0 of a new Orbax checkpoint `target`, converted into
    a routing variant by `overrides` as load_pretrained. Returns the model written."""
    if target.exists() and any(target.iterdir()):
        raise ConversionError(f"{target}: exists and is not empty; choose a new directory")
    model = load_pretrained(source, param_dtype=param_dtype, progress=progress, mesh=mesh,
                            preserve_function=preserve_function, **overrides)
    save_checkpoint(model, target, step=0)
    tokenizer_files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if tokenizer_files:
        (target / TOKENIZER_DIR).mkdir()
        for path in tokenizer_files:
            shutil.copyfile(path, target / TOKENIZER_DIR / path.name)
    return model


def orbax_to_hf(source: Path, target: Path, *, step: int | None = None, dtype: str | None = None,
                max_shard_size: int | str = "5GB", tokenizer_from: Path | None = None,
                progress: bool = False, mesh: Mesh | None = None) -> CausalLM:
    """`step` (default: the latest) of the Orbax checkpoint `source` -> the Hugging Face folder
    `target` (replaced), stored in `dtype` (default: the param dtype). Returns the model."""
    if not source.is_dir():
        raise ConversionError(f"{source}: not an Orbax checkpoint directory")
    model = load_checkpoint(source, step, mesh=mesh)
    save_pretrained(model, target, dtype=dtype, tokenizer=tokenizer_from or _tokenizer_of(source),
                    max_shard_size=max_shard_size, progress=progress)
    return model


def _tokenizer_of(checkpoint: Path) -> str | Path | None:
    """The tokenizer a checkpoint came with: the files hf_to_orbax copied, else the one its
    training run's data was tokenised with (a trainer run's config.yaml beside it)."""
    if (checkpoint / TOKENIZER_DIR).is_dir():
        return checkpoint / TOKENIZER_DIR
    return run_data_tokenizer(checkpoint)
