"""ALFWorld games generated locally, in the official format, from what the alfworld wheel ships.

The official game data (`json_2.1.1`: traj_data.json + game.tw-pddl per trial) cannot be downloaded here, but the wheel
holds every ingredient: the PDDL domain and text grammar (`alfworld.info`), the 120 AI2-THOR floor plans
(`alfworld/gen/layouts/FloorPlan*-objects.json` lists the object classes of a scene, `-openable.json` its receptacle
instances with the pose the agent takes in front of each), object/receptacle compatibility and affordances
(`alfworld/gen/constants.py`) and the goal templates of the 6 task types (`alfworld/gen/goal_library.py`).

A game is a function of (split, task type, seed) alone: a `random.Random` seeded with that string picks a floor plan
of the split (ALFRED's train floor plans for "train", its held-out ones for "eval", so eval rooms are never trained on),
fills it, picks a goal whose preconditions hold but which is not already satisfied, and the planner must solve it.
A candidate that fails any check is retried with the next attempt number, so every seed yields a game and the same
seed always yields the same bytes. Games are cached under `<root>/<split>/<task_type>/<seed>/` (root defaults to
`$ALFWORLD_DATA/dreamjax_games/v<GENERATOR_VERSION>`); the folder holds `traj_data.json`, `initial_state.pddl` and
`game.tw-pddl` like an official trial, and is renamed into place only once complete, so concurrent workers never read
half a game.

Where the layouts are silent the generator chooses, deterministically: instance ids and locations of receptacle classes
a scene lists without a pose (a scene's garbage can, stove burners, toaster...), how many instances of each object
class there are (1 to ALFRED's MAX_NUM_OF_OBJ_INSTANCES, mostly 1) and where they lie (any compatible receptacle), and
where lamps stand (a table-like receptacle: the layouts give lamps no parent, the look-at goal needs one). Only the
goal's lamp is toggleable and what starts in a fridge is cool, as in ALFRED's own PDDL states.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

GENERATOR_VERSION = 1  # bump when the output for a seed changes, so stale caches are never mixed with new games
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
SPLITS = ("train", "eval")
MAX_ATTEMPTS = 64
PLAN_TIMEOUT_S = 60.0  # search budget when proving a candidate solvable (measured: milliseconds on the relevant part)
LOAD_BUDGET_S = 300.0  # what the planner worker may spend loading and replaying a game before it counts as hung

_LAMP_PARENTS = ("Desk", "SideTable", "Dresser", "CoffeeTable", "DiningTable")
_TOOL = {"pick_clean_then_place_in_recep": ("SinkBasin", "BathtubBasin"),
         "pick_heat_then_place_in_recep": ("Microwave",), "pick_cool_then_place_in_recep": ("Fridge",)}
_NEEDS = {"pick_clean_then_place_in_recep": "Cleanable", "pick_heat_then_place_in_recep": "Heatable",
          "pick_cool_then_place_in_recep": "Coolable"}


def default_data_dir() -> Path:
  """`$ALFWORLD_DATA`, or `<repo>/.cache/alfworld` (git-ignored); exported so alfworld's own modules agree with us."""
  path = os.environ.get("ALFWORLD_DATA") or str(Path(__file__).resolve().parents[2] / ".cache" / "alfworld")
  os.environ["ALFWORLD_DATA"] = path
  return Path(path)


def default_games_root() -> Path:
  return default_data_dir() / "dreamjax_games" / f"v{GENERATOR_VERSION}"


def _constants():
  default_data_dir()  # alfworld.info creates ALFWORLD_DATA on import; it must be ours, not ~/.cache
  from alfworld.gen import constants

  return constants


def _check(split: str, task_type: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"alfworld split must be one of {', '.join(SPLITS)}, got {split!r}")
  if task_type not in TASK_TYPES:
    raise ValueError(f"alfworld task type must be one of {', '.join(TASK_TYPES)}, got {task_type!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Scenes


def _mangle(name: str) -> str:
  """ALFRED's PlannedGameState.fix_pddl_str_chars for ids: PDDL names cannot hold | + - . ,"""
  table = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}
  return "".join(table.get(c, c) for c in name)


