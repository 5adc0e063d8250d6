"""Test settings: 8 fake CPU devices and strict JAX behaviour.

XLA_FLAGS must be set before jax is first imported, which is why this runs
at conftest import time.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "standard")

assert jax.device_count() == 8, "conftest must run before jax is imported"
