"""Batch builders: advantages land exactly on the action tokens of the right turns; SFT and DPO layouts; padding."""

import dataclasses

import numpy as np
import pytest

from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.loop.learner import RLConfig, as_ppo, silent_groups
from dreamjax.rl.batch import dpo_batch, rl_batch, sft_batch, split_micro_batches, turn_returns
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.text import Kind

# Four episodes in two groups (tasks). Each turn row: (episode, turn, prompt length, action length, reward, invalid).
TURNS = [
    (0, 0, 4, 2, 0.0, False), (0, 1, 3, 3, 1.0, False),  # group 0: success in 2 turns
    (1, 0, 5, 1, 0.0, True),  # group 0: one invalid turn, then the env ended it
    (2, 0, 2, 2, 0.0, False), (2, 1, 4, 1, 0.0, False), (2, 2, 3, 2, 0.0, False),  # group 1: ran out of turns
    (3, 0, 3, 3, 1.0, False),  # group 1: success
]
GROUP = [0, 0, 1, 1]
ENDED = [True, True, False, True]
T = 7


def make_traj(rows=TURNS) -> Trajectories:
  m = len(rows)
  rng = np.random.RandomState(0)
  tokens, kinds = np.zeros((m, T), np.int32), np.zeros((m, T), np.int32)
  logp = np.zeros((m, T), np.float32)
  for i, (_, _, p, a, _, _) in enumerate(rows):
    tokens[i, :p + a] = rng.randint(1, 50, p + a)
    kinds[i, :p] = Kind.OBSERVATION
    kinds[i, p:p + a] = Kind.ACTION
    logp[i, p:p + a] = -rng.rand(a)
  n = max(r[0] for r in rows) + 1
  num_turns = np.bincount([r[0] for r in rows], minlength=n).astype(np.int32)
  turn_rows = np.full((n, num_turns.max()), -1, np.int32)
  for i, (e, k, *_) in enumerate(rows):
    turn_rows[e, k] = i
  reward = np.array([r[4] for r in rows], np.float32)
  episode = np.array([r[0] for r in rows], np.int32)
  ep_reward = np.zeros(n, np.float32)
  np.add.at(ep_reward, episode, reward)
  return Trajectories(
      tokens=tokens, kinds=kinds, loss_mask=(kinds == Kind.ACTION).astype(np.int32), rollout_logp=logp,
      lengths=np.array([r[2] + r[3] for r in rows], np.int32), prompt_lengths=np.array([r[2] for r in rows], np.int32),
      episode=episode, turn=np.array([r[1] for r in rows], np.int32), reward=reward,
      done=np.array([k == num_turns[e] - 1 and ENDED[e] for e, k, *_ in rows]),
      invalid=np.array([r[5] for r in rows]), truncated=np.zeros(m, bool), group=np.array(GROUP, np.int32),
      task_index=np.array(GROUP, np.int32), num_turns=num_turns, turn_rows=turn_rows, episode_reward=ep_reward,
      success=ep_reward > 0, ended=np.array(ENDED), env_error=np.zeros(n, bool), records=(),
  )


def action_cols(i):
  _, _, p, a, _, _ = TURNS[i]
  return np.arange(p, p + a)


def check_on_actions(arr, per_row):
  """arr[i] equals per_row[i] on row i's action tokens and 0 everywhere else (padding included)."""
  expected = np.zeros_like(arr)
  for i, v in enumerate(per_row):
    expected[i, action_cols(i)] = v
  np.testing.assert_allclose(arr, expected, rtol=1e-6, atol=1e-7)


