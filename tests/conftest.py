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

import pytest  # noqa: E402

from tests import hf_fixtures  # noqa: E402


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def hf_tiny(request, tmp_path_factory):
  """(family, folder) of a tiny random HF model saved with save_pretrained."""
  folder = tmp_path_factory.mktemp(f"hf_{request.param}")
  hf_fixtures.save_tiny_hf_model(request.param, folder)
  return request.param, folder
