"""Test settings: 8 fake CPU devices, strict JAX behaviour, one compilation
cache.

XLA_FLAGS must be set before jax is first imported, which is why this runs
at conftest import time. Many tests compile the same programs (an optimizer
step on the same shapes, built by different closures), in both pytest-xdist
workers and in the subprocesses of the multi-process tests; JAX's persistent
compilation cache, shared by all of them through the environment, compiles
each once per run (and keeps them for the next run on the same machine).
"""

import gc
import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(tempfile.gettempdir(), "gradtx-tests-jax-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "standard")

assert jax.device_count() == 8, "conftest must run before jax is imported"

if os.environ.get("GRADTX_TEST_PROFILE"):  # tests/profile_tests.py
  from profile_tests import (  # noqa: E402, F401
    pytest_configure,
    pytest_runtest_protocol,
    pytest_sessionfinish,
  )


def pytest_collection_finish(session):
  # Python's cyclic GC walks the young objects every 700 allocations and,
  # now and then, every object the process holds: JAX's caches of traced
  # and compiled programs grow all run long, and the default thresholds
  # spent 21.5 of a cold run's 647 CPU s collecting (tests/profile_tests.py,
  # "gc s"). The imports and the collected tests are frozen out of the
  # walks (they live to the end), and the young generation is walked every
  # 20,000 allocations. gc.collect() (jax.checking_leaks calls it) is
  # unchanged.
  del session
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)


def pytest_collection_modifyitems(items):
  # jax.checking_leaks runs gc.collect and gc.get_referrers at the end of
  # every trace: a walk of every object the process holds. Late in a run
  # (JAX's caches full) the same test costs several times what it costs
  # early (2.4 s alone, 5.3 s after two conformance tests, 15 s at the end
  # of a worker's share), so those tests run first.
  items.sort(key=lambda item: item.get_closest_marker("leak_check") is None)