def test_grpo_advantages_on_action_tokens_with_invalid_penalty():
  traj = make_traj()
  b = rl_batch(traj, advantage="grpo", invalid_penalty=0.1, pad_to=64, row_multiple=4)
  assert b.tokens.shape == (8, 64) and b.loss_mask.shape == (8, 64) and b.pair.shape == (8,)
  # Episode returns: 1.0, -0.1 (group 0); 0.0, 1.0 (group 1). Unbiased std of two values a, b is |a - b| / sqrt 2.
  a0 = (1.0 - 0.45) / (1.1 / np.sqrt(2) + 1e-6)
  a1 = 0.5 / (1.0 / np.sqrt(2) + 1e-6)
  per_episode = [a0, -a0, -a1, a1]
  check_on_actions(np.asarray(b.advantages)[:7, :T], [per_episode[r[0]] for r in TURNS])
  assert not np.asarray(b.advantages)[:, T:].any() and not np.asarray(b.advantages)[7:].any()
  check_on_actions(np.asarray(b.loss_mask)[:7, :T], [1.0] * 7)
  np.testing.assert_array_equal(np.asarray(b.old_logp)[:7, :T], traj.rollout_logp)
  # Positions count valid tokens; padding rows are empty.
  np.testing.assert_array_equal(np.asarray(b.positions)[1, :6], np.arange(6))
  assert not np.asarray(b.valid)[7:].any() and np.asarray(b.valid).sum() == traj.lengths.sum()
  # Dr. GRPO (no std division) shows the penalty: group 0 centres (1, -0.1) to +-0.55, (1, 0) to +-0.5.
  for penalty, centred in ((0.1, 0.55), (0.0, 0.5)):
    b0 = rl_batch(traj, advantage="grpo", invalid_penalty=penalty, normalize_std=False, pad_to=8)
    assert b0.tokens.shape == (7, 8)
    check_on_actions(np.asarray(b0.advantages)[:, :T], [(centred, -centred, -0.5, 0.5)[r[0]] for r in TURNS])


def test_turn_credit_puts_the_invalid_penalty_on_the_invalid_turn_alone():
  """Groups compare env rewards only: group 0 (1, 0) centres to +-0.5 like group 1, and the invalid turn (row 2,
  episode 1's only turn) gets the penalty on top of its episode's advantage; every other row is as without it."""
  traj = make_traj()
  b = rl_batch(traj, advantage="grpo", invalid_penalty=0.3, normalize_std=False, invalid_credit="turn", pad_to=8)
  per_episode = [0.5, -0.5, -0.5, 0.5]
  check_on_actions(np.asarray(b.advantages)[:, :T],
                   [per_episode[r[0]] - (0.3 if r[5] else 0.0) for r in TURNS])
  plain = rl_batch(traj, advantage="grpo", invalid_penalty=0.0, normalize_std=False, pad_to=8)
  valid_rows = [i for i, r in enumerate(TURNS) if not r[5]]
  np.testing.assert_array_equal(np.asarray(b.advantages)[valid_rows], np.asarray(plain.advantages)[valid_rows])
  with pytest.raises(ValueError, match="invalid_credit 'turn'.*grpo advantage only"):
    rl_batch(traj, advantage="gae_turn", values=np.zeros((len(TURNS), T), np.float32), invalid_credit="turn")
  with pytest.raises(ValueError, match="invalid_credit 'step' must be one of"):
    rl_batch(traj, invalid_credit="step")


def test_silent_groups_are_those_whose_update_is_zero_on_every_row():
  """No success anywhere: group 0 has episode 1's invalid turn, group 1 none. Episode credit tells group 0 apart by
  its returns (0 against -0.1); turn credit by the invalid turn's own penalty; group 1 is silent either way, and with
  no penalty both are."""
  traj = dataclasses.replace(make_traj(), reward=np.zeros(len(TURNS), np.float32))
  for credit in ("episode", "turn"):
    np.testing.assert_array_equal(silent_groups(traj, 0.1, credit), [False, True])
    np.testing.assert_array_equal(silent_groups(traj, 0.0, credit), [True, True])
    b = rl_batch(traj, advantage="grpo", invalid_penalty=0.1, normalize_std=False, invalid_credit=credit, pad_to=8)
    rows_of_group = np.array([GROUP[r[0]] for r in TURNS])
    assert np.asarray(b.advantages)[rows_of_group == 0].any() and not np.asarray(b.advantages)[rows_of_group == 1].any()
  with pytest.raises(ValueError, match="RLConfig.invalid_credit must be one of"):
    as_ppo(RLConfig(), invalid_credit="turn")


@pytest.mark.parametrize("advantage", ["grpo", "gae_turn", "gae_token"])
def test_env_failed_episodes_are_left_out(advantage):
  """Episode 1 ended because its env failed: no loss on its tokens, and group 0 has one member left, so episode 0
  (alone in its group) gets zero GRPO advantage instead of being compared with a failure it did not cause."""
  traj = make_traj()
  failed = dataclasses.replace(traj, env_error=np.array([False, True, False, False]))
  values = np.random.RandomState(2).randn(len(TURNS), T).astype(np.float32)
  b = rl_batch(failed, advantage=advantage, values=values, pad_to=8)
  ref = rl_batch(traj, advantage=advantage, values=values, pad_to=8)
  check_on_actions(np.asarray(b.loss_mask)[:, :T], [float(r[0] != 1) for r in TURNS])
  assert not np.asarray(b.advantages)[2].any()  # row 2 is episode 1's turn
  if advantage == "grpo":
    check_on_actions(np.asarray(b.advantages)[:, :T], [(0.0, 0.0, -a, a)[r[0]] for r in TURNS
                                                       for a in [0.5 / (1.0 / np.sqrt(2) + 1e-6)]])
  else:  # GAE is per episode: the other episodes keep exactly their advantages and returns
    keep = [i for i, r in enumerate(TURNS) if r[0] != 1]
    np.testing.assert_array_equal(np.asarray(b.advantages)[keep], np.asarray(ref.advantages)[keep])
    np.testing.assert_array_equal(np.asarray(b.returns)[keep], np.asarray(ref.returns)[keep])


