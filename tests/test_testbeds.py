"""The testbeds: coin11 (configs/reproduce_coin11.py), its stages all on the 11-room door games, learning from
non-privileged data only, and the fidelity split it needs, transitions that reveal unseen rooms scored apart; twc
(configs/reproduce_twc.py), its stages on one-room commonsense games, held out on train-fold games no stage draws."""

import dataclasses

import pytest

from dreamjax.commands.reproduce import as_algorithm
from dreamjax.config import load_config
from dreamjax.data.records import Transition
from dreamjax.envs.alfworld import reveals as reveals_alfworld
from dreamjax.envs.base import Task
from dreamjax.envs.twx_explorer import reveals
from dreamjax.experience.fidelity import reveal_mask, score
from dreamjax.experience.format import ExpFormatConfig, ExpPrediction
from dreamjax.loop.learner import as_ppo

COIN11 = "numLocations=11, includeDoors=1, numDistractorItems=0"


@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_coin11_points_every_stage_at_the_door_games(variant):
  cfg = load_config(f"configs/reproduce_coin11.py{variant}")
  assert {cfg.collect.env, cfg.sft.env, cfg.dpo.env, cfg.real.env, cfg.dreamgym.rl.env, cfg.eval.env} == {
      "textworld_express"}
  limits = {cfg.collect.env_kwargs, cfg.sft.env_kwargs, cfg.dpo.env_kwargs, cfg.real.env_kwargs,
            cfg.dreamgym.rl.env_kwargs, cfg.eval.env_kwargs}
  assert limits == {("step_limit=14",)}
  assert {c.rollout.max_turns for c in (cfg.sft, cfg.dpo, cfg.real, cfg.dreamgym.rl, cfg.eval)} == {14}
  assert cfg.collect.game_params == cfg.real.train_tasks.game_params == cfg.eval.tasks.game_params == COIN11
  assert cfg.sft.eval.game_params == cfg.dpo.eval.game_params == cfg.dreamgym.rl.eval_tasks.game_params == COIN11
  # Training on the train fold, every evaluation on held-out dev games.
  assert cfg.collect.split == cfg.real.train_tasks.split == "train"
  assert cfg.eval.tasks.split == cfg.real.eval_tasks.split == cfg.sft.eval.split == "dev"
  # Non-privileged offline data: the gold-path expert is not among the collectors, the demonstrations are the
  # explorer's and DPO prefers them to random and noisy runs.
  policies = [p.split(":")[0] for p in cfg.collect.policies]
  assert "expert" not in policies and "explorer" in policies
  assert cfg.sft.rows.step_sources == ("explorer",) and set(cfg.sft.rows.experts) == {"explorer", "explorer-eps0.3"}
  assert cfg.collect.policies[0].startswith("explorer-eps0.3:")  # inside the SFT budget, which reads the file in order
  assert cfg.dpo.pairs.chosen_policies == ("explorer",)
  # M_exp reasons, and DreamGym uses it that way; the ablation of reasoning is a row.
  assert cfg.exp.format.reasoning and cfg.dreamgym.reasoning and "no_reasoning" in cfg.ablations
  # The paper's budget ratios: SFT 1 : DPO 2 : real-env RL 4 (offline to online), S2R 1/16 of real-env RL.
  b = cfg.budgets
  assert (b.dpo, b.real_rl, b.s2r * 16) == (2 * b.sft, 4 * b.sft, b.real_rl)
  assert cfg.real.agent == cfg.sft.agent == cfg.dpo.agent == cfg.dreamgym.rl.agent == cfg.eval.agent
  # The policy sees every earlier step's room (the whole 14-step episode fits), in every stage alike.
  assert cfg.real.agent.history_fields == ("Location",) and cfg.real.agent.history_turns == 14
  if not variant:
    assert cfg.seeds == (0, 1, 2) and cfg.algorithms == ("grpo", "ppo")
    assert len(cfg.ablations) == 4 and cfg.eval.tasks.count == 200


