"""ALFWorld (its TextWorld games) behind the Env protocol, with its experts and an abstract-state mapper.

Games come from `alfworld_games` (generated locally in the official format) and run through ALFWorld's own stack:
`textworld.gym` over textworld's PddlEnv with ALFWorld's `AlfredDemangler` and `AlfredInfos` wrappers, requesting the
infos its experts read (admissible commands, facts, won). Facts this adapter is built on (measured, see
tests/test_env_alfworld.py):
- PddlEnv accepts exactly the strings of `admissible_commands`; anything else gets "Nothing happens." and changes
  nothing, so invalid actions are answered here with that same reply, without a round trip.
- Unmemoised, a reset costs about a second of CPU (1.5 s for a new game, 0.75 s for the same game again; kitchens
  more): textworld translates the game's PDDL anew, twice on load and twice on reset. A step costs about 35-70 ms,
  spent listing the next admissible commands, mostly by parsing the same grammar templates again. Those parsers are
  memoised per process (`_memoize_textworld`); in an EnvPool a GRPO group's episodes reset one game in several env
  slots of a worker, and all but the first then skip the translation.
- The hand-coded expert (`HandCodedTWAgent`) tracks what it put down by looking for "put" in the last command, but this
  grammar's command is "move X to Y": after its first placement it believes it still holds the object, and on
  pick_two it then proposes inadmissible moves and loops. It also proposes closing receptacles it is not at, going to
  a receptacle sharing its current location (not admissible), and raises IndexError in some rooms. It is not
  deterministic (module-level `random`); here it draws from its own generator. In "auto" mode, once it fails (an
  exception, an inadmissible proposal, a loop) the planner expert takes over for the rest of the episode. Measured on
  8 games per type: hand-coded alone 8, 8, 7, 8, 7 and 1 of 8 (pick_and_place, look_at, clean, heat, cool, pick_two),
  the planner 48/48 in 4-10 steps.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

from dreamjax.envs import alfworld_games as games
from dreamjax.envs.base import Observation, StepResult, Task, normalize_action

INVALID_FEEDBACK = "Nothing happens."  # PddlEnv's reply to any command outside its admissible commands
EXPERTS = ("auto", "handcoded", "planner")
# In "auto" mode the hand-coded expert hands over to the planner when this few steps remain: it searches receptacle by
# receptacle and can run out of steps one action short of a win (measured: 50 steps in a kitchen with 11 drawers),
# while the planner's plans from a reset took 4-10 steps on 48 games.
PLANNER_RESERVE = 15
STATE_FIELDS = ("Location", "You see", "Inventory", "Feedback")
MIDDLE = "middle of the room"


# ---------------------------------------------------------------------------------------------------------------------
# Abstract state: what the agent knows, tracked from ALFWorld's sentences (alfred.twl2's grammar) into four fields. The
# experience model predicts states in this same format. The step's own text is always kept whole under "Feedback".


@dataclasses.dataclass(frozen=True)
class Belief:
  location: str = MIDDLE  # the receptacle the agent stands at
  status: str = ""  # "open" or "closed" for an openable receptacle whose state the agent has seen, else ""
  seen: tuple[str, ...] = ()  # what is in/on it (in the middle of the room: the receptacles around)
  inventory: tuple[str, ...] = ()
  feedback: str = ""


_ITEM_SPLIT = re.compile(r",\s*(?:and\s+)?|\s+and\s+")
_RULES = (  # (pattern over one sentence-ish clause, update); applied left to right over a feedback text
    ("arrive", re.compile(r"You arrive at (?P<r>[^.]+?)\.")),
    ("opened", re.compile(r"You open the (?P<r>[^.]+?)\.")),
    ("inside", re.compile(r"The (?P<r>[^.]+?) is open\. In it, you see (?P<items>[^.]+?)\.")),
    ("closed", re.compile(r"The (?P<r>[^.]+?) is closed\.")),
    ("on", re.compile(r"On the (?P<r>[^,]+?), you see (?P<items>[^.]+?)\.")),
    ("close", re.compile(r"You close the (?P<r>[^.]+?)\.")),
    ("take", re.compile(r"You pick up the (?P<o>[^.]+?) from the (?P<r>[^.]+?)\.")),
    ("put", re.compile(r"You move the (?P<o>[^.]+?) to the (?P<r>[^.]+?)\.")),
    ("carry", re.compile(r"You are carrying: (?P<items>[^.]+?)\.")),
    ("empty_handed", re.compile(r"You are not carrying anything\.")),
    ("room", re.compile(r"You are in the middle of a room\. Looking quickly around you, you see (?P<items>[^.]+?)\.")),
)


def _items(phrase: str) -> tuple[str, ...]:
  names = [re.sub(r"^(?:a|an|the|some) ", "", p.strip()) for p in _ITEM_SPLIT.split(phrase) if p.strip()]
  return tuple(n for n in names if n != "nothing")


def _sorted(names) -> tuple[str, ...]:
  def key(name: str):
    base, _, num = name.rpartition(" ")
    return (base, int(num)) if num.isdigit() else (name, 0)

  return tuple(sorted(set(names), key=key))


def flatten(text: str) -> str:
  return " ".join(text.split())


def _room_text(intro: str) -> tuple[str, str]:
  """(the room description, the task) of ALFWorld's intro, without its banner."""
  body = flatten(re.sub(r"^-= Welcome to TextWorld, ALFRED! =-", "", intro.strip()))
  room, _, task = body.partition("Your task is to: ")
  return room.strip(), task.strip().rstrip(".")


