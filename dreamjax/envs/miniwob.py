"""BrowserGym behind the Env protocol: MiniWoB++ by default (registry name "miniwob"), WebArena-Lite when served.

Each episode is one BrowserGym task (`browsergym/<benchmark>.<task>`) on Debian's Chromium (see chromium.py). The
agent sees the abstract web state of web_state.py and acts in BrowserGym's high-level action language, restricted
to the WebArena-Lite style set (click, fill, select_option, press, hover, scroll, goto, go_back, tab actions,
send_msg_to_user, report_infeasible, noop). Outcome reward: 1.0 on the step where BrowserGym ends the episode with
a positive reward (for MiniWoB that is "the task's raw reward > 0"), else 0.0. An action that does not parse, names
an unknown action or fails in the browser (BrowserGym's `last_action_error`, e.g. a missing element id) comes back
with `invalid=True` and the error in the state. A browser that died (crashed, killed) is not the agent's doing: `step`
tears it down and raises `BrowserDied`, which the batch envs turn into an env failure (dreamjax.envs.base.ENV_ERROR),
and the next reset launches a new browser. `info` keeps the raw accessibility tree text, BrowserGym's reward and task
info, and the error.

Speed: BrowserGym relaunches two browsers (page and chat) on every reset (about 2 s here). With `reuse_browser`
(default for MiniWoB) later resets keep the browser, its context and the chat, open a fresh page and run the task's
own setup on it (about 0.5 s); this mirrors `BrowserEnv.reset` of browsergym-core 0.14.3 and is used only with that
version. `pre_observation_delay=0` and `slow_mo=0` remove BrowserGym's fixed sleeps (0.5 s and 100 ms per call).

WebArena-Lite (for users who run the WebArena servers; untested here, no servers offline): install
`browsergym-webarena` (and `browsergym-experiments` for the task lists), run `python -c "import nltk;
nltk.download('punkt_tab')"`, export the site URLs BrowserGym reads: WA_SHOPPING, WA_SHOPPING_ADMIN, WA_REDDIT,
WA_GITLAB, WA_WIKIPEDIA, WA_MAP, WA_HOMEPAGE (and OPENAI_API_KEY, which WebArena's llm_fuzzy_match evaluator uses).
Then `BrowserGymEnv(benchmark="webarena", max_elements=10, max_text=3, reuse_browser=False, max_steps=30)` with
tasks from `tasks(ids, split, n, benchmark="webarena")`; the WebArena-Lite ids are the 165 task names of
`browsergym.experiments.benchmark.metadata.utils.task_metadata("webarenalite")` (task `webarena.<id>` is id `<id>`).
WebArena ends an episode when the agent answers with send_msg_to_user(...) or report_infeasible(...).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from dreamjax.envs import miniwob_experts, web_state
from dreamjax.envs.base import Observation, StepResult, Task
from dreamjax.envs.chromium import configure_chromium

SPLIT_SEED_BASE = {"train": 0, "eval": 1_000_000}  # disjoint seed ranges, so eval pages never appear in training
_MIRRORED_BROWSERGYM = "0.14.3"  # the BrowserEnv.reset that _soft_reset mirrors


class BrowserDied(RuntimeError):
  """The episode's browser crashed or was killed: an env failure, not an invalid action."""


def task_names(benchmark: str = "miniwob") -> list[str]:
  """All task names of a BrowserGym benchmark (registers its gym ids as a side effect)."""
  import gymnasium as gym

  importlib.import_module(f"browsergym.{benchmark}")
  prefix = f"browsergym/{benchmark}."
  return sorted(k[len(prefix):] for k in gym.envs.registry if k.startswith(prefix))


def tasks(names: str | Sequence[str], split: str = "train", n: int = 10, start: int = 0,
          benchmark: str = "miniwob", env: str | None = None) -> list[Task]:
  """n tasks per name with deterministic seeds: `train` uses seeds 0.., `eval` 1_000_000..; "experts" = all tasks
  with a scripted expert, "all" = every task of the benchmark."""
  if split not in SPLIT_SEED_BASE:
    raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLIT_SEED_BASE)}")
  if names == "experts":
    names = sorted(miniwob_experts.EXPERTS)
  elif names == "all":
    names = task_names(benchmark)
  elif isinstance(names, str):
    names = [names]
  known = set(task_names(benchmark))
  unknown = [name for name in names if name not in known]
  if unknown:
    raise ValueError(f"unknown {benchmark} task(s) {', '.join(unknown)}; see task_names({benchmark!r})")
  env = env or benchmark
  return [Task.make(env, f"{name}/{split}/{i}", task=name, seed=SPLIT_SEED_BASE[split] + i, split=split)
          for name in names for i in range(start, start + n)]