@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_twc_trains_and_scores_on_disjoint_games_of_one_fold(variant):
  cfg = load_config(f"configs/reproduce_twc.py{variant}")
  twc = "numLocations=1, numItemsToPutAway=2, includeDoors=0"
  stages = (cfg.sft, cfg.dpo, cfg.real, cfg.dreamgym.rl, cfg.eval)
  assert {cfg.collect.env_kwargs, *(c.env_kwargs for c in stages)} == {("step_limit=8",)}
  assert {c.rollout.max_turns for c in stages} == {8}
  assert cfg.collect.games == cfg.real.train_tasks.games == cfg.eval.tasks.games == ("twc",)
  assert cfg.collect.game_params == cfg.real.train_tasks.game_params == cfg.eval.tasks.game_params == twc
  # Every game is from the train fold (dev's item names appear in no train game); the collectors and RL draw tasks
  # below the held-out start, every evaluation from it on.
  held_out = cfg.eval.tasks
  assert held_out.split == cfg.real.eval_tasks.split == cfg.sft.eval.split == cfg.collect.split == "train"
  assert held_out.start == cfg.real.eval_tasks.start == cfg.dreamgym.rl.eval_tasks.start == cfg.sft.eval.task_start
  assert cfg.real.train_tasks.start + cfg.real.train_tasks.count <= held_out.start
  assert cfg.dreamgym.rl.train_tasks == cfg.real.train_tasks
  assert all(cfg.collect.task_start + int(p.split(":")[1]) <= held_out.start for p in cfg.collect.policies)
  # The gold path leads the file, so the SFT budget (whole episodes in file order) holds all of it, and SFT clones it.
  assert cfg.collect.policies[0].startswith("expert:") and cfg.sft.rows.step_sources == ("expert",)
  assert cfg.dpo.pairs.chosen_policies == ("expert",)
  # M_exp sees refused actions (the stale collector's); the policy stages never learn from them.
  stale = [p.split(":")[0] for p in cfg.collect.policies if p.startswith("stale")]
  assert stale and not set(stale) & set(cfg.dpo.pairs.rejected_policies + cfg.sft.rows.experts)
  assert cfg.exp.format.reasoning and cfg.dreamgym.reasoning and "no_reasoning" in cfg.ablations
  # M_exp answers greedy, a malformed answer resampled; its final held-out check scores that same decoding
  assert (cfg.dreamgym.exp_temperature, cfg.dreamgym.exp_retry_temperature) == (0.0, 1.0)
  assert cfg.exp.eval_retries == cfg.dreamgym.exp_retries == 8
  assert cfg.dreamgym.exp_speculative.draft_tokens == 0  # drafts cost more than they saved on twc's reasoning
  b = cfg.budgets
  assert (b.dpo, b.real_rl, b.s2r * 16) == (2 * b.sft, 4 * b.sft, b.real_rl)
  assert cfg.real.agent == cfg.sft.agent == cfg.dpo.agent == cfg.dreamgym.rl.agent == cfg.eval.agent
  # The PPO rows run verl-agent's PPO on the GRPO rows' policy optimizer: only the algorithm differs (the twx base's
  # tiny coin PPO, lr 1e-3 over two epochs, once stood in here unnoticed).
  ppo = as_algorithm(cfg.real, "ppo", cfg.ppo)
  assert ppo == as_ppo(cfg.real, critic=cfg.ppo.critic) and ppo.critic.optim.lr == 3e-3
  if not variant:
    expert_episodes = int(cfg.collect.policies[0].split(":")[1])
    assert b.sft >= expert_episodes * 6  # the gold path takes 5.7 steps on average
    assert cfg.seeds == (0, 1, 2) and cfg.eval.tasks.count == 200 and len(cfg.ablations) == 4
    # DreamGym trains as real-env RL does; only where its episodes come from differs, and how often its slower
    # iterations checkpoint.
    assert cfg.dreamgym.rl.checkpoint_every == 2 < cfg.real.checkpoint_every
    assert dataclasses.replace(cfg.dreamgym.rl, out_dir=cfg.real.out_dir, checkpoint_every=cfg.real.checkpoint_every) \
        == cfg.real
    # Real-env RL runs configs/grpo_real_twc.py's settings (the run that gained), from this config's SFT policy.
    grpo = load_config("configs/grpo_real_twc.py")
    assert dataclasses.replace(cfg.real, out_dir=grpo.out_dir, model=grpo.model, train_tasks=grpo.train_tasks) == grpo
    assert cfg.sft.max_steps == 400 and cfg.eval.sampled
    # M_exp is configs/train_exp_twc.py's, trained on this config's collection (the reproduce stage sets the paths).
    exp = load_config("configs/train_exp_twc.py")
    assert dataclasses.replace(cfg.exp, trajectories=exp.trajectories, out_dir=exp.out_dir, eval_every=exp.eval_every) \
        == exp
    assert exp.trajectories == ("runs/reproduce/twc/data/trajectories.jsonl",) and cfg.out_dir == "runs/reproduce/twc"
  # twc's next states are the current ones with a few fields changed, an item list by one item
  assert cfg.exp.format.state_changes and cfg.exp.format.list_edits
  # Every answer is one of the admissible actions, with room for the longest (19 tokens).
  assert all(c.rollout.constrain_actions and c.rollout.max_action_tokens == 24 for c in stages)