def test_gae_over_turns_uses_turn_state_values():
  traj = make_traj()
  rng = np.random.RandomState(1)
  values = rng.randn(len(TURNS), T).astype(np.float32)
  gamma, lam = 0.9, 0.8
  b = rl_batch(traj, advantage="gae_turn", values=values, gamma=gamma, lam=lam, pad_to=16)
  # Reference: a direct backward recursion per episode over its turns.
  adv_rows, ret_rows = {}, {}
  for e in range(4):
    rows = [i for i, r in enumerate(TURNS) if r[0] == e]
    v = [values[i, TURNS[i][2]] for i in rows]  # value at the first action token (state of the turn)
    nxt = 0.0 if ENDED[e] else v[-1]
    running = 0.0
    for k in reversed(range(len(rows))):
      delta = TURNS[rows[k]][4] + gamma * nxt - v[k]
      running = delta + gamma * lam * running
      adv_rows[rows[k]], ret_rows[rows[k]] = running, running + v[k]
      nxt = v[k]
  check_on_actions(np.asarray(b.advantages)[:7, :T], [adv_rows[i] for i in range(7)])
  check_on_actions(np.asarray(b.returns)[:7, :T], [ret_rows[i] for i in range(7)])
  np.testing.assert_array_equal(np.asarray(b.old_values)[:7, :T], values)


def test_gae_over_tokens_runs_across_turns():
  traj = make_traj()
  values = np.random.RandomState(2).randn(len(TURNS), T).astype(np.float32)
  gamma, lam = 0.95, 0.9
  b = rl_batch(traj, advantage="gae_token", values=values, gamma=gamma, lam=lam, invalid_penalty=0.5, pad_to=16)
  expected_adv = np.zeros((7, T), np.float32)
  for e in range(4):
    steps = []  # (row, col, reward) over the episode's action tokens in order
    for i in [i for i, r in enumerate(TURNS) if r[0] == e]:
      cols = action_cols(i)
      reward = TURNS[i][4] - 0.5 * TURNS[i][5]
      steps += [(i, c, reward if c == cols[-1] else 0.0) for c in cols]
    nxt = 0.0 if ENDED[e] else values[steps[-1][0], steps[-1][1]]
    running = 0.0
    for i, c, r in reversed(steps):
      running = r + gamma * nxt - values[i, c] + gamma * lam * running
      expected_adv[i, c] = running
      nxt = values[i, c]
  np.testing.assert_allclose(np.asarray(b.advantages)[:7, :T], expected_adv, rtol=1e-5, atol=1e-6)
  mask = traj.loss_mask > 0
  np.testing.assert_allclose(np.asarray(b.returns)[:7, :T], np.where(mask, expected_adv + values, 0), rtol=1e-5,
                             atol=1e-6)


def test_whitening_is_over_loss_tokens():
  traj = make_traj()
  values = np.random.RandomState(3).randn(len(TURNS), T).astype(np.float32)
  b = rl_batch(traj, advantage="gae_turn", values=values, whiten_advantages=True, pad_to=8)
  adv = np.asarray(b.advantages)[np.asarray(b.loss_mask) > 0]
  assert abs(adv.mean()) < 1e-5 and abs(adv.std(ddof=1) - 1) < 1e-4
  assert not np.asarray(b.advantages)[np.asarray(b.loss_mask) == 0].any()


# Each turn's state (text, admissible actions) for GiGPO's step groups, by episode: episodes 0 and 1 (group 0) start
# in state A; episode 2 (group 1) visits D twice; episode 3 starts in C's text with other admissible actions.
STATES = [[("A", ("x", "y")), ("B", ("x",))], [("A", ("x", "y"))], [("C", ("u",)), ("D", ("u",)), ("D", ("u",))],
          [("C", ("v",))]]