def _coord(v: float) -> str:
  return f"{v:+06.2f}" if abs(v) >= 0.005 else "00.00"


def _loc(x: float, z: float, rotation: int, horizon: int) -> str:
  # ALFRED's pose: grid cells of AGENT_STEP_SIZE (0.25 m), rotation in quarter turns, camera horizon in degrees.
  return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{rotation // 90 % 4}|{horizon}"


@lru_cache(maxsize=None)
def _scene(number: int) -> tuple[tuple[str, ...], tuple[tuple[str, str, str], ...]]:
  """(object classes, receptacles as (id, class, location)) of a floor plan, from the wheel's layouts."""
  folder = Path(_constants().__file__).parent / "layouts"
  classes = tuple(sorted(set(json.loads((folder / f"FloorPlan{number}-objects.json").read_text()))))
  poses = json.loads((folder / f"FloorPlan{number}-openable.json").read_text())
  receptacles = []
  for rid in sorted(poses):
    parts = rid.split("|")
    cls = parts[4] if len(parts) == 5 else parts[0]  # "Sink|x|y|z|SinkBasin": the basin is the receptacle
    x, z, rotation, horizon = poses[rid]
    receptacles.append((rid, cls, _loc(x, z, int(rotation), int(horizon))))
  return classes, tuple(receptacles)


def _scene_numbers(split: str, task_type: str) -> list[int]:
  c = _constants()
  numbers = c.TRAIN_SCENE_NUMBERS if split == "train" else c.TEST_SCENE_NUMBERS
  rooms = c.GOALS_VALID[task_type]
  return sorted(n for n in numbers if any(n in c.SCENE_TYPE[room] for room in rooms))


# ---------------------------------------------------------------------------------------------------------------------
# Candidates


class _Invalid(Exception):
  """This candidate cannot hold a valid task; the caller tries the next attempt."""


def _candidate(split: str, task_type: str, seed: int, attempt: int) -> dict:
  c = _constants()
  rng = random.Random(f"dreamjax-alfworld/{GENERATOR_VERSION}/{split}/{task_type}/{seed}/{attempt}")
  scene = rng.choice(_scene_numbers(split, task_type))
  classes, posed = _scene(scene)
  fixed = set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)

  # Receptacles: the posed ones, plus one synthesized instance per receptacle class the scene lists without a pose.
  receptacles = list(posed)
  known = {cls for _, cls, _ in posed}
  locations = sorted({loc for _, _, loc in posed})
  xs = [int(loc.split("|")[1]) for loc in locations] or [0]
  zs = [int(loc.split("|")[2]) for loc in locations] or [0]
  for cls in sorted(set(classes) & fixed - known):
    if cls not in c.VAL_RECEPTACLE_OBJECTS:
      continue
    for _ in range(rng.choice((2, 4)) if cls == "StoveBurner" else 1):
      x, z = rng.randint(min(xs), max(xs)), rng.randint(min(zs), max(zs))
      rid = f"{cls}|{_coord(x * 0.25)}|{_coord(rng.uniform(0.0, 1.0))}|{_coord(z * 0.25)}"
      receptacles.append((rid, cls, f"loc|{x}|{z}|{rng.randrange(4)}|{rng.choice((30, 45, 60))}"))
  receptacles.sort()
  by_class: dict[str, list[str]] = {}
  for rid, cls, _ in receptacles:
    by_class.setdefault(cls, []).append(rid)
  where = {rid: loc for rid, _, loc in receptacles}

  # Object classes: those of the scene some receptacle here can hold, and lamps, which stand on table-like furniture.
  holders = {o: sorted(r for r in by_class if o in c.VAL_RECEPTACLE_OBJECTS[r]) for o in classes}
  for lamp in ("DeskLamp", "FloorLamp"):
    holders[lamp] = sorted(r for r in by_class if r in _LAMP_PARENTS)
  objects = sorted(o for o in classes if o not in fixed and holders.get(o) and not o.endswith("Sliced"))
  pickupable = [o for o in objects if o not in ("DeskLamp", "FloorLamp")]

  # The goal: classes first, so that counts and placements can be made to fit it.
  params = {"object_target": "", "parent_target": "", "toggle_target": "", "mrecep_target": "", "object_sliced": False}
  if task_type == "look_at_obj_in_light":
    lamps = [o for o in objects if o in ("DeskLamp", "FloorLamp")]
    if not lamps or not pickupable:
      raise _Invalid(f"FloorPlan{scene}: no lamp or nothing to pick up")
    params["toggle_target"] = rng.choice(lamps)
    params["object_target"] = rng.choice(pickupable)
  else:
    need = _NEEDS.get(task_type)
    tools = _TOOL.get(task_type, ())
    if tools and not any(t in by_class for t in tools):
      raise _Invalid(f"FloorPlan{scene}: no {' or '.join(tools)} for {task_type}")
    pairs = [(o, r) for o in pickupable for r in holders[o]
             if r not in tools and (need is None or o in c.VAL_ACTION_OBJECTS[need])
             and any(h != r for h in holders[o])]  # an instance must start outside every receptacle of the goal's class
    if not pairs:
      raise _Invalid(f"FloorPlan{scene}: no object/receptacle pair for {task_type}")
    params["object_target"], params["parent_target"] = rng.choice(pairs)

  # Instances and placements: up to ALFRED's MAX_NUM_OF_OBJ_INSTANCES of a class, mostly one, as in ALFWorld's rooms
  # (each instance more makes every reset slower: textworld grounds the PDDL task anew). Pick-two needs two.
  target, parent = params["object_target"], params["parent_target"]
  placed: list[tuple[str, str, str]] = []  # (object id, class, receptacle id)
  ids: set[str] = set()
  counts = list(range(1, c.MAX_NUM_OF_OBJ_INSTANCES + 1))
  for cls in objects:
    count = rng.choices(counts, weights=[2 ** -k for k in range(len(counts))])[0]
    if cls == target and task_type == "pick_two_obj_and_place":
      count = max(count, 2)
    if cls in ("DeskLamp", "FloorLamp"):
      count = 1
    for _ in range(count):
      choices = [r for r in holders[cls] if not (cls == target and r == parent)]  # not satisfied from the start
      rid = rng.choice(by_class[rng.choice(choices)])
      _, rx, ry, rz = rid.split("|")[:4]
      while True:
        oid = (f"{cls}|{_coord(float(rx) + rng.uniform(-0.3, 0.3))}|{_coord(float(ry) + rng.uniform(0.0, 0.2))}|"
               f"{_coord(float(rz) + rng.uniform(-0.3, 0.3))}")
        if oid not in ids:
          break
      ids.add(oid)
      placed.append((oid, cls, rid))
  placed.sort()

  # The agent starts in the open, away from every receptacle (the intro then lists the whole room, as ALFWorld's does).
  taken = {tuple(loc.split("|")[1:3]) for loc in where.values()}
  free = [(x, z) for x in range(min(xs), max(xs) + 1) for z in range(min(zs), max(zs) + 1)
          if (str(x), str(z)) not in taken]
  if not free:
    raise _Invalid(f"FloorPlan{scene}: no free cell to start from")
  x, z = rng.choice(free)
  start = f"loc|{x}|{z}|{rng.randrange(4)}|30"
  template = rng.choice(_goal_library()[task_type]["templates"])
  return {"split": split, "task_type": task_type, "seed": seed, "attempt": attempt, "scene": scene,
          "params": params, "receptacles": receptacles, "objects": placed, "start": start, "template": template}