@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_dreamgym_twc_is_the_reproduce_stage_on_the_stages_folders(variant):
  rep = load_config(f"configs/reproduce_twc.py{variant}")
  own = load_config(f"configs/dreamgym_twc.py{variant}")
  run = rep.out_dir
  assert own.offline_data == (f"{run}/data/trajectories.jsonl",)
  assert own.rl.model.checkpoint == f"{run}/sft/checkpoint" and own.rl.out_dir == own.out_dir
  stage = rep.dreamgym
  # Only the paths the reproduce stage rewires differ: the policy side, reasoning and curriculum are the stage's.
  assert dataclasses.replace(own, rl=dataclasses.replace(own.rl, model=stage.rl.model, out_dir=stage.rl.out_dir),
                             exp_model=stage.exp_model, offline_data=stage.offline_data, out_dir=stage.out_dir) == stage
  if not variant:
    assert own.exp_model == f"{load_config('configs/train_exp_twc.py').out_dir}/checkpoint"
  else:
    assert own.exp_model == f"{run}/exp_model/checkpoint"


def _state(location: str, exits: str) -> str:
  return f"Location: {location}\nYou see: stove\nExits: {exits}\nInventory (max 2): nothing"


def test_reveals_tells_unseen_rooms_from_what_the_prompt_shows():
  kitchen = _state("kitchen", "north (closed wood door), east to pantry")
  opened = _state("kitchen", "north to bedroom (open wood door), east to pantry")
  pantry = _state("pantry", "west to kitchen")
  assert reveals([kitchen], opened)  # the door opens on a room no state named
  assert not reveals([kitchen], kitchen)
  assert reveals([kitchen], pantry)  # named, never entered: its objects and exits are unknown
  assert not reveals([pantry, kitchen], pantry)  # back to a room the history shows
  assert not reveals([opened], kitchen)  # closing the door hides a room, reveals nothing
  assert reveals([_state("bedroom", "south to kitchen (open wood door)")], _state("kitchen", "south to corridor"))


def _t(history, state, next_state):
  task = Task.make("textworld_express", "coin/train/0")
  return Transition("e", len(history), task, "", state, "a", next_state, 0.0, False, False, False,
                    history=tuple((s, "a") for s in history))


def test_exact_match_is_split_by_what_the_prompt_determines():
  kitchen, pantry = _state("kitchen", "east to pantry"), _state("pantry", "west to kitchen")
  truths = [_t([pantry], kitchen, pantry), _t([], kitchen, pantry), _t([pantry, kitchen], kitchen, pantry)]
  # The history shown is the last max_history steps: the third's pantry (its step 1) is out of view at 1.
  assert reveal_mask(truths, ExpFormatConfig(max_history=2)) == [False, True, False]
  assert reveal_mask(truths, ExpFormatConfig(max_history=1)) == [False, True, True]
  assert reveal_mask(truths, ExpFormatConfig(history=False)) == [True, True, True]
  other = dataclasses.replace(truths[0], task=Task.make("miniwob", "x"))
  assert reveal_mask([other], ExpFormatConfig()) is None  # no reader of this env's states
  assert reveal_mask([other, truths[0]], ExpFormatConfig()) is None  # nor of two envs' transitions together
  right, wrong = ExpPrediction(pantry, 0.0, False, False, "", True, ""), ExpPrediction(kitchen, 0.0, False, False, "",
                                                                                      True, "")
  m = score(truths, [right, wrong, wrong], reveal=[False, True, False])
  assert m["exact_match"] == pytest.approx(1 / 3) and m["reveal_fraction"] == pytest.approx(1 / 3)
  assert (m["exact_match_determined"], m["exact_match_reveal"]) == (0.5, 0.0)
  assert score(truths[:1], [right], reveal=[False])["exact_match_reveal"] is None
  assert "reveal_fraction" not in score(truths, [right] * 3)
  with pytest.raises(ValueError, match="3 transitions but 1 reveal flags"):
    score(truths, [right] * 3, reveal=[False])


def _alf(location: str, seen: str, held: str = "nothing") -> str:
  return f"Location: {location}\nYou see: {seen}\nInventory: {held}\nFeedback: You arrive at {location}."


