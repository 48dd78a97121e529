"""WebShop (Yao et al. 2022) behind the Env protocol, for users who run the official WebShop environment.

UNTESTED HERE: this adapter cannot be exercised offline on these machines. It needs `web_agent_site` from
github.com/princeton-nlp/WebShop, set up with its product catalogue, goals and search index (its setup.sh downloads
them); the `webshop` package on PyPI is a stub that ships none of this. Only the pure parsing and mapping helpers
below are tested (on a hand-written example of WebShop's text format). The adapter follows WebShop's documented
text-environment API: `WebAgentTextEnv(observation_mode="text", num_products=..., human_goals=...)`,
`reset(session=<goal index>)`, `step("search[...]" | "click[...]") -> (obs, reward, done, info)`,
`get_available_actions() -> {"has_search_bar": bool, "clickables": [...]}`, `get_instruction_text()`.

Reward: WebShop's step reward is 0 until "Buy Now", then the purchase score in [0, 1] (attribute, option, price and
type match). WebShop and the paper count success as score == 1 (the "SR" column), and the paper's rewards are binary,
so reward is 1.0 exactly when the episode ends with score 1.0; the raw score stays in `info["score"]`.
Splits follow WebShop's convention over its (fixed-shuffled) goal list: test = goals 0-499, eval = 500-1499,
train = 1500 onwards. WebShop treats a malformed or unavailable action as a no-op; we flag it `invalid=True` and do
not send it. There is no privileged expert: WebShop's human demonstrations are a dataset, so expert_action() is None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from dreamjax.envs.base import Observation, StepResult, Task
from dreamjax.envs.web_state import TEXT_SLOT, Element

SPLIT_GOALS = {"test": 0, "eval": 500, "train": 1500}
MISSING_WEBSHOP = (
    "WebShopEnv needs the official WebShop environment: the `web_agent_site` package from "
    "https://github.com/princeton-nlp/WebShop, installed with its product data, goals and search index (its "
    "setup.sh). The `webshop` package on PyPI is a stub without them, and nothing here can download them: WebShop "
    "cannot be exercised offline on this machine, and this adapter is untested here. Use the 'miniwob' env instead.")
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.+)\]\s*$", re.DOTALL)
_ASIN = re.compile(r"^[A-Z0-9]{10}$")
_SEP = " [SEP] "


class WebShopActionError(ValueError):
  pass


def parse_webshop_action(text: str) -> tuple[str, str]:
  """`search[red shoes]` -> ("search", "red shoes"); `click[Buy Now]` -> ("click", "buy now") (WebShop lowercases
  click targets before matching them)."""
  m = _ACTION.match(text)
  if m is None or not m.group(2).strip():
    raise WebShopActionError(f"not a WebShop action: {text.strip()[:80]!r}; expected search[...] or click[...]")
  name, arg = m.group(1), m.group(2).strip()
  return name, (arg.lower() if name == "click" else arg)


def webshop_admissible(available: Mapping[str, Any]) -> tuple[str, ...]:
  """WebShop's available actions as templates: `search[<text>]` when the page has a search bar, one click each."""
  actions = [f"search[{TEXT_SLOT}]"] if available.get("has_search_bar") else []
  # The search button is a clickable too, but WebShop ignores click[search]; searching is search[...].
  actions += [f"click[{c}]" for c in available.get("clickables", ()) if c != "search"]
  return tuple(actions)


def check_webshop_action(text: str, available: Mapping[str, Any]) -> str:
  """The action in canonical form if the current page allows it; WebShopActionError otherwise."""
  name, arg = parse_webshop_action(text)
  if name == "search":
    if not available.get("has_search_bar"):
      raise WebShopActionError("search[...] is only available on the search page; click[back to search] first")
    return f"search[{arg}]"
  if arg == "search" or arg not in available.get("clickables", ()):
    raise WebShopActionError(f"click[{arg}]: no such button, product or option on this page")
  return f"click[{arg}]"


def split_instruction(text: str) -> tuple[str, list[str]]:
  """WebShop's text observation (`a [SEP] b [SEP] ...`) as (instruction, the other segments)."""
  segments = [s.strip() for s in text.split("[SEP]")]
  segments = [s for s in segments if s]
  if segments and segments[0] == "WebShop":
    segments = segments[1:]
  instruction = ""
  if "Instruction:" in segments:
    i = segments.index("Instruction:")
    instruction = segments[i + 1] if i + 1 < len(segments) else ""
    segments = segments[:i] + segments[i + 2:]
  return instruction, segments