@lru_cache(maxsize=None)
def _goal_library() -> dict:
  from alfworld.gen import goal_library

  return goal_library.gdict


def goal_text(task_type: str, params: dict, template: str) -> str:
  """ALFWorld's templated goal (alfworld.agents.utils.misc.get_templated_task_desc, without its global RNG)."""
  return template.format(obj=params["object_target"].lower(), recep=params["parent_target"].lower(),
                         toggle=params["toggle_target"].lower(), mrecep=params["mrecep_target"].lower())


def _problem(spec: dict) -> str:
  """The PDDL problem in the layout ALFRED's PlannedGameState.state_to_pddl writes (ids mangled the same way)."""
  c = _constants()
  fixed = set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)
  receptacles, objects = spec["receptacles"], spec["objects"]
  rclasses = sorted({cls for _, cls, _ in receptacles})
  oclasses = sorted({cls for _, cls, _ in objects})
  locations = sorted({loc for _, _, loc in receptacles} | {spec["start"]})
  fridge_ids = {rid for rid, cls, _ in receptacles if cls == "Fridge"}
  toggle = spec["params"]["toggle_target"]

  decl = ["agent1 - agent"]
  decl += [f"{o}Type - otype" for o in sorted(set(c.OBJECTS) - fixed)]
  decl += [f"{r}Type - rtype" for r in sorted(fixed)]
  decl += [f"{_mangle(oid)} - object" for oid, _, _ in objects]
  decl += [f"{_mangle(rid)} - receptacle" for rid, _, _ in receptacles]
  decl += [f"{_mangle(loc)} - location" for loc in locations]

  init = [f"(atLocation agent1 {_mangle(spec['start'])})"]
  for rid, cls, loc in receptacles:
    init.append(f"(receptacleType {_mangle(rid)} {cls}Type)")
    init.append(f"(receptacleAtLocation {_mangle(rid)} {_mangle(loc)})")
    if cls in c.OPENABLE_CLASS_SET:
      init.append(f"(openable {_mangle(rid)})")
  for r in rclasses:
    init += [f"(canContain {r}Type {o}Type)" for o in oclasses if o in c.VAL_RECEPTACLE_OBJECTS.get(r, ())]
  for oid, cls, rid in objects:
    m = _mangle(oid)
    init.append(f"(objectType {m} {cls}Type)")
    init.append(f"(inReceptacle {m} {_mangle(rid)})")
    if cls in ("DeskLamp", "FloorLamp"):
      if cls == toggle:
        init.append(f"(toggleable {m})")
      continue
    init.append(f"(pickupable {m})")
    if cls in c.MOVABLE_RECEPTACLES_SET:
      init.append(f"(isReceptacleObject {m})")
    for fact, group in (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                        ("sliceable", "Sliceable")):
      if cls in c.VAL_ACTION_OBJECTS[group]:
        init.append(f"({fact} {m})")
    if rid in fridge_ids:
      init.append(f"(isCool {m})")  # ALFRED marks what starts in a fridge as already cool

  p = spec["params"]
  goal = _goal_library()[spec["task_type"]]["pddl"].format(
      obj=p["object_target"], recep=p["parent_target"], toggle=p["toggle_target"], mrecep=p["mrecep_target"])
  goal = goal.replace("#", "-")  # goal_library writes ALFRED's "?x # type"
  name = f"dreamjax_{spec['split']}_{spec['task_type']}_{spec['seed']}"
  indent = "\n        "
  return (f"(define (problem {name})\n    (:domain alfred)\n    (:objects{indent}{indent.join(decl)}\n    )\n"
          f"    (:init{indent}{indent.join(init)}\n    )\n{goal.strip()}\n")