def with_states(traj: Trajectories, states=STATES) -> Trajectories:
  task = Task.make("textworld_express", "t")
  records = tuple(
      TrajectoryRecord(f"e{e}", "textworld_express", task, "", "policy", e,
                       tuple(StepRecord(text, "x", "", 0.0, False, False, False, adm, "policy") for text, adm in turns),
                       False, len(turns), None)
      for e, turns in enumerate(states))
  return dataclasses.replace(traj, records=records)


def test_turn_returns_are_discounted_within_each_episode():
  traj = make_traj()
  turn = traj.reward - 0.1 * traj.invalid
  np.testing.assert_allclose(turn_returns(traj, turn, 0.5), [0.5, 1.0, -0.1, 0.0, 0.0, 0.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(turn_returns(traj, turn, 1.0), [1.0, 1.0, -0.1, 0.0, 0.0, 0.0, 1.0], rtol=1e-6)


def test_gigpo_adds_the_step_advantage_of_turns_from_the_same_state():
  """Dr. GRPO episode advantages (+-0.55 in group 0, +-0.5 in group 1) plus 2 x the step advantages. Returns-to-go at
  gamma 0.5: rows 0..6 = 0.5, 1, -0.1, 0, 0, 0, 1. State A holds rows 0 and 2 (0.5 and -0.1: +-0.3); B and C are
  reached once; D twice with equal returns; episode 3's C has other admissible actions, so it is another state."""
  traj = with_states(make_traj())
  b = rl_batch(traj, advantage="gigpo", invalid_penalty=0.1, gamma=0.5, step_weight=2.0, normalize_std=False, pad_to=8)
  check_on_actions(np.asarray(b.advantages)[:, :T], [0.55 + 0.6, 0.55, -0.55 - 0.6, -0.5, -0.5, -0.5, 0.5])
  # With episode 3's C the same state as episode 2's, C compares 0 against 1.
  same_c = [*STATES[:3], [("C", ("u",))]]
  b = rl_batch(with_states(make_traj(), same_c), advantage="gigpo", invalid_penalty=0.1, gamma=0.5, step_weight=2.0,
               normalize_std=False, pad_to=8)
  check_on_actions(np.asarray(b.advantages)[:, :T], [1.15, 0.55, -1.15, -1.5, -0.5, -0.5, 1.5])
  # Weight 0 is GRPO.
  plain = rl_batch(traj, advantage="grpo", invalid_penalty=0.1, normalize_std=False, pad_to=8)
  zero = rl_batch(traj, advantage="gigpo", invalid_penalty=0.1, gamma=0.5, step_weight=0.0, normalize_std=False,
                  pad_to=8)
  np.testing.assert_array_equal(np.asarray(zero.advantages), np.asarray(plain.advantages))
  # An episode the env failed on counts in no step group: A is left with row 0 alone.
  failed = dataclasses.replace(traj, env_error=np.array([False, True, False, False]))
  b = rl_batch(failed, advantage="gigpo", invalid_penalty=0.1, gamma=0.5, step_weight=2.0, normalize_std=False,
               pad_to=8)
  check_on_actions(np.asarray(b.advantages)[:, :T], [0.0, 0.0, 0.0, -0.5, -0.5, -0.5, 0.5])


def test_gigpo_silent_groups_and_config():
  """Both episodes of group 1 succeed, on turns 3 and 1: equal returns, so GRPO says nothing there; GiGPO with
  gamma < 1 credits the sooner success from the shared start state C, and with gamma 1 it is silent too."""
  reward = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)
  traj = with_states(dataclasses.replace(make_traj(), reward=reward), [*STATES[:3], [("C", ("u",))]])
  np.testing.assert_array_equal(silent_groups(traj, 0.1, "episode"), [False, True])
  np.testing.assert_array_equal(silent_groups(traj, 0.1, "episode", "gigpo", 0.5), [False, False])
  np.testing.assert_array_equal(silent_groups(traj, 0.1, "episode", "gigpo", 1.0), [False, True])
  b = rl_batch(traj, advantage="gigpo", invalid_penalty=0.1, gamma=0.5, normalize_std=False, pad_to=8)
  # Returns-to-go in group 1: rows 3..6 = 0.25, 0.5, 1, 1; C holds rows 3 and 6, D rows 4 and 5 (one episode's
  # two visits are compared like any two).
  check_on_actions(np.asarray(b.advantages)[:, :T], [0.55 + 0.3, 0.55, -0.55 - 0.3, -0.375, -0.25, 0.25, 0.375])
  with pytest.raises(ValueError, match="episode records for 4 episodes"):
    rl_batch(make_traj(), advantage="gigpo")
  assert RLConfig(advantage="gigpo").advantage == "gigpo"
  with pytest.raises(ValueError, match="invalid_credit must be one of"):
    RLConfig(advantage="gigpo", invalid_credit="turn")
  with pytest.raises(ValueError, match="gamma must lie in"):
    RLConfig(advantage="gigpo", gamma=0.0)

def test_rl_batch_errors_name_the_problem():
  traj = make_traj()
  with pytest.raises(ValueError, match="unknown advantage 'gae'"):
    rl_batch(traj, advantage="gae")
  with pytest.raises(ValueError, match="needs critic `values`"):
    rl_batch(traj, advantage="gae_turn")
  with pytest.raises(ValueError, match=r"ref_logp has shape \(7, 3\)"):
    rl_batch(traj, ref_logp=np.zeros((7, 3)))


def test_sft_batch_masks_and_padding():
  b = sft_batch([[5, 6, 7], [8, 9, 10, 11, 12]], [[1, 1, 1], [0, 0, 1, 1, 0]], pad_to=4, row_multiple=4)
  assert b.tokens.shape == (4, 8)
  np.testing.assert_array_equal(np.asarray(b.loss_mask)[:2, :5], [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]])  # t=0 never
  np.testing.assert_array_equal(np.asarray(b.tokens)[1, :5], [8, 9, 10, 11, 12])
  assert not np.asarray(b.valid)[2:].any()
  with pytest.raises(ValueError, match="sft_batch row 1: token ids"):
    sft_batch([[1, 2], [3, 4]], [[0, 1], [0, 1, 1]])
  with pytest.raises(ValueError, match="sft_batch row 0: loss mask must hold only 0 and 1"):
    sft_batch([[1, 2]], [[0, 2]])


