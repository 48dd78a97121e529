"""TextWorld-Express (cookingworld, twc, coin, ...) behind the Env protocol, and its abstract-state mapper.

Facts about TWX 1.1.0 this adapter is built on (measured, see tests/test_env_textworld_express.py):
- TWX accepts exactly the strings in `validActions` (case- and space-sensitive: "take tv remote control" is unknown when
  "take TV remote control" is valid). Anything else gets "Unknown action: I'm not sure what you mean." and leaves the
  game unchanged, but TWX's Python wrapper still counts it as a move. So invalid actions are answered here with that
  same message without a JVM round trip, and TWX's `numMoves` counts only the actions it really executed.
- Games are deterministic per (game, params, fold, seed). Gold paths of coin and twc are not: TWX draws their random
  walk from an unseeded `scala.util.Random`, so two resets of one seed give different (all winning) gold paths.
- Gold paths contain steps that are not admissible when reached (e.g. opening a cupboard the path opened before);
  TWX treats them as unknown no-ops, so the expert skips them. twc gold paths also run one action past the win.
- The reset observation equals `look` in 1.1.0 (older notes say it is empty); the state is built from `look` anyway.
"""

from __future__ import annotations

import atexit
import re
import subprocess
import tempfile
from typing import Any

from dreamjax.envs.base import Observation, StepResult, Task, normalize_action, state_line

INVALID_FEEDBACK = "Unknown action: I'm not sure what you mean."  # TWX's own reply to a string outside validActions
SPLITS = ("train", "dev", "test")
STATE_FIELDS = ("Location", "You see", "Exits", "Inventory", "Feedback", "Notes")


def canonical_params(params: str) -> str:
  """TWX's "key=value, key=value" string with keys sorted, so equal settings give equal task ids."""
  pairs = [p.strip() for p in params.split(",") if p.strip()]
  bad = [p for p in pairs if p.count("=") != 1]
  if bad:
    raise ValueError(f"game_params {params!r}: expected key=value pairs, got {bad[0]!r}")
  return ",".join(sorted("=".join(s.strip() for s in p.split("=")) for p in pairs))


# ---------------------------------------------------------------------------------------------------------------------
# Abstract state: TWX's sentences parsed by regex into a few "Field: value" lines. The experience model predicts states
# in this same format, so it stays flat and regular; a sentence no rule understands is kept verbatim under "Notes".

_ARTICLE = re.compile(r"^(?:a|an|some|the) ", re.I)
_LOCATION = re.compile(r"^You are in (.+)$")
_SEEN = re.compile(r"^(?:In one part of the room you see|In another part of the room you see|There is also|You also see) "
                   r"(.+)$")
_EXIT = re.compile(r"^To the (\w+) you see (.+)$")
_EXIT_THROUGH = re.compile(r"^Through (.+?), to the (\w+) you see (.+)$")
_CAPACITY = re.compile(r"^Inventory \(maximum capacity is (\d+) items?\):")
_OBJECT_RULES = (  # (pattern over the phrase after "you see", how to render it); first match wins
    (re.compile(r"^(?:an? )?open (.+?),? that contains (.+)$", re.I), lambda m: f"{_name(m[1])} (open: {_items(m[2])})"),
    (re.compile(r"^(?:an? )?open (.+?),? that is empty$", re.I), lambda m: f"{_name(m[1])} (open, empty)"),
    (re.compile(r"^(.+?),? that is closed$"), lambda m: f"{_name(m[1])} (closed)"),
    (re.compile(r"^(.+?),? that has nothing on it$"), lambda m: f"{_name(m[1])} (empty)"),
    (re.compile(r"^(.+?),? that has (.+) on it$"), lambda m: f"{_name(m[1])} ({_items(m[2])})"),
    (re.compile(r"^(.+?),? that is empty$"), lambda m: f"{_name(m[1])} (empty)"),
    (re.compile(r"^(.+?),? that contains (.+)$"), lambda m: f"{_name(m[1])} ({_items(m[2])})"),
    (re.compile(r"^([^,]+)$"), lambda m: _name(m[1])),
)


def _name(phrase: str) -> str:
  return _ARTICLE.sub("", phrase.strip())


def _items(phrase: str) -> str:
  # TWX lists as "a x", "a x, and a y", "a x, a y, and a z"; no object name in its data holds a comma or " and ".
  return ", ".join(_name(p) for p in re.split(r",\s*(?:and\s+)?|\s+and\s+", phrase) if p.strip())


