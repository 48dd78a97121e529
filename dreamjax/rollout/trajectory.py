"""What the rollout engine hands to the update: token-in/token-out turn rows plus per-episode outcomes.

The agent sees one prompt per turn (task, step count, recent history, current state, admissible actions; docs/paper_map.md,
"Agent prompt"), so a turn is the unit of the token arrays: row m holds turn `turn[m]` of episode `episode[m]`, its
prompt ids exactly as the sampler consumed them followed by the sampled action ids exactly as produced. Nothing is
re-tokenised between rollout and update, so `rollout_logp` lines up with what the update recomputes.

Alignment: `rollout_logp[m, t]` is the log-prob of `tokens[m, t]` (a sampled token) under the rollout policy given
`tokens[m, :t]`; the update computes the same quantity from logits at t - 1. `loss_mask` is 1 on the sampled tokens
(Kind.ACTION), including the stop token, and 0 on prompts and padding; with `RolloutConfig.constrain_actions` it is also
0 on sampled tokens that the row's admissible actions forced (no other token could follow there: the policy chose
nothing, so nothing there is credited; docs/paper_map.md, "Admissible-action decoding"). With that option
`rollout_logp` is the log-prob renormalised over the tokens the admissible actions allowed at that step, the
distribution the token was drawn from, and `allowed[m, t]` lists those tokens (-1 padded; all -1 where nothing
limited the draw), so the update and the reference score the same distribution (`dreamjax.rl.logprobs`).

Episode e has turns `turn_rows[e, :num_turns[e]]` (row indices into the turn arrays, -1 after the last). Episodes with
the same task in one batch share `group[e]` (the GRPO group). `env_error[e]` marks an episode the env ended by failing
(dreamjax.envs.base: its process or browser died, it hung or raised) on its last turn: it says nothing about
the policy, and the update, evaluation and write-back leave it out. `budget_cut[e]` marks an episode an exact
env-step budget stopped (its last answer never reached the env); `left_out` is either, what the update skips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from dreamjax.data.records import TrajectoryRecord


@dataclasses.dataclass(frozen=True)
class Trajectories:
  # Turn rows, M of them, right-padded to a common length T with pad ids (Kind.PAD in `kinds`).
  tokens: np.ndarray  # int32 [M, T]
  kinds: np.ndarray  # int32 [M, T]: dreamjax.text.Kind codes
  loss_mask: np.ndarray  # int32 [M, T]: 1 on sampled action tokens (not forced ones)
  rollout_logp: np.ndarray  # float32 [M, T]: sampler log-probs on sampled tokens, 0 elsewhere (see `allowed`)
  lengths: np.ndarray  # int32 [M]: prompt + action tokens
  prompt_lengths: np.ndarray  # int32 [M]
  episode: np.ndarray  # int32 [M]: episode index
  turn: np.ndarray  # int32 [M]: turn index within its episode
  reward: np.ndarray  # float32 [M]: reward returned by the env for this turn's action
  done: np.ndarray  # bool [M]: the env ended the episode on this turn
  invalid: np.ndarray  # bool [M]: the answer did not parse or the env rejected the action
  truncated: np.ndarray  # bool [M]: the action hit the per-turn token budget without a stop sequence
  # Episodes, N of them.
  group: np.ndarray  # int32 [N]: same task in the same batch -> same group
  task_index: np.ndarray  # int32 [N]: index into the task list given to the engine
  num_turns: np.ndarray  # int32 [N]
  turn_rows: np.ndarray  # int32 [N, max_turns]: row of each turn, -1 past the end
  episode_reward: np.ndarray  # float32 [N]: sum of turn rewards (outcome reward: 1.0 on success)
  success: np.ndarray  # bool [N]
  ended: np.ndarray  # bool [N]: the env ended the episode (False: turn or token budget ran out)
  env_error: np.ndarray  # bool [N]: the env failed on the episode's last turn (see the module docstring)
  records: tuple[TrajectoryRecord, ...]  # the same episodes as text (for the replay buffer and logs)
  # How the rollout went (RolloutEngine.run: seconds sampling and in the env, turns, sampled tokens, parse failures,
  # invalid actions, env errors, prompt buckets, compilations); empty for batches built by hand.
  stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # bool [N]: the run's env-step budget stopped the episode (RolloutEngine.run's max_env_steps); None: none did.
  budget_cut: np.ndarray | None = None
  # int32 [M, T, A]: the tokens each sampled token was drawn among (constrain_actions), -1 padded; None: unrestricted.
  allowed: np.ndarray | None = None

  def __post_init__(self):
    if self.budget_cut is None:
      object.__setattr__(self, "budget_cut", np.zeros_like(np.asarray(self.env_error, bool)))

  @property
  def left_out(self) -> np.ndarray:
    """bool [N]: episodes the update leaves out, as they say nothing about the policy: the env failed, or the
    budget cut them before their last answer was executed."""
    return np.asarray(self.env_error, bool) | np.asarray(self.budget_cut, bool)

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def num_episodes(self) -> int:
    return int(self.group.shape[0])