def advance(belief: Belief, feedback: str) -> Belief:
  """The belief after an admissible action's feedback (pure; unparsed text changes nothing but the feedback)."""
  b = dataclasses.replace(belief, feedback=flatten(feedback))
  text = b.feedback
  matches = sorted((m.start(), kind, m) for kind, rule in _RULES for m in rule.finditer(text))
  for _, kind, m in matches:
    g = m.groupdict()
    if kind in ("arrive", "opened", "inside", "closed", "on", "close") and g["r"] != b.location:
      # A receptacle sharing the agent's location (drawers 1 and 2 at one spot) can be opened or examined from there;
      # what the agent then knows is that one's.
      b = dataclasses.replace(b, location=g["r"], status="", seen=())
    if kind in ("inside", "opened"):
      b = dataclasses.replace(b, status="open", seen=_sorted(_items(g["items"])) if "items" in g else b.seen)
    elif kind in ("closed", "close"):
      b = dataclasses.replace(b, status="closed", seen=())
    elif kind == "on":
      b = dataclasses.replace(b, seen=_sorted(_items(g["items"])))
    elif kind == "take":
      b = dataclasses.replace(b, inventory=_sorted(b.inventory + (g["o"],)),
                              seen=tuple(s for s in b.seen if s != g["o"]) if g["r"] == b.location else b.seen)
    elif kind == "put":
      b = dataclasses.replace(b, inventory=tuple(i for i in b.inventory if i != g["o"]),
                              seen=_sorted(b.seen + (g["o"],)) if g["r"] == b.location else b.seen)
    elif kind == "carry":
      b = dataclasses.replace(b, inventory=_sorted(_items(g["items"])))
    elif kind == "empty_handed":
      b = dataclasses.replace(b, inventory=())
    elif kind == "room":
      # "look" in the middle of the room lists nothing (its grammar looks for receptacles at the agent's location,
      # and there are none); the receptacles the intro listed are still around.
      items = _items(g["items"])
      b = dataclasses.replace(b, location=MIDDLE, status="", seen=_sorted(items) if items or b.location != MIDDLE
                              else b.seen)
  return b


def initial_belief(intro: str) -> Belief:
  """The belief at reset, from ALFWorld's intro (banner, room description, task); the task is the instruction."""
  room, _ = _room_text(intro)
  return advance(Belief(), room)


def render_state(belief: Belief) -> str:
  where = f"{belief.location} ({belief.status})" if belief.status else belief.location
  return "\n".join([f"Location: {where}", f"You see: {', '.join(belief.seen) or 'nothing'}",
                    f"Inventory: {', '.join(belief.inventory) or 'nothing'}", f"Feedback: {belief.feedback}"])


def abstract_state(intro: str, feedbacks: Sequence[str] = ()) -> str:
  """The abstract state after the given feedbacks of admissible actions (invalid ones change nothing but feedback)."""
  belief = initial_belief(intro)
  for feedback in feedbacks:
    belief = advance(belief, feedback)
  return render_state(belief)