class _QuietOverride(logging.Filter):
  """BrowserGym warns on every reset that we override the task's slow_mo; we do so on purpose."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Overriding the task's" not in record.getMessage()


_QUIET = _QuietOverride()  # one instance, so envs made one after another do not stack filters


class BrowserGymEnv:
  """One BrowserGym browser, one episode at a time, behind the Env protocol."""

  name = "browsergym"

  def __init__(self, benchmark: str = "miniwob", max_steps: int = 15, max_elements: int | None = None,
               max_text: int | None = None, include_text: bool = True, headless: bool = True,
               pre_observation_delay: float = 0.0, slow_mo: int | None = 0, reuse_browser: bool | None = None,
               invalid_ends_episode: bool = False, strict_admissible: bool = False, screenshots: bool = False,
               chromium_dir: str | None = None, name: str | None = None):
    self.benchmark = benchmark
    self.name = name or (benchmark if type(self) is BrowserGymEnv else self.name)
    self.max_steps = max_steps
    self.state_kwargs = dict(max_elements=max_elements, max_text=max_text, include_text=include_text)
    self.env_kwargs = dict(headless=headless, pre_observation_delay=pre_observation_delay, slow_mo=slow_mo)
    self.reuse_browser = (benchmark == "miniwob") if reuse_browser is None else reuse_browser
    self.invalid_ends_episode = invalid_ends_episode
    self.strict_admissible = strict_admissible
    self.screenshots = screenshots
    configure_chromium(chromium_dir, set_miniwob_url=benchmark == "miniwob")
    logging.getLogger("browsergym.core.env").addFilter(_QUIET)
    self._env = None  # the BrowserGym BrowserEnv, kept across episodes
    self._entrypoints: dict[str, Any] = {}
    self._settings: tuple | None = None  # browser/context settings of the last full reset
    self._task: Task | None = None
    self._obs: dict[str, Any] | None = None
    self._history: list[str] = []
    self._steps = 0
    self._failed: str | None = None
    self._done = True

  # --- episode -------------------------------------------------------------------------------------------------------

  def reset(self, task: Task) -> Observation:
    if task.env != self.name:
      raise ValueError(f"{self.name}: task {task.task_id!r} is for env {task.env!r}")
    p = task.param
    if "task" not in p:
      raise ValueError(f"{self.name}: task {task.task_id!r} lacks the 'task' param (a {self.benchmark} task name)")
    gym_id = f"browsergym/{self.benchmark}.{p['task']}"
    seed = int(p.get("seed", 0))
    try:
      obs = self._browser_reset(gym_id, seed)
    except Exception:
      self._teardown()  # a broken browser is relaunched once, then the error propagates (bad setup, not bad luck)
      obs = self._browser_reset(gym_id, seed)
    self._task, self._obs, self._done = task, obs, False
    self._history, self._steps, self._failed = [], 0, None  # history: the actions that ran without error
    return self._observation()

  def step(self, action: str) -> StepResult:
    if self._done or self._obs is None:
      raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
    info: dict[str, Any] = {"action": action}
    env_reward, terminated, task_info, error = 0.0, False, {}, ""
    try:
      parsed = web_state.parse_action(action)
    except web_state.ActionError as e:
      error = f"ActionError: {e}"
    else:
      info["action"] = parsed.text
      admissible = self.page_state().admissible
      info["in_admissible"] = web_state.is_admissible(parsed.text, admissible)
      if self.strict_admissible and not info["in_admissible"]:
        error = f"ActionError: {parsed.text} is not among the admissible actions"
      else:
        try:
          obs, env_reward, terminated, truncated, step_info = self._env.step(parsed.text)
        except Exception as e:  # BrowserGym reads the page after every action: this is the browser failing
          self._browser_died(parsed.text, f"{type(e).__name__}: {e}")
        self._obs = obs
        error = obs.get("last_action_error") or ""
        if error and not self._browser_alive():
          self._browser_died(parsed.text, error)
        terminated = bool(terminated or truncated)
        task_info = step_info.get("task_info", {})
    if error:
      self._obs = dict(self._obs, last_action_error=error)
    self._steps += 1
    self._failed = info["action"] if error else None
    if not error:
      self._history.append(info["action"])
    success = terminated and float(env_reward) > 0
    # A click that completes the task can still come back with an error (BrowserGym waits on a page MiniWoB has
    # already ended: 4 of 100 expert click-button episodes); the action worked, so it is not invalid.
    invalid = bool(error) and not success
    truncated = not terminated and self._steps >= self.max_steps
    self._done = terminated or truncated or (invalid and self.invalid_ends_episode)
    info.update(env_reward=float(env_reward), last_action_error=error, task_info=task_info, truncated=truncated,
                steps=self._steps, axtree_text=self._axtree_text(), url=self._obs.get("url", ""))
    return StepResult(self._observation(), 1.0 if success else 0.0, self._done, success, invalid, info)

  def expert_action(self) -> str | None:
    """The scripted expert's next action (MiniWoB tasks of miniwob_experts.EXPERTS), None otherwise."""
    if self._done or self._obs is None or self.benchmark != "miniwob":
      return None
    full = self.page_state(max_elements=None, max_text=None, include_text=True)  # the expert sees every element
    return miniwob_experts.expert_action(self._task.param["task"], full.goal, full, self._history, self._failed)

  def page_state(self, **overrides: Any) -> web_state.WebState:
    """The current page as a WebState; keyword overrides of max_elements, max_text, include_text."""
    if self._obs is None:
      raise RuntimeError(f"{self.name}: no page before the first reset()")
    return web_state.web_state(self._obs, **{**self.state_kwargs, **overrides})

  def close(self) -> None:
    self._teardown()
    self._done = True

  tasks = staticmethod(tasks)

  # --- internals -----------------------------------------------------------------------------------------------------

  def _observation(self) -> Observation:
    state = self.page_state()
    return Observation(state.text, state.goal, state.admissible)

  def _axtree_text(self) -> str:
    from browsergym.utils.obs import flatten_axtree_to_str

    return flatten_axtree_to_str(self._obs["axtree_object"]) if self._obs.get("axtree_object") else ""

  def _entrypoint(self, gym_id: str):
    if gym_id not in self._entrypoints:
      import gymnasium as gym

      importlib.import_module(f"browsergym.{self.benchmark}")
      # A BrowserEnv object is cheap until its first reset; we only borrow its task factory.
      self._entrypoints[gym_id] = gym.make(gym_id, disable_env_checker=True).unwrapped.task_entrypoint
    return self._entrypoints[gym_id]

  def _browser_reset(self, gym_id: str, seed: int) -> dict[str, Any]:
    entrypoint = self._entrypoint(gym_id)
    if self._env is None:
      from browsergym.core.action import functions
      from browsergym.core.action.highlevel import HighLevelActionSet
      from browsergym.core.env import BrowserEnv

      # BrowserGym's WebArena action set plus the element actions MiniWoB forms need: exactly web_state.ACTION_ARITY.
      action_set = HighLevelActionSet(
          subsets=["webarena", "custom"], multiaction=False,
          custom_actions=[functions.press, functions.focus, functions.clear, functions.dblclick])
      self._env = BrowserEnv(entrypoint, action_mapping=action_set.to_python_code, **self.env_kwargs)
    self._env.task_entrypoint = entrypoint
    if self.reuse_browser and self._env.browser is not None and self._env.task is not None:
      obs = self._soft_reset(seed)
      if obs is not None:
        return obs
    obs, _ = self._env.reset(seed=seed)
    self._settings = _browser_settings(self._env, self._env.task)
    if not self.screenshots:
      _skip_screenshots(self._env.context)
    return obs

  def _soft_reset(self, seed: int) -> dict[str, Any] | None:
    """A new episode in the running browser: what BrowserEnv.reset does, minus relaunching the two browsers."""
    import browsergym.core
    import gymnasium as gym

    env = self._env
    if browsergym.core.__version__ != _MIRRORED_BROWSERGYM:
      return None
    task = env.task_entrypoint(seed=seed, **env.task_kwargs)
    if _browser_settings(env, task) != self._settings:
      return None  # viewport, slow_mo, locale... are fixed when the browser or context starts
    gym.Env.reset(env, seed=seed)
    env.np_random = None  # as BrowserEnv.reset: all randomness belongs to the task
    env.task.teardown()
    # The task's setup navigates the page afresh, so the last active page is reused and any others are closed.
    pages = list(env.context.pages)
    page = env.page if env.page in pages and not env.page.is_closed() else env.context.new_page()
    for other in pages:
      if other is not page:
        other.close()
    env.page, env.page_history = page, {page: None}
    if self.benchmark != "miniwob":  # MiniWoB's file:// pages set no cookies
      env.context.clear_cookies()
    env.context.set_default_timeout(self._settings[2])
    env.task = task
    goal, task_info = task.setup(page=env.page)
    env.goal_object = [] if goal is None else ([{"type": "text", "text": goal}] if isinstance(goal, str) else goal)
    env.chat.messages = []
    # Empty the chat window, else it grows by two messages per episode (element ids of 0.14.3's chatbox page).
    env.chat.page.evaluate("for (const id of ['chatBody', 'chatDebug']) document.getElementById(id)?.replaceChildren()")
    env.chat.add_message(role="assistant", msg="Hi! I am your UI assistant, I can perform web tasks for you. "
                         "What can I help you with?")
    for message in env.goal_object:
      if message["type"] == "text":
        env.chat.add_message(role="user", msg=message["text"])
    env._wait_dom_loaded()
    env._active_page_check()
    env.start_time = time.time()
    env.last_action, env.last_action_error, env.infeasible_message_received = "", "", False
    return env._get_obs()

  def _browser_alive(self) -> bool:
    env = self._env
    return env is not None and env.browser is not None and env.browser.is_connected() and not env.page.is_closed()

  def _browser_died(self, action: str, error: str) -> None:
    self._teardown()
    self._done = True
    raise BrowserDied(f"{self.name}: task {self._task.task_id!r}: the browser failed during {action!r} "
                      f"({error.splitlines()[0][:200] if error else 'no error text'}); the next reset relaunches it")

  def _teardown(self) -> None:
    env, self._env, self._settings = self._env, None, None
    if env is not None:
      try:
        env.close()
      except Exception:  # a dead browser cannot be closed twice; its processes are already gone
        logging.getLogger(__name__).warning("%s: closing a broken browser failed", self.name, exc_info=True)