# ---------------------------------------------------------------------------------------------------------------------
# Planner: textworld's PDDL planner (fast-downward) in a worker process, so a slow search can be cut off by a deadline.
#
# Planning on a whole game is slow (measured: a minute for a pick_two game in a kitchen with 54 receptacles and 56
# objects; 0.2 s on its relevant part, 2 objects and 3 receptacles). The worker plans on the goal-relevant part of the
# state instead, as ALFRED's own generator does: objects of the goal's classes and whatever the agent holds, the
# receptacles holding them, those of the goal's receptacle and tool classes, and their locations. Every action's
# preconditions only mention its own arguments, and no precondition is negative on another object, so a plan of the
# part is a plan of the whole; new games are replayed in the whole game to make sure. Only when the part has no plan
# does the expert search the whole game.


class PlannerError(RuntimeError):
  """The planner found no plan, or its worker died."""


class PlannerTimeout(PlannerError):
  """No plan within the deadline: an outcome of the machine's speed, so never a reason to change a generated game."""


def keep_types(task_type: str, params: dict) -> tuple[list[str], list[str]]:
  """(object types, receptacle types) the goal of a task involves, in PDDL's lower case."""
  objects = [params[k] for k in ("object_target", "toggle_target") if params.get(k)]
  receptacles = [params["parent_target"]] if params.get("parent_target") else []
  receptacles += list(_TOOL.get(task_type, ()))
  return [f"{o.lower()}type" for o in objects], [f"{r.lower()}type" for r in receptacles]