def _sentences(text: str) -> list[str]:
  return [s.rstrip(".").strip() for s in re.split(r"(?<=\.)\s+", " ".join(text.split())) if s.strip(" .")]


def _flatten(text: str) -> str:
  """Multi-line feedback (the cookbook's recipe) as one line that keeps its list structure."""
  out = ""
  for line in (" ".join(raw.split()) for raw in text.splitlines()):
    if not line:
      continue
    if out:
      out += " " if out[-1] in ".:!?" else (". " if line.endswith(":") else ", ")
    out += line
  return out


def _inventory(inventory: str) -> tuple[str, str]:
  lines = [" ".join(line.split()) for line in inventory.strip().splitlines()]
  m = _CAPACITY.match(lines[0]) if lines else None
  field = f"Inventory (max {m[1]})" if m else "Inventory"
  items = [_name(line) for line in lines[1:] if line and line != "Your inventory is currently empty."]
  return field, ", ".join(items) or "nothing"


def abstract_state(look: str, inventory: str, feedback: str | None = None) -> str:
  """The compact text state the agent and the experience model read.

  `look` and `inventory` are TWX's texts of the same names; `feedback` is the step's raw observation, left out when it
  only repeats the room description or the inventory (after moving, "look around", "inventory").
  """
  location, seen, exits, notes = "unknown", [], [], []
  for sentence in _sentences(look):
    if m := _LOCATION.match(sentence):
      location = _name(m[1])
    elif m := _SEEN.match(sentence):
      seen.append(next((render(r) for pattern, render in _OBJECT_RULES if (r := pattern.match(m[1]))), m[1]))
    elif m := _EXIT_THROUGH.match(sentence):
      exits.append(f"{m[2].lower()} to {_name(m[3])} ({_name(m[1])})")
    elif m := _EXIT.match(sentence):
      what = _name(m[2])
      exits.append(f"{m[1].lower()} ({what})" if what.startswith("closed ") else f"{m[1].lower()} to {what}")
    else:
      notes.append(sentence)
  inv_field, inv_items = _inventory(inventory)
  lines = [f"Location: {location}", f"You see: {', '.join(seen) or 'nothing'}", f"Exits: {', '.join(exits) or 'none'}",
           f"{inv_field}: {inv_items}"]
  if feedback is not None and " ".join(feedback.split()) not in ("", " ".join(look.split()), " ".join(inventory.split())):
    lines.append(f"Feedback: {_flatten(feedback)}")
  if notes:
    lines.append(f"Notes: {'. '.join(notes)}.")
  return "\n".join(lines)


def state_fields(state: str) -> dict[str, str]:
  """An abstract state (real or predicted) back into its fields; a line without a known field is an error."""
  fields = {}
  for i, line in enumerate(state.splitlines()):
    field = state_line(line)
    if field is None or field[0] not in STATE_FIELDS:
      raise ValueError(f"abstract state line {i + 1}: expected one of {', '.join(STATE_FIELDS)}, got {line!r}")
    fields[field[0]] = field[1]
  return fields


# ---------------------------------------------------------------------------------------------------------------------
# The JVM. TWX's Python wrapper starts it as a py4j gateway on a loopback port with no authentication, so any local
# user who finds the port can call into the JVM (java.lang.Runtime included) and run code as the training user. py4j
# can require a secret token from every client (the JVM prints it to the pipe it shares with us, never to a file or a
# command line), but the wrapper's constructor offers no way to ask for it, so `_twx_with_auth` builds the wrapper
# itself: the same fields as TWX 1.1.0's constructor, the gateway started with `enable_auth=True`, and no Python
# callback server (the wrapper starts one, also unauthenticated, though nothing in TWX calls back into Python).


def _twx_with_auth(step_limit: int):
  """A textworld_express.TextWorldExpressEnv whose JVM gateway refuses clients without its token."""
  from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
  from textworld_express import TextWorldExpressEnv as Twx
  from textworld_express.constants import BASEPATH, JAR_PATH

  port, token, proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, javaopts=["-Xverify:none"],
                                     return_proc=True, enable_auth=True)
  try:
    gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port, auth_token=token),
                          java_process=proc)
    server = gateway.jvm.textworldexpress.runtime.PythonInterface()
  except BaseException:
    proc.kill()
    proc.wait()
    raise
  # The rest of TWX 1.1.0's constructor: the state its reset/step/close methods read.
  twx = Twx.__new__(Twx)
  twx._gateway, twx.server = gateway, server
  twx.lastStepScore, twx.envStepLimit, twx.runHistory = 0, step_limit, []
  twx.seed, twx.gameName, twx.gameParams, twx.gameFold, twx.generateGoldPath = None, None, "", "train", False
  twx._obj_tree_tempfile = tempfile.NamedTemporaryFile()
  return twx