_SKIP_FLAG = "_dreamjax_skip_screenshot"


def _skip_screenshots(context) -> None:
  """Screenshots are a third of BrowserGym's observation time and text agents never read them: pages of this
  context get a 1x1 black image instead. BrowserGym calls its module-level `extract_screenshot`, so we wrap it once;
  pages of other contexts (other users of BrowserGym in this process) are untouched."""
  import browsergym.core.env as bg_env
  import numpy as np

  original = bg_env.extract_screenshot
  if not getattr(original, _SKIP_FLAG, False):
    def extract_screenshot(page):
      if getattr(page.context, _SKIP_FLAG, False):
        return np.zeros((1, 1, 3), dtype=np.uint8)
      return original(page)

    setattr(extract_screenshot, _SKIP_FLAG, True)
    bg_env.extract_screenshot = extract_screenshot
  setattr(context, _SKIP_FLAG, True)


def _browser_settings(env, task) -> tuple:
  """What BrowserEnv fixes at launch or context creation: a task that needs other values gets a full reset."""
  pick = lambda key: getattr(env, key) if getattr(env, key) is not None else getattr(task, key)  # noqa: E731
  viewport = pick("viewport")
  return (tuple(sorted(viewport.items())) if viewport else None, pick("slow_mo"), pick("timeout"), pick("locale"),
          pick("timezone_id"))


class MiniWobEnv(BrowserGymEnv):
  """MiniWoB++ tasks (browsergym/miniwob.<task>) on local Chromium; tasks from `tasks(names, split, n, start)`."""

  name = "miniwob"

  def __init__(self, **kwargs: Any):
    kwargs.setdefault("benchmark", "miniwob")
    super().__init__(**kwargs)