def test_dpo_batch_keeps_pairs_inside_micro_batches():
  rng = np.random.RandomState(4)

  def rows(n):
    return [(rng.randint(1, 50, 5), [0, 0, 1, 1, 1]) for _ in range(n)]

  pairs = [(rows(2), rows(1)), (rows(1), rows(1)), (rows(3), rows(2)), (rows(1), rows(2))]
  b = dpo_batch(pairs, micro_batches=2, pad_to=8, row_multiple=4)
  assert b.tokens.shape[0] % 4 == 0
  micro = split_micro_batches(b, 2)
  seen = []
  for j in range(2):
    present = np.asarray(micro.valid[j]).any(-1)
    ids = np.asarray(micro.pair[j])[present]
    chosen = np.asarray(micro.chosen[j])[present]
    for p in np.unique(ids):
      seen.append((int((chosen & (ids == p)).sum()), int((~chosen & (ids == p)).sum())))
      assert set(np.unique(ids)) == set(range(len(np.unique(ids))))  # local ids 0..n-1
  assert sorted(seen) == sorted([(2, 1), (1, 1), (3, 2), (1, 2)])
  assert np.asarray(b.valid).any(-1).sum() == 13
  with pytest.raises(ValueError, match="dpo_batch pair 0: needs at least one chosen and one rejected row"):
    dpo_batch([(rows(1), [])])


def test_episode_weights_make_every_episode_weigh_the_same():
  """Episodes of 2, 1, 3 and 1 turn rows: each row's loss weight is (7 rows / 4 episodes) / its episode's rows, the
  advantages are the unweighted ones, and an episode left out (env failure) counts in neither."""
  traj = make_traj()
  plain = rl_batch(traj, advantage="grpo", invalid_penalty=0.1, pad_to=8)
  b = rl_batch(traj, advantage="grpo", invalid_penalty=0.1, episode_weights=True, pad_to=8)
  rows = [2, 1, 3, 1]
  check_on_actions(np.asarray(b.loss_mask)[:, :T], [7 / 4 / rows[r[0]] for r in TURNS])
  np.testing.assert_array_equal(np.asarray(b.advantages), np.asarray(plain.advantages))
  failed = dataclasses.replace(traj, env_error=np.array([False, False, True, False]))
  b = rl_batch(failed, advantage="grpo", episode_weights=True, pad_to=8)
  check_on_actions(np.asarray(b.loss_mask)[:, :T], [0.0 if r[0] == 2 else 4 / 3 / rows[r[0]] for r in TURNS])