def _relevant_problem(state, goal: str, otypes: Sequence[str], rtypes: Sequence[str]) -> str:
  """The goal-relevant part of a textworld PddlState, as a PDDL problem (names as fast-downward lower-cased them)."""
  facts = [f for f in state.facts if not f.name.startswith("new-axiom")]
  args = {f: [a.name for a in f.arguments] for f in facts}
  kind = state.name2type
  of_type = {a[0]: a[1] for f, a in args.items() if f.name in ("objecttype", "receptacletype")}
  held = {a[1] for f, a in args.items() if f.name == "holds"}
  objects = {o for o, t in of_type.items() if kind[o] == "object" and t in otypes} | held
  receptacles = {r for r, t in of_type.items() if kind[r] == "receptacle" and t in rtypes}
  receptacles |= {a[1] for f, a in args.items() if f.name == "inreceptacle" and a[0] in objects}
  fits = {(a[0], a[1]) for f, a in args.items() if f.name == "cancontain"}
  for o in held - {o for o in objects if of_type[o] in otypes}:  # something unrelated in hand must go somewhere
    receptacles |= {r for r, t in of_type.items() if kind[r] == "receptacle" and (t, of_type[o]) in fits}
  locations = {a[1] for f, a in args.items() if f.name == "receptacleatlocation" and a[0] in receptacles}
  locations |= {a[1] for f, a in args.items() if f.name == "atlocation"}
  keep = objects | receptacles | locations | {n for n, t in kind.items() if t in ("agent", "otype", "rtype")}
  init = [f"({f.name} {' '.join(a)})" for f, a in args.items() if all(x in keep for x in a)]
  decl = [f"{n} - {kind[n]}" for n in sorted(keep)]
  return (f"(define (problem relevant) (:domain alfred)\n(:objects {' '.join(decl)})\n"
          f"(:init {' '.join(sorted(init))})\n{goal}")


class _Worker:
  """Runs in the planner process: one game loaded at a time, stepped along the histories it is asked about."""

  def __init__(self):
    import fast_downward
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs import PddlEnv

    self.env = AlfredDemangler(shuffle=False)(PddlEnv(textworld.EnvInfos(admissible_commands=True)))
    self.lib = fast_downward.load_lib()  # a second copy: planning on a part must not disturb the loaded game
    self.game, self.history, self.state = None, [], None
    self.search_s = PLAN_TIMEOUT_S

  def _load(self, key: str | None, game) -> None:
    self.game = None
    self.env.load(game)
    self.game = key  # None for a game given inline: the next request about a file loads that file
    self.state, self.history = self.env.reset(), []

  def _follow(self, history: list[str]) -> None:
    if self.history != history[:len(self.history)]:
      self.state, self.history = self.env.reset(), []
    for command in history[len(self.history):]:
      self.state, _, _ = self.env.step(command)
      self.history.append(command)

  def _plan(self, goal: str, otypes, rtypes, whole: bool) -> list[str]:
    from textworld.envs.pddl import logic as pddl_logic

    pddl = self.env._pddl_state  # textworld's PddlEnv keeps its planner state here; the wrapper forwards attributes
    if pddl.check_goal():
      return []
    # The search runs in C and cannot be interrupted from Python: an alarm with its default action ends this process
    # when the search outlives its budget, which the client reads as a timeout.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, self.search_s)
    try:
      part = pddl_logic.PddlState(self.lib, _relevant_problem(pddl, goal, otypes, rtypes), self.env._logic)
      plan = part.replan(self.env._entity_infos) or (pddl.replan(self.env._entity_infos) if whole else [])
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    if not plan:
      raise PlannerError("the planner found no plan")
    return plan

  def solve(self, game: dict, otypes, rtypes) -> list[str]:
    """A walkthrough of a new game, replayed to the win; errors if the goal holds from the start."""
    self._load(None, game)
    if self.state["won"]:
      raise PlannerError("the goal already holds in the initial state")
    # Without a plan for the relevant part the candidate is dropped: a search of the whole game may not end in time.
    plan = self._plan(game["pddl_problem"][game["pddl_problem"].index("(:goal"):], otypes, rtypes, whole=False)
    for command in plan:
      if command not in self.state["admissible_commands"]:
        raise PlannerError(f"plan step {command!r} is not admissible in the game")
      self.state, _, _ = self.env.step(command)
    if not self.state["won"]:
      raise PlannerError("the plan does not win the game")
    return plan

  def plan(self, game_file: str, history: list[str]) -> list[str]:
    """The planner's plan from the state the game reaches after `history` (exact commands, invalid ones included)."""
    if self.game != game_file:
      self._load(game_file, game_file)
    self._follow(history)
    traj = load_traj_data(game_file)
    problem = json.loads(Path(game_file).read_text())["pddl_problem"]
    otypes, rtypes = keep_types(traj["task_type"], traj["pddl_params"])
    return self._plan(problem[problem.index("(:goal"):], otypes, rtypes, whole=True)


