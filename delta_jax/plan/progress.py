"""Progress of a planner run, on stderr (stdout is the report): one line as each compile starts
and one with its seconds as it ends, so that a run of several minutes a variant says where it
is. The commands turn the lines on with delta_jax.cli.setup_logging, as the trainer does.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("delta_jax.plan")


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    """Log `what` as it starts and, if it ends without raising, its wall time."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)
