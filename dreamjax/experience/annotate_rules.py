"""Per-env state readers for the rule-based annotators: what an action refers to and what a step changed.

Each env's rules answer three questions from the abstract states alone (so the reasons stay true of the record):
- `admissible(action, admissible)`: is the action in the step's admissible list (env-specific matching);
- `preconditions(state, action)`: where each object, exit or page element the action names is, before acting;
- `refusal(state, action)`: what in the state stops an action the env refused (an item already held, a door
  already open, an object the state does not show);
- `effects(state, next_state)`: what changed: location, objects appearing, disappearing or changing, doors and exits,
  inventory, page elements, the env's feedback or error.
Text envs (TextWorld-Express, ALFWorld) share one reader of their "Field: value" states; the web reader parses
`[id] type: description` element lines (dreamjax/envs/web_state.py). Nothing here starts an env; the annotator that
composes these into reasons and tutorials is `dreamjax.experience.annotate.RuleAnnotator`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from dreamjax.envs import alfworld, web_state
from dreamjax.envs import textworld_express as twx
from dreamjax.envs.base import normalize_action
from dreamjax.experience.format import clip

_ITEM = re.compile(r"^(.*?) \((.*)\)$")


def quote(text: str, n: int = 160) -> str:
  """`text` on one line, clipped, in double quotes."""
  return '"' + clip(" ".join(text.split()), n) + '"'


def _names(items: Iterable[str], n: int = 5) -> str:
  items = list(items)
  shown = ", ".join(items[:n])
  return shown + (f" and {len(items) - n} more" if len(items) > n else "")


# --- text states ("Field: value" lines) -----------------------------------------------------------------------------


def text_fields(state: str) -> dict[str, str]:
  """Fields of a text-env state by base name ("Inventory (max 5)" is "Inventory"); other lines are kept under
  "Other", so a malformed state never raises."""
  out: dict[str, str] = {}
  for line in state.splitlines():
    key, sep, value = line.partition(": ")
    base = key.split(" (")[0].strip()
    if sep and base and base[0].isupper() and len(base) < 24:
      out[base] = value.strip()
    elif line.strip():
      out["Other"] = (out.get("Other", "") + " " + line.strip()).strip()
  return out


def split_items(value: str) -> list[str]:
  """A comma list whose items may hold parenthesised comma lists: "fridge (open: egg, milk), stove"."""
  items, depth, cur = [], 0, ""
  for ch in value:
    if ch == "(":
      depth += 1
    elif ch == ")" and depth:
      depth -= 1
    if ch == "," and depth == 0:
      items.append(cur.strip())
      cur = ""
    else:
      cur += ch
  items.append(cur.strip())
  return [i for i in items if i and i not in ("nothing", "none")]


def _name_detail(item: str) -> tuple[str, str]:
  m = _ITEM.match(item)
  return (m[1], m[2]) if m else (item, "")


def _contents(detail: str) -> tuple[str, list[str]]:
  """("in"|"on", items) of a container's detail: "open: egg, milk" holds things in, "knife, pot" on it."""
  if detail.startswith("open:"):
    return "in", split_items(detail[5:])
  if detail in ("closed", "empty", "open, empty", "open", ""):
    return "in", []
  return "on", split_items(detail)


def text_objects(fields: Mapping[str, str], at: str = "in") -> dict[str, str]:
  """Where each object of a text state is, by name: "in the inventory", "here in the kitchen", "in the fridge";
  `at` is how the agent's location is said ("in the kitchen", "at the fridge 1")."""
  location = _name_detail(fields.get("Location", "unknown"))[0]
  at = "in" if location.startswith("middle of") else at  # ALFWorld's "middle of the room"
  where: dict[str, str] = {location: "where the agent is"}
  for item in split_items(fields.get("You see", "")):
    name, detail = _name_detail(item)
    where[name] = f"here {at} the {location}" + (f" ({detail})" if detail else "")
    prep, inside = _contents(detail)
    for thing in inside:
      where.setdefault(thing, f"{prep} the {name}")
  for item in split_items(fields.get("Inventory", "")):
    where[_name_detail(item)[0]] = "in the inventory"
  return where