def state_fields(state: str) -> dict[str, str]:
  """An abstract state (real or predicted) back into its fields; a line without a known field is an error."""
  fields = {}
  for i, line in enumerate(state.splitlines()):
    key, sep, value = line.partition(": ")
    if not sep or key not in STATE_FIELDS:
      raise ValueError(f"abstract state line {i + 1}: expected one of {', '.join(STATE_FIELDS)}, got {line!r}")
    fields[key] = value
  return fields


# ---------------------------------------------------------------------------------------------------------------------
# Experts


def reveals(shown: Sequence[str], next_state: str) -> bool:
  """Whether `next_state` lists an object (in view or held) that none of the `shown` states (what a model was given:
  the history and the current state) lists. What a receptacle holds is in the game's hidden layout until the agent
  goes there or opens it, so no model predicts such a state exactly from its prompt; `dreamjax.experience.fidelity`
  scores these transitions apart from those the prompt determines."""
  def objects(state: str) -> set[str]:
    fields = state_fields(state)
    return {o for key in ("You see", "Inventory") for o in fields.get(key, "").split(", ") if o and o != "nothing"}

  return not objects(next_state) <= set().union(*map(objects, shown))


class _HandCoded:
  """ALFWorld's HandCodedTWAgent fed as its AlfredExpert wrapper feeds it, with its own random generator.

  `strict`: give up at its first inadmissible proposal (then the planner takes over). Otherwise it is handled as
  AlfredExpert does: "look" is proposed instead, and the agent then answers an inadmissible plan with a random action.
  Either way it gives up on an exception or a loop: while followed, the same world state (the game's facts) and the same
  proposal a second time.
  """

  def __init__(self, game_file: str, intro: str, seed: str, strict: bool):
    from alfworld.agents.expert import HandCodedTWAgent

    self.agent = HandCodedTWAgent(max_steps=200)
    self.strict = strict
    self._rng = random.Random(seed).getstate()
    self.failed = ""
    self.next: str | None = "look"  # AlfredExpert's first proposal, before the agent has seen anything
    self._followed: set = set()
    self._call(lambda: (self.agent.reset(game_file), self.agent.observe(intro)))

  def _call(self, fn):
    outer = random.getstate()  # the agent draws from module-level `random`; keep that stream untouched
    random.setstate(self._rng)
    try:
      return fn()
    finally:
      self._rng = random.getstate()
      random.setstate(outer)

  def update(self, game_state: dict[str, Any], command: str) -> None:
    if self.failed:
      return
    followed = command == self.next
    try:
      action = self._call(lambda: self.agent.act(game_state, 0, game_state["won"], command))
    except Exception as e:  # HandCodedAgentTimeout/Failed, and its own IndexErrors on states it did not foresee
      self.failed, self.next = f"{type(e).__name__}: {e}", None
      return
    if action not in game_state["admissible_commands"]:
      if self.strict:
        self.failed, self.next = f"inadmissible proposal {action!r}", None
        return
      action = "look"
    self.next = action
    if followed:
      key = (frozenset(map(str, game_state["facts"])), action)
      if key in self._followed:
        self.failed, self.next = f"loop at {action!r}", None
      self._followed.add(key)


def _memoize_textworld() -> None:
  """Makes the pure parsers textworld's PDDL games run on every load, reset and step answer a recent input from memory:
  fast-downward's PDDL-to-SAS translation (twice per load and reset), the game grammar's parse (per load), and the
  parses of the grammar's templates and conditions (for every admissible command, every step). Each depends only on
  its text. Parses come back as deep copies, since textworld sets contexts on the symbols it derives; a translation is
  shared, since PddlState only reads its task and hands the SAS text to its own copy of the planner library.
  Measured on pick_and_place games, 4 envs in one process (a pool worker's slots): a step 35.7 -> 11.4 ms, a reset of
  a game another of them loaded 1.04 -> 0.15 s, the same episodes (tests/test_env_alfworld.py compares them with a
  process that memoises nothing). Idempotent; per process (each pool worker keeps its own)."""
  import fast_downward
  import textworld.envs.pddl.logic as pddl_logic
  import textworld.envs.pddl.textgen as textgen
  from textworld.logic import Rule

  if getattr(fast_downward.pddl2sas, "cache_info", None):
    return

  def memo(fn, size: int, copy: bool):
    cached = functools.lru_cache(maxsize=size)(fn)
    if not copy:
      return cached
    wrapper = functools.wraps(fn)(lambda *args, **kwargs: deepcopy(cached(*args, **kwargs)))
    wrapper.cache_info = cached.cache_info
    return wrapper

  # Sizes: a GRPO group resets one game in several env slots of a worker in a row; templates are the domain's few.
  fast_downward.pddl2sas = memo(fast_downward.pddl2sas, 8, copy=False)  # logic calls it through the module
  pddl_logic._parse_and_convert = memo(pddl_logic._parse_and_convert, 4, copy=True)
  textgen._parse_and_convert = memo(textgen._parse_and_convert, 4096, copy=True)
  query = memo(Rule.parse_conjunctive_query, 4096, copy=True)
  Rule.parse_conjunctive_query = classmethod(lambda cls, expr: query(expr))


