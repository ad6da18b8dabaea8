"""Test setup: 8 emulated CPU devices, set before JAX is imported anywhere."""

import atexit
import os
import shutil
import tempfile

# One XLA compilation cache for the session, made by the first process (pytest-xdist's workers inherit it) and
# shared with the runs the tests start as subprocesses (they compile the same tiny programs again and again). Empty
# at the start of every session: nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="areal_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# Likewise one warm-start cache (`warmstart.cache_dir`'s default): runs with the same model, data and warm-start
# settings train their warm-start once per session, not once per test. A test about the warm-start itself sets
# `warmstart.cache_dir=""`.
if "AREAL_JAX_WARMSTART_CACHE" not in os.environ:
  os.environ["AREAL_JAX_WARMSTART_CACHE"] = tempfile.mkdtemp(prefix="areal_jax_test_warmstart_")
  atexit.register(shutil.rmtree, os.environ["AREAL_JAX_WARMSTART_CACHE"], ignore_errors=True)

# LLVM's optimisation of the CPU code off (`--xla_backend_optimization_level=0`, no change to float semantics: fast
# math stays off): the tests' programs are tiny, so compiling is most of their cost (two compile-heavy test files took
# 151 s instead of 229 s). The runs the tests start as subprocesses inherit it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
assert jax.device_count() == 8, jax.devices()


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: whole runs, subprocess jobs and benchmarks (`-m 'not slow'` is the fast "
                          "tier)")


def pytest_collection_modifyitems(items):
  """Files marked slow as a whole (whole runs, subprocess jobs) first: xdist's `--dist loadfile` hands files to its
  workers in this order, and starting the longest first keeps both workers busy until the end."""
  def whole_file_slow(item) -> bool:
    marks = getattr(item.module, "pytestmark", [])
    return any(m.name == "slow" for m in (marks if isinstance(marks, list) else [marks]))

  items.sort(key=lambda item: not whole_file_slow(item))
