"""The GRPO-iteration benchmark: its FLOPs formula against a hand count, and a tiny end-to-end run (no tunix: the peer
column must then say so) that returns positive phase times and an MFU in (0, 100]."""

import json

import pytest

from dreamjax.models import load_hf_checkpoint, tiny
from experiments.bench import grpo_iteration as bench
from experiments.bench import peers


def test_update_flops_hand_count():
  cfg = tiny("qwen2", vocab_size=100, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=4)
  # Per layer: q 8x8 = 64, k and v 8x4 = 32 each, o 8x8 = 64, gate/up/down 3 x 8x12 = 288 -> 480; two layers 960;
  # LM head 8x100 = 800. Embedding lookup, biases and norm scales are not matmuls.
  assert bench.matmul_weights(cfg) == (960, 800)
  # Rows of 3 and 5 valid tokens, 4 of them loss tokens: 6 x (960 x 8 tokens + 800 x 4), plus attention
  # 12 x layers x (heads x head_dim) x (3^2 + 5^2).
  assert bench.update_flops(cfg, [3, 5], 4) == 6 * (960 * 8 + 800 * 4) + 12 * 2 * 8 * (9 + 25)
  # Tied embeddings still project through the embedding matrix: the head counts either way.
  assert bench.matmul_weights(cfg.replace(tie_word_embeddings=True)) == (960, 800)


def test_single_turn_rows_follow_the_rollout_contract():
  import numpy as np

  prompts = np.full((4, 3), 7, np.int32)
  tokens = np.array([[2, 4, 5], [1, 3, 5], [2, 2, 2], [9, 9, 9]], np.int32)
  logps = -np.ones((4, 3), np.float32)
  traj = bench.single_turn(prompts, tokens, logps, np.array([3, 3, 2, 1]))
  np.testing.assert_allclose(traj.reward, [2 / 3, 0.0, 1.0, 0.0], rtol=1e-7)  # even ids among the sampled ones
  np.testing.assert_array_equal(traj.lengths, [6, 6, 5, 4])
  np.testing.assert_array_equal(traj.loss_mask.sum(-1), [3, 3, 2, 1])
  np.testing.assert_array_equal(traj.group, [0, 0, 0, 0])
  assert traj.rollout_logp[2, 3:5].tolist() == [-1.0, -1.0] and traj.rollout_logp[2, 5] == 0.0


def test_peer_status_says_why_tunix_is_not_run(tmp_path, monkeypatch, capsys):
  monkeypatch.delenv(peers.SKIP_ENV, raising=False)
  assert peers.status(venv=tmp_path / "no-venv") == "not installed"
  assert "tunix_venv.sh" in capsys.readouterr().err  # the message names the script that makes the venv
  assert peers.status(skip=True) == "skipped"
  monkeypatch.setenv(peers.SKIP_ENV, "1")
  assert peers.status() == "skipped"


def test_bench_grpo_small(tmp_path, monkeypatch):
  monkeypatch.setenv("DREAMJAX_SKIP_PEERS", "1")
  out = tmp_path / "out"
  # --threads 0: the test must not pin the pytest process's CPU affinity; --warmup 0: one iteration, compile included.
  result = bench.main(["--small", "--runs", "1", "--warmup", "0", "--threads", "0", "--no-dreamgym",
                       "--model-dir", str(tmp_path / "model"), "--out", str(out)])
  (row,) = result["rows"]
  for phase in bench.PHASES:
    assert row["median"][phase] > 0, phase
  assert 0 < row["mfu_pct"] <= 100
  assert result["matmul_ceiling_flop_s"] > 0
  # 16 rows of 16 prompt ids + 16 forced new tokens (the loss tokens), all valid: the update's FLOPs count those.
  cfg, _ = load_hf_checkpoint(tmp_path / "model")
  assert row["update_tokens"] == 16 * 32
  assert row["update_flops"] == pytest.approx(bench.update_flops(cfg, [32] * 16, 16 * 16))
  saved = json.loads((out / "results.json").read_text())
  assert saved["tunix"] is None and saved["setup"]["tunix"] == "skipped"
  assert "| skipped |" in (out / "table.md").read_text()


@pytest.mark.slow
def test_bench_dreamgym_row_small(tmp_path, monkeypatch):
  """The DreamGym row: warm start, SyntheticEnv in the loop (minutes: the warm start trains 150 steps)."""
  pytest.importorskip("textworld_express")
  monkeypatch.setenv("DREAMJAX_SKIP_PEERS", "1")
  result = bench.main(["--small", "--runs", "1", "--warmup", "1", "--threads", "0", "--model-dir",
                       str(tmp_path / "model"), "--out", str(tmp_path / "out")])
  dream = result["rows"][1]
  assert dream["name"] == "DreamGym GRPO"
  for phase in bench.PHASES:
    assert dream["median"][phase] > 0, phase
  assert dream["parse"]["policy_parsed"] > 0.5 and dream["parse"]["exp_steps"] > 0  # M_exp was in the loop
  assert 0 < dream["mfu_pct"] <= 100