class TextWorldExpressEnv:
  """One TWX game at a time in its own JVM (started on the first reset, ended by close()), whose py4j gateway on
  loopback requires a token that only this process holds (see `_twx_with_auth`).

  Reward is 1.0 on the step where `tasksuccess` turns true, else 0 (TWX's partial score is only reported in `info`).
  The episode ends on success, on TWX's `taskfailure` (e.g. eating or cooking the wrong thing), after `step_limit`
  agent steps (invalid ones included; `info["truncated"]`), or, with `invalid_action="fail"`, on an invalid action.
  `step_limit` and `invalid_action` are plain attributes and may be changed between episodes.
  """

  name = "textworld_express"

  def __init__(self, step_limit: int = 50, invalid_action: str = "continue"):
    if invalid_action not in ("continue", "fail"):
      raise ValueError(f"invalid_action must be 'continue' or 'fail', got {invalid_action!r}")
    if int(step_limit) < 1:
      raise ValueError(f"step_limit must be positive, got {step_limit}")
    self.step_limit = int(step_limit)
    self.invalid_action = invalid_action
    self._twx = None
    self._loaded: tuple[str, str] | None = None  # (game, params) the JVM's generator holds; loading costs a few ms
    self._infos: dict[str, Any] | None = None  # TWX's latest step record; None when no episode is running
    self._instruction = ""
    self._admissible: dict[str, str] = {}  # normalised action -> TWX's exact string
    self._steps = 0
    self._done = True
    self._gold: list[str] = []
    self._gold_pos = 0
    self._deviated = False

  def _server(self):
    if self._twx is None:
      # The wrapper's own step limit would end episodes by its move count; ours counts agent steps instead.
      self._twx = _twx_with_auth(step_limit=2**31 - 1)
    return self._twx

  def _load(self, game: str, params: str, where: str) -> None:
    if self._loaded != (game, params):
      self._loaded = None
      try:
        self._server().load(game, params)
      except ValueError as e:
        raise ValueError(f"{where}: {str(e).strip()}") from None
      self._loaded = (game, params)

  def _generate(self, game: str, split: str, seed: int, params: str, gold: bool, where: str) -> tuple[str, dict]:
    if split not in SPLITS:
      raise ValueError(f"{where}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    self._load(game, params, where)
    self._infos, self._done = None, True  # whatever ran before is gone once the JVM makes a new game
    obs, infos = self._twx.reset(seed=int(seed), gameFold=split, generateGoldPath=gold)
    if obs.startswith("ERROR:"):  # e.g. a malformed parameter value, which TWX's load() lets through
      self._loaded = None
      raise ValueError(f"{where}: TWX could not generate game {game!r} with params {params!r}: {obs.strip()}")
    return obs, infos

  def _seeds(self, game: str, params: str, split: str) -> list[int]:
    if split not in SPLITS:
      raise ValueError(f"tasks({game!r}): split must be one of {', '.join(SPLITS)}, got {split!r}")
    self._load(game, params, f"tasks({game!r}, {split!r})")
    twx = self._twx
    return list({"train": twx.getValidSeedsTrain, "dev": twx.getValidSeedsDev, "test": twx.getValidSeedsTest}[split]())

  def reset(self, task: Task) -> Observation:
    p = task.param
    if task.env != self.name or "game" not in p or "seed" not in p:
      raise ValueError(f"task {task.task_id!r}: not a {self.name} task with params game and seed (env {task.env!r})")
    obs, infos = self._generate(str(p["game"]), str(p.get("split", "train")), int(p["seed"]),
                                canonical_params(str(p.get("game_params", ""))), True, f"task {task.task_id!r}")
    self._gold = list(self._twx.getGoldActionSequence())
    self._gold_pos, self._deviated = 0, False
    self._steps, self._done = 0, False
    self._instruction = infos["taskDescription"]
    return self._observe(infos, obs)

  def _observe(self, infos: dict, feedback: str | None) -> Observation:
    self._infos = infos
    self._admissible = {}
    for action in sorted(set(infos["validActions"])):
      self._admissible.setdefault(normalize_action(action), action)
    return Observation(abstract_state(infos["look"], infos["inventory"], feedback), self._instruction,
                       tuple(self._admissible.values()))

  def _next_gold(self) -> int:
    pos = self._gold_pos
    while pos < len(self._gold) and normalize_action(self._gold[pos]) not in self._admissible:
      pos += 1  # an inadmissible gold step is a no-op in TWX (see module docstring)
    return pos

  def expert_action(self) -> str | None:
    """The next action of TWX's gold path, or None once it is used up or the agent left it.

    Open loop: the path is fixed at reset, so after any admissible non-gold action there is no expert for the rest of
    the episode. Invalid actions change nothing in TWX and do not count as leaving the path.
    """
    if self._done or self._deviated:
      return None
    pos = self._next_gold()
    return self._gold[pos] if pos < len(self._gold) else None

  def step(self, action: str) -> StepResult:
    if self._infos is None:
      raise RuntimeError(f"{self.name}: step() before reset()")
    if self._done:
      raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
    self._steps += 1
    key = normalize_action(action)
    env_action = self._admissible.get(key)
    if env_action is None:
      infos, raw, success, failure = self._infos, INVALID_FEEDBACK, False, False
      observation = self._observe(infos, raw)
    else:
      pos = self._next_gold()
      if pos < len(self._gold) and normalize_action(self._gold[pos]) == key:
        self._gold_pos = pos + 1
      else:
        self._deviated = True
      raw, _, _, infos = self._twx.step(env_action)
      success, failure = bool(infos["tasksuccess"]), bool(infos["taskfailure"])
      observation = self._observe(infos, raw)
    invalid = env_action is None
    if success:
      ended_by = "success"
    elif failure:
      ended_by = "failure"
    elif invalid and self.invalid_action == "fail":
      ended_by = "invalid_action"
    elif self._steps >= self.step_limit:
      ended_by = "step_limit"
    else:
      ended_by = None
    self._done = ended_by is not None
    info = {"observation": raw, "look": infos["look"], "inventory": infos["inventory"], "score": infos["score"],
            "scoreRaw": infos["scoreRaw"], "numMoves": infos["numMoves"], "tasksuccess": success,
            "taskfailure": failure, "action": env_action, "steps": self._steps, "ended_by": ended_by,
            "truncated": ended_by == "step_limit"}
    return StepResult(observation, 1.0 if success else 0.0, self._done, success, invalid, info)

  def close(self) -> None:
    twx, self._twx = self._twx, None
    self._loaded, self._infos, self._done = None, None, True
    if twx is None:
      return
    proc = twx._gateway.java_process  # the wrapper's close() only asks the JVM to exit; wait so none outlives us
    twx.close()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


_SHARED: TextWorldExpressEnv | None = None


def _shared_env() -> TextWorldExpressEnv:
  global _SHARED
  if _SHARED is None:
    _SHARED = TextWorldExpressEnv()
    atexit.register(_SHARED.close)
  return _SHARED


def tasks(game: str, split: str, n: int, start: int = 0, params: str = "",
          env: TextWorldExpressEnv | None = None) -> list[Task]:
  """Tasks for seeds start..start+n-1 of TWX's own fold `split` ("train", "dev", "test"; 1000 seeds each).

  Each task's instruction is TWX's taskDescription, read by generating the game once (3-10 ms a task, no gold path).
  The games are generated in `env` (its current episode ends) or in one module-wide instance started on first use.
  Task ids are "game/split/seed", with canonical params in brackets when not TWX's defaults: "coin[numLocations=3]/...".
  """
  env = env or _shared_env()
  params = canonical_params(params)
  seeds = env._seeds(game, params, split)
  if n < 0 or start < 0 or start + n > len(seeds):
    raise ValueError(f"tasks({game!r}, {split!r}): asked for seeds {start}..{start + n - 1}, the fold has {len(seeds)}")
  name = f"{game}[{params}]" if params else game
  out = []
  for seed in seeds[start:start + n]:
    _, infos = env._generate(game, split, seed, params, False, f"tasks({game!r}, {split!r})")
    out.append(Task.make(TextWorldExpressEnv.name, f"{name}/{split}/{seed}", instruction=infos["taskDescription"],
                         game=game, split=split, seed=int(seed), game_params=params))
  return out
