"""ALFWorld on locally generated games: generation, the adapter, its experts and its abstract states.

Real games are generated into a temporary folder once per module (one per task type) and reused by every test.
"""

import filecmp
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from dreamjax.envs import Env, Task, make_env  # noqa: E402
from dreamjax.envs import alfworld as aw  # noqa: E402
from dreamjax.envs import alfworld_games as games  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return tmp_path_factory.mktemp("alfworld_games")


@pytest.fixture(scope="module")
def train_tasks(root):
  return aw.tasks("train", games.TASK_TYPES, n=len(games.TASK_TYPES), root=str(root))  # seed 0 of every type


@pytest.fixture(scope="module")
def env():
  env = make_env("alfworld")
  yield env
  env.close()


@pytest.fixture(scope="module")
def expert_runs(env, train_tasks):
  """The expert's episode on every task: (task, intro, reset observation, [(action, StepResult)], expert status)."""
  runs = {}
  for task in train_tasks:
    obs = env.reset(task)
    steps = []
    while (action := env.expert_action()) is not None:
      steps.append((action, env.step(action)))
      if steps[-1][1].done:
        break
    runs[task.param["task_type"]] = (task, env.intro, obs, steps, env.expert_status)
  return runs


def test_games_have_the_official_layout_and_load_for_every_type(root, train_tasks):
  assert [t.param["task_type"] for t in train_tasks] == list(games.TASK_TYPES)
  for task in train_tasks:
    folder = games.game_dir("train", task.param["task_type"], 0, root)
    assert task.param["game_file"] == str(folder / "game.tw-pddl")
    assert sorted(p.name for p in folder.iterdir()) == ["game.tw-pddl", "initial_state.pddl", "traj_data.json"]
    game = json.loads((folder / "game.tw-pddl").read_text())
    traj = games.load_traj_data(folder / "game.tw-pddl")
    assert game["solvable"] is True and game["walkthrough"]
    assert game["pddl_problem"] == (folder / "initial_state.pddl").read_text()
    assert f"Your task is to: {task.instruction}." in game["grammar"]
    assert traj["task_type"] == task.param["task_type"]
    assert set(traj["pddl_params"]) == {"object_target", "parent_target", "toggle_target", "mrecep_target",
                                        "object_sliced"}
    assert traj["scene"]["scene_num"] in games._constants().TRAIN_SCENE_NUMBERS


def test_alfworlds_own_training_env_collects_and_plays_the_games(root, train_tasks):
  from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

  config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6], "domain_randomization": False,
                    "expert_type": "handcoded"},
            "dataset": {"data_path": str(root / "train"), "num_train_games": -1},
            "general": {"training_method": "dagger"}, "dagger": {"training": {"max_nb_steps_per_episode": 50}}}
  alfred = AlfredTWEnv(config, train_eval="train")
  assert sorted(alfred.game_files) == sorted(t.param["game_file"] for t in train_tasks)
  alfred.game_files = [train_tasks[1].param["game_file"]]  # look_at: its AlfredExpert (hand-coded) wins it
  env = alfred.init_env(batch_size=1)
  try:
    _, infos = env.reset()
    for _ in range(50):
      _, _, dones, infos = env.step([infos["extra.expert_plan"][0][0]])
      if dones[0]:
        break
    assert infos["won"] == [True]
  finally:
    env.close()


def test_generation_is_reproducible_and_splits_by_floor_plan(root, train_tasks, tmp_path):
  again = games.generate_games(tmp_path, ["look_at_obj_in_light"], n_per_type=1, split="train", seed=0)
  first = games.game_dir("train", "look_at_obj_in_light", 0, root)
  for name in ("game.tw-pddl", "traj_data.json", "initial_state.pddl"):
    assert filecmp.cmp(again[0].parent / name, first / name, shallow=False), name
  assert games.generate_game("train", "look_at_obj_in_light", 0, tmp_path) == again[0]  # read from the cache
  held_out = games.generate_game("eval", "look_at_obj_in_light", 0, tmp_path)
  assert games.load_traj_data(held_out)["scene"]["scene_num"] in games._constants().TEST_SCENE_NUMBERS
  with pytest.raises(ValueError, match="split"):
    games.generate_game("test", "look_at_obj_in_light", 0, tmp_path)


def test_expert_wins_every_type(expert_runs):
  for task_type, (task, _, obs, steps, status) in expert_runs.items():
    assert obs.instruction == task.instruction and obs.admissible, task_type
    last = steps[-1][1]
    assert last.success and last.done and last.reward == 1.0, (task_type, status, [a for a, _ in steps])
    assert all(r.reward == 0.0 and not r.done for _, r in steps[:-1])
    assert len(steps) <= 50
    if task_type != "pick_two_obj_and_place":
      assert status["handcoded"] == "", (task_type, status)  # the hand-coded expert alone solves these


