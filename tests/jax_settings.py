"""JAX settings the tests change for a while: how hard XLA optimises, and persistent compilation caches.

tests/conftest.py turns most of XLA's backend optimisation off for the suite (`JAX_DISABLE_MOST_OPTIMIZATIONS`): most
tests compile many small programs and run each a few times, where LLVM's passes cost more than they save (a third of
tests/test_rl_update.py's time). A fixture that trains for hundreds of steps is the opposite case and runs its
training under `optimized()` (the trained M_exp of tests/test_exp_sft.py took 192 s without it and 124 s with it).
The setting is JAX's: it compiles with `xla_backend_optimization_level=0` and `xla_llvm_disable_expensive_passes`.
The whole suite passes either way (experiments/RESULTS.md, "The test suite with lighter compilation").

Modules whose runs compile the same programs again (a rerun from the same seed, a resumed learner, child processes)
share a persistent compilation cache (`persistent_cache`) so the later ones load executables instead of compiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax


@contextlib.contextmanager
def jax_config(**settings: Any) -> Iterator[None]:
  """JAX's config `settings` (jax.config names) for the code inside; the values before, again after."""
  before = {name: jax.config.values[name] for name in settings}
  try:
    for name, value in settings.items():
      jax.config.update(name, value)
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)


def optimized() -> contextlib.AbstractContextManager[None]:
  """XLA's full optimisation for the programs compiled inside; the suite's setting again after."""
  return jax_config(jax_disable_most_optimizations=False)


def persistent_cache(folder: str) -> dict[str, Any]:
  """The settings that cache every compiled program in `folder` (none is too fast or too small to keep)."""
  return {"jax_compilation_cache_dir": folder, "jax_persistent_cache_min_compile_time_secs": 0,
          "jax_persistent_cache_min_entry_size_bytes": 0}
