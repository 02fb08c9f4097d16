"""What the `python -m delta_jax.<command>` entry points share.

Every command is a package whose `__init__` is the library and whose `__main__` is the command
line (argparse, printing results, exit codes).
"""
from __future__ import annotations

import argparse

from delta_jax.config import DTYPES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --step and --dtype of the commands that read a model through load_model."""
    parser.add_argument("--model", required=True,
                        help="Orbax checkpoint dir, training run folder or Hugging Face folder")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the checkpoint's)")