def test_planner_expert_recovers_after_a_deviation_and_keeps_its_deadline(env, train_tasks):
  task = train_tasks[0]
  env.expert = "planner"  # a plain attribute, read at the next reset
  try:
    obs = env.reset(task)
    rng = random.Random(1)
    for _ in range(3):  # wander off first: the planner replans from wherever the agent is
      obs = env.step(rng.choice([a for a in obs.admissible if a.startswith("go to ")])).observation
    steps = []
    while (action := env.expert_action()) is not None:
      steps.append(env.step(action))
      if steps[-1].done:
        break
    assert steps[-1].success and len(steps) <= 12, env.expert_status
  finally:
    env.expert = "auto"
  planner = games.Planner()  # its own worker, so the shared one is not killed
  try:
    with pytest.raises(games.PlannerTimeout, match="search"):
      planner.plan(task.param["game_file"], [], search_s=1e-3)
  finally:
    planner.close()


def test_random_policy_mostly_fails(env, train_tasks):
  task = next(t for t in train_tasks if t.param["task_type"] == "pick_clean_then_place_in_recep")
  rng = random.Random(0)
  wins = 0
  for _ in range(3):
    obs = env.reset(task)
    while True:
      result = env.step(rng.choice(obs.admissible))
      obs = result.observation
      assert not result.invalid
      if result.done:
        break
    wins += result.success
    assert result.success or result.info["truncated"]
  assert wins <= 1


def test_memoised_translation_plays_the_same_game(env, train_tasks):
  """Envs whose reset read the PDDL translation from memory (sharing the parsed task with the env that translated
  it) play exactly the game the translating env plays, stepped in turn, the planner's plans included; and the same
  episode with textworld's parsers not memoised."""
  import fast_downward

  task = next(t for t in train_tasks if t.param["task_type"] == "pick_heat_then_place_in_recep")
  env.reset(task)  # the module's env has memoised textworld's parsers in this process
  fast_downward.pddl2sas.cache_clear()
  envs = [aw.AlfworldEnv(step_limit=12, expert="planner") for _ in range(3)]
  try:
    # textworld translates twice on load and twice on reset: the first env's first two translate.
    first = [e.reset(task) for e in envs]
    info = fast_downward.pddl2sas.cache_info()
    assert (info.misses, info.hits) == (2, 10) and first[1] == first[0] and first[2] == first[0]
    rng = random.Random(0)
    obs, done, actions, episode = first[0], False, [], [_comparable(first[0], None)]
    while not done:
      plans = [e.expert_action() for e in envs]
      assert plans[1] == plans[0] and plans[2] == plans[0] and plans[0] is not None
      actions.append(plans[0] if len(actions) % 2 else rng.choice(obs.admissible))
      results = [e.step(actions[-1]) for e in envs]
      assert results[1] == results[0] and results[2] == results[0]
      obs, done = results[0].observation, results[0].done
      episode.append(_comparable(obs, plans[0], results[0]))
    assert fast_downward.pddl2sas.cache_info().misses == 2
  finally:
    for e in envs:
      e.close()
  # The same actions in a process where textworld parses and translates everything anew.
  script = f"""
import json, sys
from dreamjax.envs import Task, alfworld as aw
from tests.test_env_alfworld import _comparable
aw._memoize_textworld = lambda: None
params, actions = map(json.loads, sys.argv[1:])  # read first: fast-downward's translation rewrites sys.argv
env = aw.AlfworldEnv(step_limit=12, expert="planner")
episode = [_comparable(env.reset(Task.make("alfworld", {task.task_id!r}, **params)), None)]
for action in actions:
  plan = env.expert_action()
  result = env.step(action)
  episode.append(_comparable(result.observation, plan, result))
import fast_downward
assert not hasattr(fast_downward.pddl2sas, "cache_info")
print(json.dumps(episode))
"""
  out = subprocess.run([sys.executable, "-c", script, json.dumps(task.param), json.dumps(actions)],
                       capture_output=True, text=True, cwd=Path(__file__).parent.parent)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.splitlines()[-1]) == episode


def _comparable(obs, plan, result=None) -> list:
  extra = [result.reward, result.done, result.success, result.invalid, result.info["observation"]] if result else []
  return [obs.state, obs.instruction, list(obs.admissible), plan, *extra]


def test_invalid_action_is_flagged_and_the_step_limit_ends_episodes(env, train_tasks):
  task = train_tasks[0]
  obs = env.reset(task)
  result = env.step("fly to the moon")
  assert result.invalid and not result.done and result.reward == 0.0
  assert result.info["observation"] == aw.INVALID_FEEDBACK and result.info["action"] is None
  assert result.observation.admissible == obs.admissible
  assert result.observation.state.splitlines()[:3] == obs.state.splitlines()[:3]
  assert aw.state_fields(result.observation.state)["Feedback"] == aw.INVALID_FEEDBACK
  assert env._gym.step("fly to the moon")[0] == aw.INVALID_FEEDBACK  # what ALFWorld itself answers

  env.invalid_action, env.step_limit = "fail", 2  # plain attributes, changeable between episodes
  try:
    env.reset(task)
    result = env.step("fly to the moon")
    assert result.done and not result.success and result.info["ended_by"] == "invalid_action"
    assert env.expert_action() is None
    env.reset(task)
    env.step("look")
    result = env.step("look")
    assert result.done and result.info["truncated"] and not result.success
    with pytest.raises(RuntimeError, match="after the episode ended"):
      env.step("look")
  finally:
    env.invalid_action, env.step_limit = "continue", 50


