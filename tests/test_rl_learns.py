"""The RL loop learns: `dreamjax rl`'s GRPO, from a policy cloned from random play, raises its held-out success.

The unit tests check one update's sign, the advantage math and the bookkeeping; none of them would notice a loop that
updates correctly on each batch and still never improves the policy (a mismatch between the rows it trains on and
the prompts it sampled from, advantages attached to the wrong turns, a reference that drifts). This runs the whole
pipeline of experiments/learning_twx.py against real TextWorld-Express games where the gradient has one obvious
direction: one room, the coin in sight, one turn, three admissible actions ("take coin", "look around",
"inventory"). Cloned from uniform random play the policy takes the coin about a third of the time when sampled;
GRPO must lift that well above. Slow (about 3 minutes on 2 cores): `pytest -m slow tests/test_rl_learns.py`.
"""

from __future__ import annotations

import json

import pytest

from experiments import learning_twx

pytestmark = pytest.mark.slow


def test_grpo_raises_the_success_of_a_policy_cloned_from_random_play(tmp_path):
  out = tmp_path / "learning"
  assert learning_twx.main([
      "--out", str(out), "--warm-start", "random", "--demos", "96", "--sft-steps", "100", "--iterations", "8",
      "--eval-every", "8", "--eval-tasks", "40", "--algorithms", "grpo",
      "--game-params", "numLocations=1, includeDoors=0, numDistractorItems=0",
      "--set", "env_kwargs=step_limit=1", "--set", "rollout.max_turns=1"]) == 0
  evals = [json.loads(line) for line in (out / "grpo" / "evals.jsonl").read_text().splitlines()]
  before, after = evals[0]["sampled"], evals[-1]["sampled"]
  assert before["success_rate"] <= 0.6, before  # the warm start is close to uniform over the three actions
  assert after["success_rate"] >= 0.85 and after["success_rate"] >= before["success_rate"] + 0.3, (before, after)
  assert evals[-1]["success_rate"] >= 0.9, evals[-1]  # greedy: the policy takes the coin
