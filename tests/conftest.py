"""Test setup: 8 fake CPU devices and a persistent compilation cache for the run (both set
before jax is imported), and shared fixtures.

The cache: many tests compile the same computation again (every training run jits its own
step; the training subprocesses compile what the test process already did). One directory per
`pytest` run, made by the main process and inherited by the xdist workers and every subprocess,
lets them reuse each other's executables; it is removed when the run ends. An executable from
the cache is the one XLA would have compiled, so results are bitwise the same. Set
JAX_COMPILATION_CACHE_DIR yourself to keep a cache across runs;
JAX_ENABLE_COMPILATION_CACHE=false turns it off.
"""
import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # in the main process; workers inherit it
    _cache = tempfile.mkdtemp(prefix="delta_jax_tests_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# A size limit turns on the cache's file lock: workers and subprocesses write it concurrently.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2**34))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under `-n N --dist loadgroup` (make test), the tests of a module that share a module- or
    class-scoped fixture (a prepared data set, a training run) go to one worker, which computes
    the fixture once; every other test goes to whichever worker is free."""
    for item in items:
        shared = any(d.scope in ("class", "module", "package", "session")
                     for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
                     if d.baseid)  # fixtures defined by pytest itself (baseid "") do not count
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
