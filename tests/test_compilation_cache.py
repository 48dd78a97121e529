"""The persistent compilation cache every command turns on (`dreamjax.loop.config.start_run`): where it goes, and
that a restarted process loads what the first compiled instead of compiling it again. Processes of their own: JAX
reads its cache setting per process, and the other tests run with it off (tests/conftest.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dreamjax.loop.config import CACHE_ENV, RunConfig, compilation_cache_dir

ROOT = Path(__file__).resolve().parents[1]

# Starts a run the way the commands do, compiles a tiny transformer forward, and reports the cache's hits and misses
# (JAX's own monitoring events) and the logits. The compile-time floor is 0 so that the test does not depend on how
# long this machine takes to compile (JAX's default skips executables that compiled in under a second).
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from dreamjax.loop.config import RunConfig, start_run
from dreamjax.models import Transformer, init_params, tiny

events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
outs = []
for folder in sys.argv[1:]:
  start_run(RunConfig(out_dir=folder))
  cfg = tiny()
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.arange(8, dtype=jnp.int32)[None]
  forward = jax.jit(lambda p, t: Transformer(cfg).apply({"params": p}, t, t, jnp.ones_like(t, bool)).logits)
  outs.append(forward(params, tokens)[0, -1, :4].tolist())
  jax.clear_caches()  # the next folder's run compiles again, as a new process would
print(json.dumps(dict(dir=jax.config.jax_compilation_cache_dir, outs=outs,
                      hits=events.count("/jax/compilation_cache/cache_hits"),
                      misses=events.count("/jax/compilation_cache/cache_misses"))))
"""


def run(*folders) -> dict:
  env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, folders)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cache_folder_settings(monkeypatch):
  monkeypatch.delenv(CACHE_ENV, raising=False)
  assert compilation_cache_dir(RunConfig(out_dir="runs/x")) == str(Path("runs/x") / "compile_cache")
  assert compilation_cache_dir(RunConfig(out_dir="runs/x", compilation_cache="off")) is None
  assert compilation_cache_dir(RunConfig(out_dir="runs/x", compilation_cache="/shared/jax")) == "/shared/jax"
  monkeypatch.setenv(CACHE_ENV, "/elsewhere")
  assert compilation_cache_dir(RunConfig(out_dir="runs/x")) == "/elsewhere"
  monkeypatch.setenv(CACHE_ENV, "off")
  assert compilation_cache_dir(RunConfig(out_dir="runs/x")) is None
  assert compilation_cache_dir(RunConfig(out_dir="runs/x", compilation_cache="/shared/jax")) == "/shared/jax"


def test_a_restarted_run_loads_its_compiled_steps_from_the_run_folder(tmp_path):
  first = run(tmp_path / "run")
  cache = tmp_path / "run" / "compile_cache"
  assert first["dir"] == str(cache) and first["hits"] == 0 and first["misses"] >= 1
  entries = sorted(p.name for p in cache.iterdir())
  assert entries
  second = run(tmp_path / "run")  # the restart: a new process, the same run folder
  assert second["hits"] >= 1 and second["misses"] == 0
  assert second["outs"] == first["outs"]
  assert sorted(p.name for p in cache.iterdir()) == entries  # nothing compiled anew


def test_one_process_running_several_stages_moves_the_cache_with_each_run_folder(tmp_path):
  out = run(tmp_path / "a", tmp_path / "b")  # reproduce runs its stages in one process
  assert out["dir"] == str(tmp_path / "b" / "compile_cache")
  assert out["hits"] == 0 and out["misses"] >= 2  # b's cache started empty: nothing of a's was read from it
  assert list((tmp_path / "a" / "compile_cache").iterdir()) and list((tmp_path / "b" / "compile_cache").iterdir())
  assert out["outs"][0] == out["outs"][1]
