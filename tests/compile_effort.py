"""How hard XLA optimises the programs tests compile.

tests/conftest.py turns most of XLA's backend optimisation off for the suite (`JAX_DISABLE_MOST_OPTIMIZATIONS`): most
tests compile many small programs and run each a few times, where LLVM's passes cost more than they save (a third of
tests/test_rl_update.py's time). A fixture that trains for hundreds of steps is the opposite case and runs its
training under `optimized()` (the trained M_exp of tests/test_exp_sft.py took 192 s without it and 124 s with it).
The setting is JAX's: it compiles with `xla_backend_optimization_level=0` and `xla_llvm_disable_expensive_passes`.
The whole suite passes either way (experiments/RESULTS.md, "The test suite with lighter compilation").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

FLAG = "jax_disable_most_optimizations"


@contextlib.contextmanager
def optimized() -> Iterator[None]:
  """XLA's full optimisation for the programs compiled inside; the suite's setting again after."""
  before = jax.config.values[FLAG]
  jax.config.update(FLAG, False)
  try:
    yield
  finally:
    jax.config.update(FLAG, before)
