"""The abstract state of a web page and the action language over it (BrowserGym's high-level actions).

The paper's web state is "a clean list of elements `[id] type: description`" (WebArena: the 3-10 most relevant
actionable elements plus a short description). We build it from BrowserGym's accessibility tree, where every DOM
element carries its BrowserGym id (bid), and from BrowserGym's set-of-marks flag, which marks the elements a click at
their centre actually reaches (so links made of plain spans count and buttons hidden behind a dialog do not):

  Goal: Enter the username "cierra" and the password "11L" into the text fields and press login.
  Page: Login User Task
  [16] textbox: Username (value: "cierra")
  [19] textbox: Password
  [20] button: Login

The same text is what SyntheticEnv predicts, so nothing machine-specific (file:// paths) goes into it. Admissible
actions are derived from the elements: `click('20')` for clickable ones, `fill('16', <text>)` templates for text
inputs (`<text>` stands for any string), `select_option('13', 'Ertha')` for each option of a <select>.
This module needs no browser and no BrowserGym import, so the experience model side can parse and validate actions.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

TEXT_SLOT = "<text>"  # placeholder for free text in admissible templates: fill('15', <text>)

# Roles that are actionable by themselves (BrowserGym's set-of-marks misses some of them, e.g. a <select>, or
# elements scrolled out of view).
INTERACTIVE_ROLES = frozenset({
    "button", "link", "textbox", "searchbox", "checkbox", "radio", "combobox", "listbox", "option", "menuitem",
    "menuitemcheckbox", "menuitemradio", "tab", "switch", "slider", "spinbutton", "treeitem", "Date", "DateTime",
    "InputTime",
})
FILLABLE_ROLES = frozenset({"textbox", "searchbox", "Date", "DateTime", "InputTime", "spinbutton"})
# Roles that say nothing about what an element is; set-of-marks elements with them are shown as "clickable".
VAGUE_ROLES = frozenset({"generic", "none", "LabelText", "Section", "paragraph", "group", "Div", "StaticText"})
TEXT_ROLES = frozenset({"heading", "cell", "columnheader", "rowheader", "listitem", "dialog", "alert", "status"})

# The WebArena-Lite action space of BrowserGym (its "webarena" subset) plus the bid actions MiniWoB pages need.
# Values: (min, max) positional arguments; keyword arguments are accepted by BrowserGym and passed through.
ACTION_ARITY: dict[str, tuple[int, int]] = {
    "click": (1, 3), "dblclick": (1, 3), "fill": (2, 3), "select_option": (2, 2), "press": (2, 2),
    "hover": (1, 1), "focus": (1, 1), "clear": (1, 1), "scroll": (2, 2), "keyboard_press": (1, 1),
    "go_back": (0, 0), "go_forward": (0, 0), "goto": (1, 1), "tab_focus": (1, 1), "new_tab": (0, 0),
    "tab_close": (0, 0), "send_msg_to_user": (1, 1), "report_infeasible": (1, 1), "noop": (0, 1),
}
BID_ACTIONS = frozenset({"click", "dblclick", "fill", "select_option", "press", "hover", "focus", "clear"})


class ActionError(ValueError):
  """An action string that is not one well-formed call of the action space."""


@dataclasses.dataclass(frozen=True)
class Element:
  bid: str
  type: str  # role as shown: button, link, textbox, checkbox, combobox, clickable, text, ...
  description: str
  value: str | None = None
  states: tuple[str, ...] = ()  # checked, unchecked, selected, expanded, collapsed, disabled, focused
  options: tuple[str, ...] = ()  # the options of a <select>
  actionable: bool = True
  fillable: bool = False

  def render(self, max_chars: int = 80) -> str:
    desc = _clip(self.description, max_chars) or "(unlabelled)"
    extras = []
    if self.value is not None and self.value != "":
      extras.append(f'value: "{_clip(self.value, max_chars)}"')
    if self.options:
      extras.append("options: " + " | ".join(_clip(o, 30) for o in self.options[:10])
                    + (" | ..." if len(self.options) > 10 else ""))
    extras.extend(self.states)
    return f"[{self.bid}] {self.type}: {desc}" + (f" ({', '.join(extras)})" if extras else "")


@dataclasses.dataclass(frozen=True)
class WebState:
  goal: str
  title: str
  elements: tuple[Element, ...]
  url: str = ""  # shown only for http(s) pages: file:// paths are machine-specific
  error: str = ""  # the last action's error, shown so the failure is part of the state
  tabs: int = 1
  max_options: int = 20

  @property
  def text(self) -> str:
    lines = [f"Goal: {self.goal}"]
    page = self.title.strip() or "(untitled)"
    if self.url.startswith(("http://", "https://")):
      page += f" ({self.url})"
    if self.tabs > 1:
      page += f" [{self.tabs} tabs open]"
    lines.append(f"Page: {page}")
    lines.extend(e.render() for e in self.elements)
    if self.error:
      lines.append(f"Error: {_clip(self.error.splitlines()[0], 200)}")
    return "\n".join(lines)

  @property
  def admissible(self) -> tuple[str, ...]:
    return admissible_actions(self.elements, self.max_options)

  def find(self, bid: str) -> Element | None:
    return next((e for e in self.elements if e.bid == bid), None)


def _clip(text: str, n: int) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= n else text[: n - 3] + "..."


def _prop(node: Mapping[str, Any], key: str) -> Any:
  for p in node.get("properties", ()):
    if p.get("name") == key:
      return p.get("value", {}).get("value")
  return None


@dataclasses.dataclass
class _Node:
  """A bid-carrying accessibility node with the text that sits directly in it (not inside a child bid node)."""

  bid: str
  role: str
  name: str
  value: str | None
  raw: Mapping[str, Any]
  som: bool
  children: list[_Node] = dataclasses.field(default_factory=list)
  texts: list[str] = dataclasses.field(default_factory=list)
  options: list[str] = dataclasses.field(default_factory=list)
  som_below: bool = False


def _build_tree(axtree: Mapping[str, Any], extra: Mapping[str, Any]) -> _Node | None:
  nodes = axtree.get("nodes") or []
  if not nodes:
    return None
  by_id = {n["nodeId"]: n for n in nodes}
  seen: set[str] = set()
  root = _Node("", "RootWebArea", "", None, nodes[0], False)
  stack = [(nodes[0], root, False)]  # iterative DFS: deep WebArena pages exceed Python's recursion limit
  while stack:
    node, owner, in_select = stack.pop()
    role = node.get("role", {}).get("value", "")
    bid = node.get("browsergym_id")
    name = (node.get("name") or {}).get("value", "") or ""
    here = owner
    if node.get("ignored"):
      pass
    elif in_select and role == "option":
      owner.options.append(name)
      here = _Node("", role, name, None, node, False)  # detached: the option's text is not the select's text
    elif bid and bid not in seen:  # shadow parts (date inputs) repeat their host's bid: keep the host
      seen.add(bid)
      value = (node.get("value") or {}).get("value")
      here = _Node(bid, role, name, None if value is None else str(value), node,
                   bool(extra.get(bid, {}).get("set_of_marks")))
      owner.children.append(here)
    elif role == "StaticText" and name.strip() and owner.role not in FILLABLE_ROLES:
      owner.texts.append(name)
    select = in_select or (here is not owner and role == "combobox")
    for child in reversed(node.get("childIds", ())):
      if child in by_id and child != node["nodeId"]:
        stack.append((by_id[child], here, select))
  _mark_som_below(root)
  return root


def _mark_som_below(root: _Node) -> None:
  order, stack = [], [root]
  while stack:
    n = stack.pop()
    order.append(n)
    stack.extend(n.children)
  for n in reversed(order):  # children before parents
    n.som_below = any(c.som or c.som_below for c in n.children)


def _all_text(n: _Node) -> str:
  parts, stack = [], [n]
  while stack:
    m = stack.pop()
    parts.extend(m.texts)
    stack.extend(reversed(m.children))
  return " ".join(" ".join(parts).split())


def _states(n: _Node, focused_bid: str | None) -> tuple[str, ...]:
  states = []
  checked = _prop(n.raw, "checked")
  if checked is not None:
    states.append({"true": "checked", "false": "unchecked", "mixed": "mixed"}.get(str(checked).lower(), "checked"))
  if _prop(n.raw, "selected") is True and n.role != "option":
    states.append("selected")
  expanded = _prop(n.raw, "expanded")
  if expanded is not None and n.role != "combobox":
    states.append("expanded" if expanded else "collapsed")
  if _prop(n.raw, "disabled"):
    states.append("disabled")
  if _prop(n.raw, "focused") or (focused_bid and n.bid == focused_bid):
    states.append("focused")
  return tuple(states)


def parse_elements(axtree: Mapping[str, Any], extra_properties: Mapping[str, Any] | None = None,
                   focused_bid: str | None = None, include_text: bool = True) -> list[Element]:
  """All actionable elements (and, with include_text, text blocks) of a BrowserGym axtree, in page order."""
  root = _build_tree(axtree, extra_properties or {})
  if root is None:
    return []
  out: list[Element] = []
  stack = [(c, False) for c in reversed(root.children)]
  while stack:
    n, inside = stack.pop()
    actionable = n.som or (n.role in INTERACTIVE_ROLES and not n.som_below)
    if actionable:
      fillable = n.role in FILLABLE_ROLES or (n.role == "combobox" and not n.options)
      desc = n.name.strip() or ("" if fillable else _all_text(n))
      kind = "clickable" if n.role in VAGUE_ROLES else n.role
      if n.role == "textbox" and _prop(n.raw, "multiline"):
        kind = "textarea"
      value = n.value if (fillable or n.role in ("combobox", "slider")) else None
      out.append(Element(n.bid, kind, desc, value, _states(n, focused_bid), tuple(n.options), True, fillable))
    elif not inside and include_text:
      # A <label> wrapping a checkbox repeats the checkbox's name as its own text: drop the repeat.
      named = {c.name.strip() for c in n.children if c.name.strip()}
      texts = [t for t in n.texts if t.strip() not in named]
      if texts:
        kind = n.role if n.role in TEXT_ROLES else "text"
        out.append(Element(n.bid, kind, " ".join(" ".join(texts).split()), actionable=False))
    # Descend into actionable elements too: mid-animation, a set-of-marks header can wrap the real button. Text
    # inside them is already their description.
    stack.extend((c, inside or actionable) for c in reversed(n.children))
  return _attach_labels(out)


def _attach_labels(elements: list[Element]) -> list[Element]:
  """A short text right before an unlabelled input or select is its label (MiniWoB forms use <label> without `for`)."""
  out: list[Element] = []
  for e in elements:
    prev = out[-1] if out else None
    if (e.actionable and not e.description and prev is not None and not prev.actionable
        and len(prev.description) <= 40):
      out[-1] = dataclasses.replace(e, description=prev.description.rstrip(":"))
    else:
      out.append(e)
  return out


def _tokens(text: str) -> set[str]:
  return {t for t in re.findall(r"[a-z0-9]+", text.lower()) if len(t) > 1}


def select_relevant(elements: Sequence[Element], goal: str, max_elements: int | None,
                    max_text: int | None = None) -> list[Element]:
  """The `max_elements` actionable elements (and `max_text` text blocks) most related to the goal, page order kept.

  Relevance is word overlap with the goal, then focus, then page order: a cheap stand-in for the paper's mapping
  prompt that keeps the element the goal names.
  """
  goal_tokens = _tokens(goal)

  def keep(pool: list[tuple[int, Element]], k: int | None) -> set[int]:
    if k is None or len(pool) <= k:
      return {i for i, _ in pool}
    scored = sorted(pool, key=lambda ie: (-len(goal_tokens & _tokens(ie[1].description + " " + (ie[1].value or "")))
                                          - 0.5 * ("focused" in ie[1].states), ie[0]))
    return {i for i, _ in scored[:k]}

  indexed = list(enumerate(elements))
  kept = keep([ie for ie in indexed if ie[1].actionable], max_elements)
  kept |= keep([ie for ie in indexed if not ie[1].actionable], max_text)
  return [e for i, e in indexed if i in kept]


def web_state(obs: Mapping[str, Any], max_elements: int | None = None, max_text: int | None = None,
              include_text: bool = True, max_options: int = 20) -> WebState:
  """The abstract state of a BrowserGym observation (the dict its env returns)."""
  goal = " ".join((obs.get("goal") or "").split())  # one line: multi-part WebArena goals are joined by newlines
  elements = parse_elements(obs.get("axtree_object") or {}, obs.get("extra_element_properties") or {},
                            obs.get("focused_element_bid") or None, include_text)
  if max_elements is not None or max_text is not None:
    elements = select_relevant(elements, goal, max_elements, max_text)
  titles = obs.get("open_pages_titles") or ()
  active = obs.get("active_page_index")
  active = int(active[0]) if active is not None and len(active) else 0
  title = titles[active] if active < len(titles) else ""
  return WebState(goal, title, tuple(elements), obs.get("url") or "", obs.get("last_action_error") or "",
                  max(1, len(titles)), max_options)


def admissible_actions(elements: Sequence[Element], max_options: int = 20) -> tuple[str, ...]:
  actions: list[str] = []
  for e in elements:
    if not e.actionable:
      continue
    if e.options:
      actions.extend(f"select_option({e.bid!r}, {o!r})" for o in e.options[:max_options])
      continue
    actions.append(f"click({e.bid!r})")
    if e.fillable:
      actions.append(f"fill({e.bid!r}, {TEXT_SLOT})")
  return tuple(actions)


# --- the action language -------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Action:
  name: str
  args: tuple[Any, ...]
  kwargs: tuple[tuple[str, Any], ...] = ()

  @property
  def text(self) -> str:
    parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
    return f"{self.name}({', '.join(parts)})"

  @property
  def bid(self) -> str | None:
    return str(self.args[0]) if self.name in BID_ACTIONS and self.args else None


def parse_action(text: str) -> Action:
  """One call of the action space, e.g. `click('13')`, with ids normalised to strings; ActionError otherwise."""
  src = text.strip().strip("`").strip()
  if src.startswith("python\n"):
    src = src[len("python\n"):].strip()
  try:
    tree = ast.parse(src, mode="eval")
  except SyntaxError as e:
    if TEXT_SLOT in src:
      raise ActionError(f"{_clip(text, 80)!r} is a template: replace {TEXT_SLOT} with a quoted string "
                        "(web_state.instantiate does this for random policies)") from None
    raise ActionError(f"not an action call: {_clip(text, 80)!r} ({e.msg})") from None
  call = tree.body
  if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
    raise ActionError(f"not an action call: {_clip(text, 80)!r}; expected e.g. click('13')")
  name = call.func.id
  if name not in ACTION_ARITY:
    raise ActionError(f"unknown action {name!r}; known: {', '.join(ACTION_ARITY)}")
  try:
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = [(k.arg, ast.literal_eval(k.value)) for k in call.keywords]
  except ValueError:
    raise ActionError(f"{name}: arguments must be literals (quoted strings, numbers, lists)") from None
  if any(k is None for k, _ in kwargs):
    raise ActionError(f"{name}: **kwargs are not allowed")
  lo, hi = ACTION_ARITY[name]
  if not lo <= len(args) + len(kwargs) <= hi:
    want = str(lo) if lo == hi else f"{lo} to {hi}"
    raise ActionError(f"{name}() takes {want} argument(s), got {len(args) + len(kwargs)}")
  if name in BID_ACTIONS:
    if not args or not isinstance(args[0], str | int) or isinstance(args[0], bool):
      raise ActionError(f"{name}: the first argument must be an element id like '13'")
    args[0] = str(args[0])
    if name in ("fill", "press") and len(args) > 1 and not isinstance(args[1], str):
      raise ActionError(f"{name}: the second argument must be a quoted string")
  return Action(name, tuple(args), tuple(kwargs))


def normalise_action(text: str) -> str:
  """The canonical spelling of an action (`click(13)` -> `click('13')`); ActionError if it is not one."""
  return parse_action(text).text


def is_admissible(action: str, admissible: Sequence[str]) -> bool:
  """Whether an action matches the admissible list, where `fill('15', <text>)` admits any text for element 15."""
  try:
    parsed = parse_action(action)
  except ActionError:
    return False
  if parsed.text in admissible:
    return True
  if parsed.name == "fill" and len(parsed.args) >= 2 and not parsed.kwargs:
    return f"fill({parsed.args[0]!r}, {TEXT_SLOT})" in admissible
  return False


def instantiate(template: str, rng: random.Random, words: Sequence[str] = ()) -> str:
  """A concrete action from an admissible entry; `<text>` becomes a random word (or one of `words`)."""
  if TEXT_SLOT not in template:
    return template
  if words:
    text = rng.choice(list(words))
  else:
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
  return template.replace(TEXT_SLOT, repr(text))


def sample_admissible(admissible: Sequence[str], rng: random.Random, words: Sequence[str] = ()) -> str:
  """The random policy: uniform over admissible entries, random text for fill templates."""
  if not admissible:
    return "noop()"
  return instantiate(rng.choice(list(admissible)), rng, words)
