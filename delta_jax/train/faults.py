"""Fault tolerance: exit codes, stop signals, preflight checks (docs/recovery.md).

Exit codes of `python -m delta_jax.train`:
  0   trained to train.steps
  1   crashed: an exception (a traceback)
  2   refused: a bad config or a failed preflight check, one `error:` line naming the key, value
      or path at fault; nothing was written (no folder is created before every check passed)
  3   stopped after train.max_nonfinite_steps consecutive non-finite steps (the last checkpoint
      is the newest good state)
  75  stopped by SIGTERM or SIGINT after checkpointing the current step (EX_TEMPFAIL: run the
      same command again to resume)
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75


class PreflightError(ValueError):
    """The run cannot start: the message names the path, key or value at fault."""


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; the state of `step` is checkpointed."""

    def __init__(self, signum: int, step: int, where: str):
        self.signum, self.step = signum, step
        super().__init__(f"{signal.Signals(signum).name} received: checkpointed step {step} at "
                         f"{where}; run the same command to resume")


class NonFiniteStop(Exception):
    """train.max_nonfinite_steps consecutive steps were skipped as non-finite."""


class StopSignals:
    """Records SIGTERM/SIGINT instead of dying so the loop can checkpoint between steps.

    A second signal of either kind restores the default handlers' behaviour (a stuck save can
    still be interrupted). Use as a context manager around the loop (main thread only).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning("%s received: checkpointing after the current step",
                       signal.Signals(signum).name)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def state_bytes(tree: Any) -> int:
    """Bytes of all arrays (or ShapeDtypeStructs) in `tree`: one checkpoint's size, roughly."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def check_writable(directory: str | Path, needed_bytes: int) -> None:
    """Require that `directory` can be created (or written, if it exists) and has free space for
    `needed_bytes` plus 10% (Orbax metadata; a second checkpoint while the older is deleted is
    not counted). Creates nothing: a probe file is written in, and removed from, the nearest
    folder that exists, so that a run refused later leaves no empty folders behind."""
    if "://" in str(directory):  # a bucket: no local notion of free space
        return
    path = Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        probe = existing / f".write_probe_{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or errno.errorcode.get(e.errno, str(e))
        raise PreflightError(f"preflight: {directory} is not writable ({reason} at {existing}); "
                             "choose another output_dir or checkpoint.directory") from None
    free = shutil.disk_usage(existing).free
    if free < needed_bytes * 1.1:
        raise PreflightError(f"preflight: {directory} has {free / 2**20:,.1f} MiB free, a "
                             f"checkpoint needs about {needed_bytes * 1.1 / 2**20:,.1f} MiB")