def test_alfworld_reveals_objects_no_shown_state_lists():
  """ALFWorld hides what a receptacle holds until the agent goes there or opens it: a next state that lists an object
  no state of the prompt lists is not determined by the prompt (`reveal_mask` scores it apart)."""
  room = _alf("middle of the room", "cabinet 1, countertop 1")
  counter = _alf("countertop 1", "apple 1, cloth 2")
  assert reveals_alfworld([room], counter)  # the countertop's objects: in no earlier state
  assert not reveals_alfworld([counter, room], counter)  # back where the history has been
  assert not reveals_alfworld([counter], _alf("countertop 1", "cloth 2", held="apple 1"))  # taken: known
  assert not reveals_alfworld([counter], _alf("cabinet 1", "nothing"))  # an empty receptacle shows nothing new
  assert reveals_alfworld([counter], _alf("cabinet 1", "mug 1"))
  task = Task.make("alfworld", "pick_and_place_simple/train/0")
  t = Transition("e", 1, task, "", room, "go to countertop 1", counter, 0.0, False, False, False,
                 history=((counter, "go to cabinet 1"),))
  assert reveal_mask([t], ExpFormatConfig(max_history=1)) == [False]
  assert reveal_mask([t], ExpFormatConfig(history=False)) == [True]


def test_alfworld_candidate_stages_share_one_setup_and_learn_from_observable_play():
  """configs/*_alfworld.py (the ALFWorld candidate testbed): collection, SFT, real-env GRPO and the held-out
  evaluation on the same games, step limit, prompts and restricted answers; demonstrations from the hand-coded expert
  alone (the planner reads where the object is from the game's PDDL facts)."""
  collect = load_config("configs/collect_alfworld.py:headroom")
  sft = load_config("configs/train_policy_alfworld.py")
  grpo = load_config("configs/grpo_real_alfworld.py")
  ev = load_config("configs/eval_alfworld.py")
  assert "expert=handcoded" in collect.env_kwargs and collect.policies[0].startswith("expert:")
  assert sft.rows.step_sources == sft.rows.experts == ("expert",)  # never the random fallback's steps
  assert sft.data == (f"{collect.out_dir}/trajectories.jsonl",)
  # The recipe measured in the SFT band: goal-object copies, the prompt in the loss, tied embeddings, one cosine
  # schedule over the whole run, batches grouped by length.
  assert sft.value_copies == 3 and sft.rows.prompt_loss and sft.model.tiny.tie_word_embeddings
  assert sft.max_steps == sft.optim.total_steps == 3000 and sft.group_rows % sft.batch_size == 0 < sft.group_rows
  assert grpo.optim.lr == 1e-4  # a third of twc's: the lr that gained on the held-out games
  gigpo = load_config("configs/grpo_real_alfworld.py:gigpo")  # the same run but for the step credit
  assert (gigpo.advantage, gigpo.gamma, grpo.advantage) == ("gigpo", 0.95, "grpo")
  assert dataclasses.replace(gigpo, advantage="grpo", gamma=grpo.gamma, out_dir=grpo.out_dir) == grpo
  limit = [k for k in collect.env_kwargs if k.startswith("step_limit=")]
  assert limit == [k for k in sft.env_kwargs if k.startswith("step_limit=")] == ["step_limit=20"]
  assert sft.env_kwargs == grpo.env_kwargs == ev.env_kwargs
  assert sft.agent == grpo.agent == ev.agent and sft.agent.history_fields == ("Location",)
  assert sft.agent.history_turns >= sft.rollout.max_turns  # every place the episode has been
  for rollout in (sft.rollout, grpo.rollout, ev.rollout):
    assert rollout.constrain_actions and rollout.max_turns == 20
    assert rollout.max_episode_tokens >= rollout.max_turns * rollout.max_action_tokens
    # Training game 312's first prompt is 1051 tokens (it stopped a GRPO run at the 1024 bucket); every bucket and its
    # answer fits the policy's positions.
    assert 1051 <= rollout.prompt_buckets[-1] <= sft.model.tiny.max_position_embeddings - rollout.max_action_tokens
  # Train floor plans for the data and RL, ALFRED's held-out ones for every evaluation.
  assert collect.split == grpo.train_tasks.split == "train"
  assert sft.eval.split == grpo.eval_tasks.split == ev.tasks.split == "eval"
  assert collect.games == sft.eval.games == grpo.train_tasks.games == ev.tasks.games == ("pick_and_place_simple",)
  assert grpo.model.checkpoint == ev.checkpoint == f"{sft.out_dir}/checkpoint"


