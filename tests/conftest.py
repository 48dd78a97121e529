"""Test setup: an 8-device fake CPU mesh, offline HF, tiny HF checkpoints built with transformers (torch, CPU)."""

import os

# Must precede the first jax import. PJRT_NPROC avoids a rendezvous deadlock of fake devices on 2-core machines.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("PJRT_NPROC", "32")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("DREAMJAX_SKIP_PEERS", "1")  # benchmarks smoke-tested here never start the tunix peer
# Runs write no compilation cache into their folders (file-listing tests compare run folders); fixtures that share
# one across runs set JAX's own, which "off" leaves alone. tests/test_compilation_cache.py turns it on.
os.environ.setdefault("DREAMJAX_COMPILATION_CACHE", "off")
# Tiny programs compiled once and run a few times: LLVM's optimisation costs more than it saves (tests/jax_settings.py;
# children started with this environment inherit it).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402

from tests import hf_fixtures  # noqa: E402


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def hf_tiny(request, tmp_path_factory):
  """(family, folder) of a tiny random HF model saved with save_pretrained."""
  folder = tmp_path_factory.mktemp(f"hf_{request.param}")
  hf_fixtures.save_tiny_hf_model(request.param, folder)
  return request.param, folder


@pytest.fixture(scope="session")
def coin_expert_data(tmp_path_factory):
  """trajectories.jsonl of 6 expert episodes of TextWorld-Express coin games (tests/preemption_child.py's settings),
  for tests that run a tiny training command end to end."""
  pytest.importorskip("textworld_express")
  from dreamjax.data.collect import CollectConfig, collect
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv
  from tests import preemption_child as child

  out = tmp_path_factory.mktemp("coin_expert_data")
  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=4) for _ in range(child.EVAL.num_envs)])
  try:
    collect(CollectConfig(env_kwargs=("step_limit=4",), games=("coin",), game_params=child.COIN,
                          policies=("expert:6",), num_workers=0, rows_per_worker=child.EVAL.num_envs,
                          out_dir=str(out), build_tfds=False, progress=False), batch=env)
  finally:
    env.close()
  return out / "trajectories.jsonl"