# ---------------------------------------------------------------------------------------------------------------------


class AlfworldEnv:
  """One ALFWorld game at a time, in one textworld.gym environment reused across resets.

  Reward is 1.0 on the step where the game is won, else 0. The episode ends on a win, after `step_limit` agent steps
  (invalid ones included; `info["truncated"]`), or, with `invalid_action="fail"`, on an invalid action.
  `expert`: "auto" (hand-coded, then the planner once it fails or PLANNER_RESERVE steps remain), "handcoded" or
  "planner" (`expert_action`).
  """

  name = "alfworld"

  def __init__(self, step_limit: int = 50, invalid_action: str = "continue", expert: str = "auto",
               planner_timeout_s: float = 30.0, games_root: str | None = None):
    if invalid_action not in ("continue", "fail"):
      raise ValueError(f"invalid_action must be 'continue' or 'fail', got {invalid_action!r}")
    if expert not in EXPERTS:
      raise ValueError(f"expert must be one of {', '.join(EXPERTS)}, got {expert!r}")
    if int(step_limit) < 1:
      raise ValueError(f"step_limit must be positive, got {step_limit}")
    self.step_limit, self.invalid_action, self.expert = int(step_limit), invalid_action, expert
    self.planner_timeout_s, self.games_root = float(planner_timeout_s), games_root
    self._gym = None
    self._loaded = ""  # the game file the gym env holds
    self._game_file = ""
    self.intro = ""  # ALFWorld's own intro text of the current game (banner, room, task)
    self._infos: dict[str, Any] | None = None
    self._belief = Belief()
    self._instruction = ""
    self._admissible: dict[str, str] = {}
    self._steps, self._done = 0, True
    self._history: list[str] = []  # executed (admissible) commands, what the planner replays
    self._handcoded: _HandCoded | None = None
    self._plan: list[str] | None = None  # the planner's remaining plan while the agent follows it
    self._planner_error = ""

  def _start(self, game_file: str) -> tuple[str, dict[str, Any]]:
    if self._gym is None:
      games.default_data_dir()
      _memoize_textworld()
      import textworld
      import textworld.gym
      from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

      infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, extras=["gamefile"])
      env_id = textworld.gym.register_game(game_file, infos, max_episode_steps=0, asynchronous=False,
                                           wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
      self._gym = textworld.gym.make(env_id)
    if game_file == self._loaded:
      # The same game again (a GRPO group): reset only. The gym env's reset loads the game first, which translates
      # its PDDL twice more and doubles the cost.
      obs, infos = self._gym.batch_env.reset()
      return obs[0], {k: v[0] for k, v in infos.items()}
    # The gym env cycles through its `gamefiles`, reshuffled by seed(); with one file its next reset plays that one.
    self._loaded = ""
    self._gym.gamefiles = [game_file]
    self._gym.seed(0)
    obs, infos = self._gym.reset()
    self._loaded = game_file
    return obs, infos

  def _resolve(self, task: Task) -> str:
    p = task.param
    missing = [k for k in ("task_type", "split", "seed") if k not in p]
    if task.env != self.name or missing:
      raise ValueError(f"task {task.task_id!r}: not an {self.name} task with params task_type, split and seed")
    path = p.get("game_file")
    if path and Path(path).exists():
      return str(path)
    return str(games.generate_game(str(p["split"]), str(p["task_type"]), int(p["seed"]), self.games_root))

  def reset(self, task: Task) -> Observation:
    game_file = self._resolve(task)
    self._infos, self._done = None, True
    intro, infos = self._start(game_file)
    self._game_file, self.intro = game_file, intro
    self._belief = initial_belief(intro)
    self._instruction = _room_text(intro)[1] or task.instruction
    self._steps, self._done, self._history = 0, False, []
    self._plan, self._planner_error = None, ""
    self._handcoded = (_HandCoded(game_file, intro, task.task_id, strict=self.expert == "auto")
                       if self.expert != "planner" else None)
    return self._observe(infos)

  def _observe(self, infos: dict[str, Any]) -> Observation:
    self._infos = infos
    self._admissible = {normalize_action(a): a for a in infos["admissible_commands"]}
    return Observation(render_state(self._belief), self._instruction, tuple(infos["admissible_commands"]))

  def step(self, action: str) -> StepResult:
    if self._infos is None:
      raise RuntimeError(f"{self.name}: step() before reset()")
    if self._done:
      raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
    self._steps += 1
    command = self._admissible.get(normalize_action(action))
    if command is None:
      raw, infos, won = INVALID_FEEDBACK, self._infos, False
      self._belief = dataclasses.replace(self._belief, feedback=INVALID_FEEDBACK)
    else:
      raw, _, _, infos = self._gym.step(command)
      won = bool(infos["won"])
      self._history.append(command)
      self._belief = advance(self._belief, raw)
      if self._handcoded is not None and not won:
        self._handcoded.update({**infos, "feedback": raw}, command)
      if self._plan and self._plan[0] == command:
        self._plan = self._plan[1:]
      else:
        self._plan = None
    observation = self._observe(infos)
    if won:
      ended_by = "success"
    elif command is None and self.invalid_action == "fail":
      ended_by = "invalid_action"
    elif self._steps >= self.step_limit:
      ended_by = "step_limit"
    else:
      ended_by = None
    self._done = ended_by is not None
    info = {"observation": raw, "won": won, "action": command, "steps": self._steps, "ended_by": ended_by,
            "truncated": ended_by == "step_limit", "game_file": self._game_file}
    return StepResult(observation, 1.0 if won else 0.0, self._done, won, command is None, info)

  def expert_action(self) -> str | None:
    """The next expert action from the current state, or None (episode over, or no expert has a plan)."""
    if self._done or self._infos is None:
      return None
    hand = self._handcoded
    if hand is not None and not hand.failed and hand.next:
      if self.expert == "handcoded" or self.step_limit - self._steps > PLANNER_RESERVE:
        return hand.next
      hand.failed, hand.next = f"still searching after {self._steps} steps", None
    if self.expert == "handcoded" or self._planner_error:
      return None
    if self._plan is None:
      try:
        self._plan = games.shared_planner().plan(self._game_file, self._history, self.planner_timeout_s)
      except games.PlannerError as e:
        self._planner_error, self._plan = str(e), []
    return self._plan[0] if self._plan else None

  @property
  def expert_status(self) -> dict[str, str]:
    """Why an expert gave up in this episode ("" while it has not): for collectors' statistics."""
    return {"handcoded": self._handcoded.failed if self._handcoded else "", "planner": self._planner_error}

  def close(self) -> None:
    gym, self._gym = self._gym, None
    self._infos, self._done, self._loaded = None, True, ""
    if gym is not None:
      gym.close()


def tasks(split: str, task_types: Sequence[str], n: int, start: int = 0, root: str | None = None) -> list[Task]:
  """Tasks start..start+n-1 of `split`, round-robin over `task_types`: task j is type j % T with seed j // T.

  Games are generated (or read from the cache) on the way, so each task's instruction is its game's goal. Ids are
  "task_type/split/seed", stable across runs and machines.
  """
  if n < 0 or start < 0:
    raise ValueError(f"tasks({split!r}): n and start must be non-negative, got n={n}, start={start}")
  if not task_types:
    raise ValueError(f"tasks({split!r}): no task types")
  out = []
  for j in range(start, start + n):
    task_type, seed = task_types[j % len(task_types)], j // len(task_types)
    game_file = games.generate_game(split, task_type, seed, root)
    goal = games.load_traj_data(game_file)["dreamjax"]["goal"]
    out.append(Task.make(AlfworldEnv.name, f"{task_type}/{split}/{seed}", instruction=goal, game_file=str(game_file),
                         task_type=task_type, split=split, seed=seed))
  return out