@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_alfworld_table_runs_the_testbeds_own_stages(variant):
  """configs/reproduce_alfworld_pp.py: every stage on the ALFWorld testbed's games, limit, prompts and restricted
  answers, trained on the train floor plans and scored on the held-out ones; at full size each stage is the
  standalone config that was measured (collection, SFT, real-env GRPO, M_exp, evaluation)."""
  cfg = load_config(f"configs/reproduce_alfworld_pp.py{variant}")
  stages = (cfg.sft, cfg.dpo, cfg.real, cfg.dreamgym.rl, cfg.eval)
  assert {c.env for c in stages} == {cfg.collect.env} == {"alfworld"}
  assert {c.env_kwargs for c in stages} == {("step_limit=20", "invalid_action=continue")}
  assert "step_limit=20" in cfg.collect.env_kwargs and "expert=handcoded" in cfg.collect.env_kwargs
  assert cfg.real.agent == cfg.sft.agent == cfg.dpo.agent == cfg.dreamgym.rl.agent == cfg.eval.agent
  assert all(c.rollout.constrain_actions and c.rollout.max_turns == 20 for c in stages)
  assert {c.rollout.prompt_buckets for c in stages} == {cfg.sft.rollout.prompt_buckets}
  games = ("pick_and_place_simple",)
  assert cfg.collect.games == cfg.real.train_tasks.games == cfg.eval.tasks.games == cfg.sft.eval.games == games
  assert cfg.collect.split == cfg.real.train_tasks.split == cfg.dreamgym.rl.train_tasks.split == "train"
  assert cfg.eval.tasks.split == cfg.real.eval_tasks.split == cfg.sft.eval.split == cfg.dpo.eval.split == "eval"
  # The expert's demonstrations lead the file, so the SFT cap (whole episodes in file order) reads them first.
  assert cfg.collect.policies[0].startswith("expert:") and cfg.sft.rows.step_sources == ("expert",)
  assert cfg.dpo.pairs.chosen_policies == ("expert",)
  assert cfg.exp.format.reasoning and cfg.dreamgym.reasoning and "no_reasoning" in cfg.ablations
  assert (cfg.dreamgym.exp_temperature, cfg.dreamgym.exp_retry_temperature) == (0.0, 1.0)
  # PPO rows: verl-agent's PPO on the GRPO config's policy optimizer with twc's critic; only the algorithm differs.
  twc_critic = load_config(f"configs/reproduce_twc.py{variant}").ppo.critic
  assert as_algorithm(cfg.real, "ppo", cfg.ppo) == as_ppo(cfg.real, critic=twc_critic)
  b = cfg.budgets
  assert (b.dpo, b.real_rl, b.s2r * 16) == (2 * b.sft, 4 * b.sft, b.real_rl)
  if not variant:
    collection = load_config("configs/collect_alfworld.py:headroom")
    assert cfg.collect == collection and collection.policies[0] == "expert:600"
    assert b.sft >= 6074  # the 600 expert episodes' steps in runs/headroom/alfworld_pp_train20 (its summary)
    assert cfg.sft == load_config("configs/train_policy_alfworld.py")
    assert cfg.real == load_config("configs/grpo_real_alfworld.py")
    assert dataclasses.replace(cfg.dreamgym.rl, out_dir=cfg.real.out_dir) == cfg.real
    assert dataclasses.replace(cfg.eval, out_dir="runs/eval/alfworld") == load_config("configs/eval_alfworld.py")
    exp = load_config("configs/train_exp_alfworld.py")
    assert dataclasses.replace(cfg.exp, eval_every=exp.eval_every) == exp
    assert exp.trajectories == (f"{collection.out_dir}/trajectories.jsonl",)
    # twc's M_exp model and format (configs/train_exp_twc.py), room for ALFWorld's longer examples.
    twc = load_config("configs/train_exp_twc.py")
    assert (exp.format, exp.model, exp.steps) == (twc.format, twc.model, twc.steps) and exp.max_len == 2048
    assert cfg.seeds == (0, 1, 2) and cfg.algorithms == ("grpo", "ppo") and len(cfg.ablations) == 4
    assert cfg.eval.tasks.count == 200 and cfg.out_dir == "runs/reproduce/alfworld_pp"
  else:
    assert load_config("configs/train_exp_alfworld.py:tiny").trajectories == (
        f"{cfg.out_dir}/data/trajectories.jsonl",)
