"""A non-privileged exploring expert for TextWorld-Express "find the object" games (coin).

TWX's own expert (`TextWorldExpressEnv.expert_action`) replays the game's gold path, which knows where the coin is
before the agent has seen it: its demonstrations cannot be learned from what an agent observes. `TwxExplorer` acts only
on what the agent has seen: the current `Observation` (its abstract state text, instruction and admissible actions)
and the episode's earlier (observation, action) pairs. It never reads env internals (no gold path, no game object, no
JVM), so it runs in the collector's process on the observations the batch env hands back, and it gives the same
action for the same inputs (it keeps no state between calls and draws no random numbers).

The policy, in order:
1. Take the target ("take coin") when that action is admissible.
2. In the current room, go through an exit whose neighbour is not visited yet: a visible unvisited neighbour first
   ("move <dir>"), else a closed door whose neighbour is unknown ("open door to <dir>", then "move <dir>").
3. Else walk toward the nearest known room that still has such an exit, by breadth-first search over the map it built
   from its own moves and from the exits it has read (opening a closed door on the way).
4. Else (nothing left to explore, or a state it cannot read) None: the caller decides (the collector's random
   "fallback").

The map: rooms are the "Location:" values (TWX names each room once per game); edges come from "Exits:" lines
("north to backyard", "north to backyard (open screen door)", "east (closed wood door)" with the neighbour unknown)
and from moves that changed the location. TWX maps are grids, so an edge A -north-> B also gives B -south-> A.
Directions are tried in the fixed order north, east, south, west.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

from dreamjax.envs.base import Observation, normalize_action, state_line

DIRECTIONS = ("north", "east", "south", "west")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
_TARGET = re.compile(r"\bfind the ([^.]+?)\s*\.", re.I)  # "search the environment and find the coin.  Once ..."
_CLOSED_EXIT = re.compile(r"^(\w+) \(closed [^()]*\)$")  # "east (closed wood door)"
_OPEN_EXIT = re.compile(r"^(\w+) to (.+?)(?: \([^()]*\))?$")  # "north to backyard" / "... (open screen door)"


def state_field(state: str, field: str) -> str | None:
  """The value of a "Field: value" line of an abstract state, None when the state has no such line."""
  return next((value.strip() for key, value in filter(None, map(state_line, state.splitlines())) if key == field),
              None)


def parse_exits(state: str) -> dict[str, tuple[str | None, bool]]:
  """The "Exits:" line as {direction: (neighbour or None when hidden behind a closed door, door closed)}."""
  value = state_field(state, "Exits")
  out: dict[str, tuple[str | None, bool]] = {}
  if not value or value == "none":
    return out
  for item in value.split(", "):
    item = item.strip()
    if m := _CLOSED_EXIT.match(item):
      out[m[1].lower()] = (None, True)
    elif m := _OPEN_EXIT.match(item):
      out[m[1].lower()] = (m[2].strip(), False)
  return out


def reveals(shown: Sequence[str], next_state: str) -> bool:
  """Whether `next_state` shows part of the map that none of the `shown` states (what a model was given: the history
  and the current state) shows: a room none of them is in (its objects and exits) or a room none of them names
  (behind a door just opened, or beyond a room just entered). What it holds follows from the game's hidden map, not
  from anything shown, so no model predicts such a state exactly from its prompt; `dreamjax.experience.fidelity`
  scores these transitions apart from those the prompt determines."""
  def rooms(state: str) -> set[str]:
    return {room for room, _ in parse_exits(state).values() if room}

  visited = {state_field(s, "Location") for s in shown}
  named = visited.union(*map(rooms, shown))
  return state_field(next_state, "Location") not in visited or not rooms(next_state) <= named


def target_of(instruction: str) -> str | None:
  """The object a "find the X ... take it" instruction asks for ("coin"), None for other instructions."""
  m = _TARGET.search(" ".join(instruction.split()))
  return m[1].strip().lower() if m else None


class TwxExplorer:
  """Frontier exploration of a TWX map from observations only; see the module docstring.

  `target` overrides the object read from the instruction ("find the coin" -> "coin"). `act` is a pure function of
  its arguments: call it with the episode's whole history at every step.
  """

  def __init__(self, target: str | None = None):
    self.target = target

  def act(self, observation: Observation, history: Sequence[tuple[Observation, str]] = ()) -> str | None:
    """The next action given the current observation and the episode's earlier (observation, action) pairs, oldest
    first (each observation is the one the action was taken in); None when it has no action to suggest."""
    admissible = {normalize_action(a): a for a in observation.admissible}
    target = self.target or target_of(observation.instruction)
    if target is None:
      return None
    if (take := admissible.get(normalize_action(f"take {target}"))) is not None:
      return take
    here = state_field(observation.state, "Location")
    if here is None or here == "unknown":
      return None

    # The map, from the states seen (latest view of each room wins) and the moves made.
    exits: dict[str, dict[str, tuple[str | None, bool]]] = {}
    edges: dict[str, dict[str, str]] = collections.defaultdict(dict)
    visited: set[str] = set()
    states = [o.state for o, _ in history] + [observation.state]
    actions = [a for _, a in history]
    for i, state in enumerate(states):
      room = state_field(state, "Location")
      if room is None or room == "unknown":
        continue
      visited.add(room)
      exits[room] = parse_exits(state)
      for d, (neighbour, _) in exits[room].items():
        if neighbour is not None:
          _link(edges, room, d, neighbour)
      if i + 1 < len(states):
        words = normalize_action(actions[i]).split()
        after = state_field(states[i + 1], "Location")
        if len(words) == 2 and words[0] == "move" and after not in (None, "unknown", room):
          _link(edges, room, words[1], after)

    def frontier(room: str) -> list[str]:
      """Exits of `room` toward a neighbour not visited yet: visible ones first, then closed doors, each in
      DIRECTIONS order."""
      out = []
      for d, (neighbour, closed) in exits.get(room, {}).items():
        known = neighbour or edges[room].get(d)
        if known is None or known not in visited:
          out.append((closed and known is None, _order(d), d))
      return [d for *_, d in sorted(out)]

    def go(d: str) -> str | None:
      """The action that makes progress through exit `d` of this room: open its door if closed, else move."""
      closed = exits.get(here, {}).get(d, (None, False))[1]
      return admissible.get(f"open door to {d}" if closed else f"move {d}")

    for d in frontier(here):
      if (action := go(d)) is not None:
        return action

    # Breadth-first search to the nearest room with a frontier; the first step of its path.
    first_step: dict[str, str] = {}
    queue = collections.deque()
    for d in sorted(edges[here], key=_order):
      room = edges[here][d]
      if room in visited and room not in first_step and room != here:
        first_step[room] = d
        queue.append(room)
    while queue:
      room = queue.popleft()
      if frontier(room):
        return go(first_step[room])
      for d in sorted(edges[room], key=_order):
        nxt = edges[room][d]
        if nxt in visited and nxt not in first_step and nxt != here:
          first_step[nxt] = first_step[room]
          queue.append(nxt)
    return None


def _link(edges: dict[str, dict[str, str]], room: str, direction: str, neighbour: str) -> None:
  """Records room -direction-> neighbour and, on TWX's grid, the way back (unless something else is known there)."""
  edges[room][direction] = neighbour
  if direction in OPPOSITE:
    edges[neighbour].setdefault(OPPOSITE[direction], room)


def _order(direction: str) -> int:
  return DIRECTIONS.index(direction) if direction in DIRECTIONS else len(DIRECTIONS)