def _worker_main() -> None:
  """Serves JSON-line requests on stdin; replies go to the original stdout, everything else printed goes to stderr."""
  import traceback

  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  worker = _Worker()
  for line in sys.stdin:
    request = json.loads(line)
    worker.search_s = float(request["search_s"])
    try:
      if request["op"] == "solve":
        reply = {"ok": True, "plan": worker.solve(request["game"], request["otypes"], request["rtypes"])}
      else:
        reply = {"ok": True, "plan": worker.plan(request["game_file"], request["history"])}
    except Exception as e:  # reported to the caller, which decides; the worker lives on
      worker.game = None  # the loaded game may be half-stepped
      reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


class Planner:
  """Client of one planner worker process (started on first use, restarted after a timeout or a crash)."""

  def __init__(self):
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()

  def _start(self) -> subprocess.Popen:
    if self._proc is None or self._proc.poll() is not None:
      repo = str(Path(__file__).resolve().parents[2])  # so the worker imports this dreamjax, installed or not
      path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
      env = dict(os.environ, ALFWORLD_DATA=str(default_data_dir()), PYTHONPATH=path)
      self._proc = subprocess.Popen([sys.executable, "-m", "dreamjax.envs.alfworld_games", "--planner-worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, env=env)
    return self._proc

  def request(self, request: dict, search_s: float) -> list[str]:
    """One request; `search_s` bounds the search, loading and replaying the game get LOAD_BUDGET_S on top."""
    with self._lock:
      proc = self._start()
      try:
        proc.stdin.write(json.dumps({**request, "search_s": search_s}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], search_s + LOAD_BUDGET_S)
        line = proc.stdout.readline() if ready else ""
      except BrokenPipeError:
        line, ready = "", True
      if not line:
        try:
          alarm = proc.wait(timeout=10) == -signal.SIGALRM if ready else False
        except subprocess.TimeoutExpired:
          alarm = False
        self.close()
        if alarm or not ready:
          raise PlannerTimeout(f"no plan within {search_s:.0f} s of search" if alarm else
                               f"no answer within {search_s + LOAD_BUDGET_S:.0f} s")
        raise PlannerError("the planner worker died")
    reply = json.loads(line)
    if not reply["ok"]:
      raise PlannerError(reply["error"])
    return reply["plan"]

  def solve(self, game: dict, task_type: str, params: dict, search_s: float) -> list[str]:
    otypes, rtypes = keep_types(task_type, params)
    return self.request({"op": "solve", "game": game, "otypes": otypes, "rtypes": rtypes}, search_s)

  def plan(self, game_file: str | os.PathLike, history: Sequence[str], search_s: float) -> list[str]:
    return self.request({"op": "plan", "game_file": str(game_file), "history": list(history)}, search_s)

  def close(self) -> None:
    proc, self._proc = self._proc, None
    if proc is not None:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
      for stream in (proc.stdin, proc.stdout):
        stream.close()


_PLANNER: Planner | None = None


def shared_planner() -> Planner:
  global _PLANNER
  if _PLANNER is None:
    _PLANNER = Planner()
    atexit.register(_PLANNER.close)
  return _PLANNER


# ---------------------------------------------------------------------------------------------------------------------
# Writing and caching


def _traj_data(spec: dict, goal: str) -> dict:
  return {
      "task_id": f"dreamjax_{spec['split']}_{spec['task_type']}_{spec['seed']}",
      "task_type": spec["task_type"],
      "pddl_params": spec["params"],
      "scene": {"floor_plan": f"FloorPlan{spec['scene']}", "scene_num": spec["scene"]},
      "dreamjax": {"generator_version": GENERATOR_VERSION, "split": spec["split"], "seed": spec["seed"],
                   "attempt": spec["attempt"], "goal": goal, "template": spec["template"]},
  }


def game_dir(split: str, task_type: str, seed: int, root: str | os.PathLike | None = None) -> Path:
  return Path(root or default_games_root()) / split / task_type / f"{int(seed):06d}"


def load_traj_data(game_file: str | os.PathLike) -> dict:
  return json.loads((Path(game_file).parent / "traj_data.json").read_text())


def generate_game(split: str, task_type: str, seed: int, root: str | os.PathLike | None = None) -> Path:
  """The game.tw-pddl of (split, task_type, seed), generated on first use and read from the cache after."""
  _check(split, task_type)
  folder = game_dir(split, task_type, seed, root)
  if (folder / "game.tw-pddl").exists():
    return folder / "game.tw-pddl"
  from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

  domain, grammar = Path(ALFRED_PDDL_PATH).read_text(), Path(ALFRED_TWL2_PATH).read_text()
  errors = []
  for attempt in range(MAX_ATTEMPTS):
    try:
      spec = _candidate(split, task_type, int(seed), attempt)
    except _Invalid as e:
      errors.append(str(e))
      continue
    goal = goal_text(task_type, spec["params"], spec["template"])
    problem = _problem(spec)
    game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", goal), "pddl_problem": problem,
            "solvable": None, "walkthrough": None}
    try:
      game["walkthrough"] = shared_planner().solve(game, task_type, spec["params"], PLAN_TIMEOUT_S)
    except PlannerTimeout as e:
      raise RuntimeError(f"alfworld {split}/{task_type}/{seed}: attempt {attempt} not decided: {e}") from e
    except PlannerError as e:
      errors.append(f"attempt {attempt}: {e}")
      continue
    game["solvable"] = True
    return _publish(folder, game, problem, _traj_data(spec, goal))
  raise RuntimeError(f"alfworld {split}/{task_type}/{seed}: no valid game in {MAX_ATTEMPTS} attempts; "
                     f"last reasons: {'; '.join(errors[-3:])}")


def _publish(folder: Path, game: dict, problem: str, traj: dict) -> Path:
  folder.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
  try:
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of a shared ALFWORLD_DATA
    (tmp / "initial_state.pddl").write_text(problem)
    (tmp / "traj_data.json").write_text(json.dumps(traj, indent=2, sort_keys=True) + "\n")
    (tmp / "game.tw-pddl").write_text(json.dumps(game, sort_keys=True) + "\n")
    try:
      tmp.rename(folder)
    except OSError:
      if not (folder / "game.tw-pddl").exists():  # not another worker's finished copy of the same seed
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return folder / "game.tw-pddl"


def generate_games(out_dir: str | os.PathLike | None = None, task_types: Sequence[str] = TASK_TYPES,
                   n_per_type: int = 1, split: str = "train", seed: int = 0) -> list[Path]:
  """game.tw-pddl files for seeds seed..seed+n_per_type-1 of each task type, type-major; cached games are reused."""
  if n_per_type < 0:
    raise ValueError(f"n_per_type must be non-negative, got {n_per_type}")
  return [generate_game(split, t, seed + i, out_dir) for t in task_types for i in range(n_per_type)]


if __name__ == "__main__":
  if sys.argv[1:] != ["--planner-worker"]:
    raise SystemExit("usage: python -m dreamjax.envs.alfworld_games --planner-worker (started by Planner)")
  _worker_main()
