"""What the `python -m delta_jax.<command>` entry points share: logging setup, model arguments.

Every command is a package whose `__init__` is the library and whose `__main__` is the command
line (argparse, printing results, exit codes). Library code logs through
`logging.getLogger(__name__)`; a command calls `setup_logging()` first, so that delta_jax's
messages (INFO and up) reach the terminal on stderr, while the results it was asked for (and
the trainer's progress lines) go to stdout.
"""
from __future__ import annotations

import argparse
import logging
import sys

from delta_jax.config import DTYPES


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (as logging.lastResort does), so a handler
    set up once follows a later redirection of stderr."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def setup_logging() -> None:
    """delta_jax's INFO messages and every library's warnings to stderr, one line each.

    force=True: importing orbax already configured the root logger (absl calls basicConfig on
    its first record); a command owns its process's logging and replaces that.
    """
    logging.basicConfig(level=logging.WARNING, handlers=[_StderrHandler()], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("delta_jax").setLevel(logging.INFO)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --step and --dtype of the commands that read a model through load_model."""
    parser.add_argument("--model", required=True,
                        help="Orbax checkpoint dir, training run folder or Hugging Face folder")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the checkpoint's)")