def test_state_mapper_on_real_observations(expert_runs):
  for task_type, (_, intro, obs, steps, _) in expert_runs.items():
    fields = aw.state_fields(obs.state)
    assert fields["Location"] == aw.MIDDLE and fields["Inventory"] == "nothing"
    assert "Welcome" not in obs.state and "Your task" not in obs.state
    feedbacks = []
    for action, result in steps:
      fields = aw.state_fields(result.observation.state)
      assert fields["Feedback"] == aw.flatten(result.info["observation"])
      verb, _, rest = action.partition(" ")
      if action.startswith("go to "):
        assert fields["Location"].split(" (")[0] == action[len("go to "):], task_type
      elif verb == "take":
        obj, recep = rest.split(" from ")
        assert obj in fields["Inventory"].split(", ") and obj not in fields["You see"].split(", ")
      elif verb == "move":
        obj, recep = rest.split(" to ")
        assert obj not in fields["Inventory"].split(", ") and obj in fields["You see"].split(", ")
      elif verb == "open":
        assert fields["Location"] == f"{rest} (open)"
      feedbacks.append(result.info["observation"])
      assert aw.abstract_state(intro, feedbacks) == result.observation.state  # a pure function of the texts


def test_state_mapper_on_alfworld_sentences():
  intro = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
           "see a cabinet 2, a cabinet 1, and a fridge 1.\n\nYour task is to: put a cool apple in cabinet.")
  b = aw.initial_belief(intro)
  assert (b.location, b.seen) == (aw.MIDDLE, ("cabinet 1", "cabinet 2", "fridge 1"))
  b = aw.advance(b, "You are in the middle of a room. Looking quickly around you, you see nothing.")
  assert b.seen == ("cabinet 1", "cabinet 2", "fridge 1")  # "look" there lists nothing; the room is unchanged
  b = aw.advance(b, "You arrive at fridge 1. The fridge 1 is closed.")
  assert (b.location, b.status, b.seen) == ("fridge 1", "closed", ())
  b = aw.advance(b, "You open the fridge 1. The fridge 1 is open. In it, you see a apple 2, and a egg 1.")
  assert (b.status, b.seen) == ("open", ("apple 2", "egg 1"))
  b = aw.advance(b, "You pick up the apple 2 from the fridge 1.")
  assert (b.seen, b.inventory) == (("egg 1",), ("apple 2",))
  b = aw.advance(b, "You cool the apple 2 using the fridge 1.")
  assert b.feedback == "You cool the apple 2 using the fridge 1." and b.inventory == ("apple 2",)
  b = aw.advance(b, "You close the fridge 1.")
  assert (b.status, b.seen) == ("closed", ())
  b = aw.advance(b, "You arrive at cabinet 1. On the cabinet 1, you see nothing.")
  b = aw.advance(b, "You move the apple 2 to the cabinet 1.")
  assert (b.location, b.seen, b.inventory) == ("cabinet 1", ("apple 2",), ())
  assert aw.advance(b, "You are carrying: a mug 1.").inventory == ("mug 1",)
  beside = aw.advance(b, "You open the drawer 2. The drawer 2 is open. In it, you see a pen 1.")  # shares the spot
  assert (beside.location, beside.status, beside.seen) == ("drawer 2", "open", ("pen 1",))
  help_text = aw.advance(b, "\nAvailable commands:\n  look:    look around\n").feedback
  assert help_text == "Available commands: look: look around"
  assert aw.render_state(b) == ("Location: cabinet 1\nYou see: apple 2\nInventory: nothing\n"
                                "Feedback: You move the apple 2 to the cabinet 1.")
  with pytest.raises(ValueError, match="line 2"):
    aw.state_fields("Location: cabinet 1\nWhere: nowhere")


def test_tasks_ids_are_unique_and_stable(root, train_tasks):
  ids = [t.task_id for t in train_tasks]
  assert len(set(ids)) == len(ids) and ids[0] == "pick_and_place_simple/train/0"
  assert aw.tasks("train", games.TASK_TYPES, 6, root=str(root)) == train_tasks
  assert aw.tasks("train", games.TASK_TYPES, 3, start=3, root=str(root)) == train_tasks[3:]
  assert all(Task.from_json(t.to_json()) == t for t in train_tasks)
  with pytest.raises(ValueError, match="split"):
    aw.tasks("valid", games.TASK_TYPES, 1, root=str(root))


def test_make_env_builds_the_adapter():
  env = make_env("alfworld", step_limit=7, expert="planner")
  assert isinstance(env, aw.AlfworldEnv) and isinstance(env, Env)
  assert (env.name, env.step_limit, env.expert) == ("alfworld", 7, "planner")
  with pytest.raises(RuntimeError, match="before reset"):
    env.step("look")
  with pytest.raises(ValueError, match="invalid_action"):
    make_env("alfworld", invalid_action="ignore")
  with pytest.raises(ValueError, match="not an alfworld task"):
    env.reset(Task.make("alfworld", "x", seed=0))