def _mentions(action: str, names: Iterable[str]) -> list[str]:
  """Names occurring in the action as whole words, longest first, without overlaps."""
  text, found, taken = action.lower(), [], []
  for name in sorted(set(names), key=len, reverse=True):
    for m in re.finditer(rf"(?<![\w-]){re.escape(name.lower())}(?![\w-])", text):
      if not any(a < m.end() and m.start() < b for a, b in taken):
        taken.append((m.start(), m.end()))
        found.append(name)
        break
  return found


def _exits(value: str) -> dict[str, str]:
  return {e.split(" ")[0]: e for e in split_items(value)}


class TextRules:
  """TextWorld-Express and ALFWorld: locations, objects, containers, exits and inventory as "Field: value" lines."""

  def __init__(self, env: str, at: str, failure_modes: str):
    self.env, self.at, self.failure_modes = env, at, failure_modes

  def admissible(self, action: str, admissible: tuple[str, ...]) -> bool:
    return normalize_action(action) in {normalize_action(a) for a in admissible}

  def preconditions(self, state: str, action: str) -> list[str]:
    fields = text_fields(state)
    where = text_objects(fields, self.at)
    seen = [f"the {name} {where[name]}" for name in _mentions(action, where)]
    exits = _exits(fields.get("Exits", ""))
    seen += [f"the exit {exits[d]}" for d in _mentions(action, exits)]
    if self.env == "alfworld":  # every ALFWorld object and receptacle name ends with its number
      seen += [f"the {name} not in the current view" for name in re.findall(r"\b[a-z]+ \d+\b", action.lower())
               if name not in where]
    return [f"Before acting, the state shows {'; '.join(seen)}."] if seen else []

  def refusal(self, state: str, action: str) -> list[str]:
    """What in the state stops `action` (take, put, open, close, move), for a step the env refused: the reason then
    rests on the state, which M_exp sees in DreamGym too, not only on the admissible list, which there is its own."""
    fields = text_fields(state)
    where = {n.lower(): (n, w) for n, w in text_objects(fields, self.at).items()}  # actions may be lower-cased
    status = {n.lower(): d for n, d in map(_name_detail, split_items(fields.get("You see", "")))}

    def name(x: str) -> str:
      return where[x][0] if x in where else x

    a = " ".join(action.lower().split())
    out: list[str] = []
    if m := re.fullmatch(r"take (.+?)(?: from (.+))?", a):
      held = where.get(m[1], ("", ""))[1] == "in the inventory"
      out.append(f"The {name(m[1])} is already in the inventory." if held else "")
      missing = [m[1]]
    elif m := re.fullmatch(r"(?:put|move) (.+?) (?:in|on|into|to) (.+)", a):
      if where.get(m[1], ("", ""))[1] != "in the inventory":
        out.append(f"The {name(m[1])} is not in the inventory" + (f": it is {where[m[1]][1]}." if m[1] in where else "."))
      out.append(f"The {name(m[2])} is closed." if status.get(m[2], "").startswith("closed") else "")
      missing = [m[1], m[2]]
    elif m := re.fullmatch(r"(open|close) (.+)", a):
      now = next((w for w in ("open", "closed") if status.get(m[2], "").startswith(w)), "")
      needed = "closed" if m[1] == "open" else "open"
      if m[2] in where and now != needed:
        out.append(f"The {name(m[2])} is already {now}." if now else
                   f"The state does not show the {name(m[2])} as {needed}.")
      missing = [m[2]]
    elif m := re.fullmatch(r"(?:move|go) (north|south|east|west|up|down)", a):
      out.append("" if m[1] in _exits(fields.get("Exits", "")) else f"There is no exit {m[1]}.")
      missing = []
    else:
      missing = []
    out += [f"The state shows no {x}." for x in missing if x not in where]
    return [x for x in out if x]

  def effects(self, state: str, next_state: str) -> list[str]:
    b, a = text_fields(state), text_fields(next_state)
    if state == next_state:
      return self._feedback(b, a)
    out: list[str] = []
    (b_loc, b_status), (a_loc, a_status) = _name_detail(b.get("Location", "")), _name_detail(a.get("Location", ""))
    moved = b_loc != a_loc
    if moved:
      seen = clip(a.get("You see", "nothing"), 300)
      out.append(f"The agent goes from the {b_loc} to the {a_loc}, where it sees {seen}.")
    elif b_status != a_status:
      out.append(f"The {a_loc} is now {a_status or 'no longer ' + b_status}.")
    b_inv = [_name_detail(i)[0] for i in split_items(b.get("Inventory", ""))]
    a_inv = [_name_detail(i)[0] for i in split_items(a.get("Inventory", ""))]
    b_where, a_where = text_objects(b, self.at), text_objects(a, self.at)
    for item in [i for i in a_inv if i not in b_inv]:
      came = b_where.get(item)
      out.append(f"The inventory gains the {item}" + (f", taken from {came}." if came else "."))
    for item in [i for i in b_inv if i not in a_inv]:
      now = a_where.get(item)
      out.append(f"The inventory loses the {item}" + (f", now {now}." if now else "."))
    if not moved:
      before = dict(_name_detail(i) for i in split_items(b.get("You see", "")))
      after = dict(_name_detail(i) for i in split_items(a.get("You see", "")))
      carried = set(a_inv) | set(b_inv)
      appeared = [n for n in after if n not in before and n not in carried]
      gone = [n for n in before if n not in after and n not in carried]
      if appeared:
        out.append(f"Now in view: {_names(appeared)}.")
      if gone:
        out.append(f"No longer in view: {_names(gone)}.")
      for n in [n for n in after if n in before and before[n] != after[n]][:4]:
        out.append(f"The {n} changes from ({before[n] or 'plain'}) to ({after[n] or 'plain'}).")
      b_exits, a_exits = _exits(b.get("Exits", "")), _exits(a.get("Exits", ""))
      for d in [d for d in a_exits if b_exits.get(d) not in (None, a_exits[d])]:
        out.append(f"The exit {d} changes from '{b_exits[d]}' to '{a_exits[d]}'.")
    else:
      out.append(f"Exits there: {a.get('Exits')}." if a.get("Exits") else "")
    if a.get("Notes") and a.get("Notes") != b.get("Notes"):
      out.append(f"Notes: {quote(a['Notes'])}.")
    return [s for s in out + self._feedback(b, a) if s]

  def _feedback(self, b: Mapping[str, str], a: Mapping[str, str]) -> list[str]:
    feedback = a.get("Feedback", "")
    if feedback:
      again = " again" if feedback == b.get("Feedback") else ""
      return [f"The game replies{again} {quote(feedback, 240)}."]
    if b.get("Feedback"):
      return ["There is no feedback line this time: the step's text only repeats what the state shows."]
    return []

  def headline(self, state: str) -> str:
    return text_fields(state).get("Feedback", "")