def webshop_elements(segments: Sequence[str], clickables: Sequence[str]) -> list[Element]:
  """Segments as `[click target] type: description` elements: products (an ASIN, then its title and price),
  options (with the group name that precedes them), buttons, and plain text."""
  clickable = set(clickables) - {"search"}
  out: list[Element] = []
  group = ""
  i = 0
  while i < len(segments):
    seg, key = segments[i], segments[i].lower()
    if key in clickable and _ASIN.match(seg):
      title = price = ""
      j = i + 1
      if j < len(segments) and segments[j].lower() not in clickable:
        title, j = segments[j], j + 1
        if j < len(segments) and segments[j].startswith("$"):
          price, j = segments[j], j + 1
      out.append(Element(key, "product", f"{title} | {price}" if price else title))
      i = j
      continue
    if seg in clickable and seg == key and group:  # option values are matched verbatim, after their group name
      out.append(Element(key, "option", f"{group}: {seg}"))
    elif key in clickable:
      out.append(Element(key, "button", seg))
      group = ""
    else:
      next_is_option = i + 1 < len(segments) and segments[i + 1] in clickable  # buttons are capitalised
      group = seg if next_is_option and len(seg) <= 40 else ""
      out.append(Element("-", "text", seg, actionable=False))
    i += 1
  return out


def page_name(url: str | None) -> str:
  for name in ("search_results", "item_sub_page", "item_page", "done"):
    if url and f"/{name}/" in url:
      return name.replace("_", " ")
  return "search"


def webshop_state(instruction: str, page: str, elements: Sequence[Element], error: str = "") -> str:
  lines = [f"Goal: {instruction}", f"Page: {page}"] + [e.render(max_chars=120) for e in elements]
  if error:
    lines.append(f"Error: {error}")
  return "\n".join(lines)


def outcome(score: float, done: bool) -> tuple[float, bool]:
  """(reward, success): success only for a purchase with full score, as WebShop's success rate counts it."""
  success = bool(done and score >= 1.0 - 1e-9)
  return (1.0 if success else 0.0), success


def tasks(split: str = "train", n: int = 10, start: int = 0) -> list[Task]:
  if split not in SPLIT_GOALS:
    raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLIT_GOALS)}")
  return [Task.make("webshop", f"webshop/{split}/{i}", session=SPLIT_GOALS[split] + i, split=split)
          for i in range(start, start + n)]


class WebShopEnv:
  name = "webshop"

  def __init__(self, num_products: int | None = None, human_goals: bool = True, max_steps: int = 15,
               invalid_ends_episode: bool = False, **webshop_kwargs: Any):
    try:
      from web_agent_site.envs import WebAgentTextEnv
    except ImportError as e:
      raise ImportError(MISSING_WEBSHOP) from e
    self.max_steps = max_steps
    self.invalid_ends_episode = invalid_ends_episode
    self._env = WebAgentTextEnv(observation_mode="text", num_products=num_products, human_goals=human_goals,
                                **webshop_kwargs)
    self._instruction, self._obs, self._steps, self._done = "", "", 0, True

  def reset(self, task: Task) -> Observation:
    if task.env != self.name:
      raise ValueError(f"webshop: task {task.task_id!r} is for env {task.env!r}")
    obs, _ = self._env.reset(session=int(task.param["session"]))
    instruction = self._env.get_instruction_text()
    self._instruction = instruction.removeprefix("Instruction:").strip()
    self._obs, self._steps, self._done = obs, 0, False
    return self._observation()

  def step(self, action: str) -> StepResult:
    if self._done:
      raise RuntimeError("webshop: step() after the episode ended; call reset()")
    self._steps += 1
    available = self._env.get_available_actions()
    score, done, error = 0.0, False, ""
    try:
      canonical = check_webshop_action(action, available)
    except WebShopActionError as e:
      canonical, error = action, str(e)
    else:
      self._obs, score, done, _ = self._env.step(canonical)
    reward, success = outcome(float(score or 0.0), bool(done))
    truncated = not done and self._steps >= self.max_steps
    self._done = bool(done) or truncated or (bool(error) and self.invalid_ends_episode)
    info = {"action": canonical, "score": float(score or 0.0), "raw_observation": self._obs, "invalid_reason": error,
            "truncated": truncated, "steps": self._steps, "url": self._env.state.get("url")}
    return StepResult(self._observation(error), reward, self._done, success, bool(error), info)

  def expert_action(self) -> str | None:
    return None  # WebShop has human demonstrations (a dataset), not a privileged expert to query

  def close(self) -> None:
    self._done = True

  tasks = staticmethod(tasks)

  def _observation(self, error: str = "") -> Observation:
    available = self._env.get_available_actions()
    _, segments = split_instruction(self._obs)
    elements = webshop_elements(segments, available.get("clickables", ()))
    state = webshop_state(self._instruction, page_name(self._env.state.get("url")), elements, error)
    return Observation(state, self._instruction, webshop_admissible(available))