# --- web states ("[id] type: description" lines) --------------------------------------------------------------------


def web_fields(state: str) -> tuple[dict[str, str], dict[str, str]]:
  """(header fields: Goal, Page, Error; elements by id) of a web state; unknown lines are ignored."""
  head: dict[str, str] = {}
  elements: dict[str, str] = {}
  for line in state.splitlines():
    m = re.match(r"^\[([^\]]+)\] (.*)$", line)
    if m:
      elements[m[1]] = m[2]
    else:
      key, sep, value = line.partition(": ")
      if sep and key in ("Goal", "Page", "Error"):
        head[key] = value
  return head, elements


class WebRules:
  """MiniWoB (and other BrowserGym pages) in the abstract web state of dreamjax.envs.web_state."""

  env = "miniwob"
  failure_modes = ("An action that does not parse, names a missing element or fails in the browser changes nothing "
                   "and adds an Error line to the state. The episode ends with reward 0 when the page's task ends "
                   "unsuccessfully or when the step limit is reached.")

  def admissible(self, action: str, admissible: tuple[str, ...]) -> bool:
    return web_state.is_admissible(action, admissible)

  def preconditions(self, state: str, action: str) -> list[str]:
    _, elements = web_fields(state)
    try:
      parsed = web_state.parse_action(action)
    except web_state.ActionError as e:
      return [f"The action is not a call of the action language: {e}."]
    if parsed.bid is None:
      return []
    element = elements.get(parsed.bid)
    if element is None:
      return [f"There is no element [{parsed.bid}] on the page."]
    out = [f"Element [{parsed.bid}] is the {clip(element, 120)}."]
    if parsed.name == "fill" and len(parsed.args) > 1:
      out.append(f"It types {parsed.args[1]!r} into it.")
    elif parsed.name == "select_option" and len(parsed.args) > 1:
      listed = f"'{parsed.args[1]}'" in element or f" {parsed.args[1]} " in f" {element} "
      out.append(f"The option {parsed.args[1]!r} is " + ("one of its options." if listed else "not listed in it."))
    return out

  def refusal(self, state: str, action: str) -> list[str]:
    return []  # preconditions already name a missing element or an unparseable call

  def effects(self, state: str, next_state: str) -> list[str]:
    (bh, be), (ah, ae) = web_fields(state), web_fields(next_state)
    out: list[str] = []
    if state == next_state:
      return out
    if bh.get("Page") != ah.get("Page"):
      out.append(f"The page changes from {quote(bh.get('Page', ''), 80)} to {quote(ah.get('Page', ''), 80)}.")
    added = [f"[{k}] {clip(v, 60)}" for k, v in ae.items() if k not in be]
    removed = [f"[{k}] {clip(v, 60)}" for k, v in be.items() if k not in ae]
    changed = [k for k in ae if k in be and ae[k] != be[k]]
    if added:
      out.append(f"New on the page: {_names(added, 4)}.")
    if removed:
      out.append(f"Gone from the page: {_names(removed, 4)}.")
    for k in changed[:4]:
      out.append(f"Element [{k}] changes from {quote(be[k], 80)} to {quote(ae[k], 80)}.")
    if ah.get("Error"):
      out.append(f"The browser reports an error: {quote(ah['Error'], 200)}.")
    elif bh.get("Error"):
      out.append("The earlier error line is gone: this action ran without error.")
    return out

  def headline(self, state: str) -> str:
    head, _ = web_fields(state)
    return f"Page: {head['Page']}" if "Page" in head else ""


RULES = {
    "textworld_express": lambda: TextRules(
        "textworld_express", "in",
        f"An action outside the admissible list is answered with \"{twx.INVALID_FEEDBACK}\" and changes nothing."
        " The episode ends with reward 0 when the step limit is reached, or when the game's own "
        "failure condition triggers (in cookingworld, e.g. eating or cooking the wrong thing)."),
    "alfworld": lambda: TextRules(
        "alfworld", "at",
        f"An action outside the admissible list is answered with \"{alfworld.INVALID_FEEDBACK}\" and changes nothing. "
        "The episode ends with reward 0 when the step limit is reached."),
    "miniwob": WebRules,
}


def line_diff(state: str, next_state: str) -> list[str]:
  """For a change no env rule describes: which lines go and which come, which is still true."""
  before, after = state.splitlines(), next_state.splitlines()
  gone = [quote(line, 80) for line in before if line not in after]
  new = [quote(line, 80) for line in after if line not in before]
  out = [f"Lines removed: {_names(gone, 3)}." if gone else "", f"Lines added: {_names(new, 3)}." if new else ""]
  return [x for x in out if x]
