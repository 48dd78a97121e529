"""The collector: expert, explorer, random and epsilon-noisy policies on a real env, episodes written to JSONL as
they finish.

Policies (by name):
- "expert": the env's `expert_action()`; where it has none (TWX's gold path after a deviation, an exhausted path), a
  uniformly random admissible action stands in, recorded as step source "fallback".
- "random": uniform over the admissible actions of the current observation.
- "eps<p>" (e.g. "eps0.3"): random with probability p, else the expert (with the same fallback).
- "explorer": TWX only, `dreamjax.envs.twx_explorer.TwxExplorer`, an expert that acts on the observations alone (the
  state, the admissible actions, the episode's own history; never the gold path), run here in the collector's process
  on what the batch env returns; where it has no action, random stands in ("fallback"). Step source "explorer".
- "explorer-eps<p>" (e.g. "explorer-eps0.3"): random with probability p, else the explorer.
- "stale<p>" (e.g. "stale0.3"): with probability p an action an earlier observation of the episode admitted and the
  current one does not (step source "stale"; the env refuses it: an invalid step), where there is one; else random.
  Every other collector acts from the current admissible list, so without it the data holds no refused action, and
  an experience model trained on it accepts whatever it is given: the actions an agent acting from a wrong list
  picks ("take flour" once the flour is held, "put flour in shelf" once it is put) are exactly these.
`parse_policy` reads a name as (base policy, p): every other policy is "random with probability p, else the base".
Each episode draws from its own `random.Random(seed)`, the seed a hash of (config seed, episode id), so an episode's
choices do not depend on the batch it ran in, the number of workers, or on resuming. (Whether the env itself is
deterministic is the env's business: TWX's coin and twc gold paths are not.)

Episodes are planned up front: policy k with count c runs on tasks 0..c/G of each of the G games, game by game in
turn, so all policies share tasks and the episode id "<policy>:<task_id>" is unique. The JSONL file is the source of
truth: a restarted run reads it, skips episodes already there, and goes on. An episode the env failed on
(dreamjax.envs.base.ENV_ERROR: a JVM or browser that died, a worker crash or hang in the pool, an adapter that
raised) is retried `max_retries` times and otherwise left out, so a later run retries it; such failures are counted in
the summary, never written as env outcomes.

Layout under out_dir: trajectories.jsonl, collect_config.json (what the episodes depend on, checked on resume),
summary.json, and tfds/ (the DreamjaxTrajectories dataset built from the JSONL).

`collect` is one process's work and writes out_dir itself; with several JAX processes `dreamjax collect`
(dreamjax.commands.collect) runs it on process 0 alone.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dreamjax.data.jsonl import JsonlWriter
from dreamjax.data.records import StepRecord, TrajectoryRecord, iter_trajectories, summarize
from dreamjax.envs.base import ENV_ERROR, Observation, Task, env_failed
from dreamjax.envs.registry import env_tasks, make_batch_env, parse_env_kwargs
from dreamjax.envs.twx_explorer import TwxExplorer
from dreamjax.envs.web_state import instantiate
from dreamjax.parallel import DistributedConfig


@dataclasses.dataclass(frozen=True)
class CollectConfig:
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=50",)  # "key=value"; values parsed as JSON where they parse, else text
  games: tuple[str, ...] = ("cookingworld", "twc", "coin")
  split: str = "train"
  task_start: int = 0  # first task index of each game
  game_params: str = ""  # env-specific game settings (TWX: "numLocations=3, ...")
  policies: tuple[str, ...] = ("expert:2000", "random:1000", "eps0.3:2000")  # "policy:episodes", spread over games
  num_workers: int = 2  # EnvPool worker processes; 0 runs envs in this process
  rows_per_worker: int = 1  # episodes stepped together = max(num_workers, 1) * rows_per_worker
  max_steps: int = 100  # the collector's own cap, a guard beyond the env's step limit
  max_retries: int = 1  # retries of an episode lost to a worker crash or hang
  step_timeout_s: float = 60.0
  reset_timeout_s: float = 180.0
  seed: int = 0
  out_dir: str = "runs/collect/twx"
  eval_fraction: float = 0.1
  build_tfds: bool = True
  progress: bool = True
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs (default: from the environment)


# What the recorded episodes depend on; a resumed run must agree on these.
IDENTITY_FIELDS = ("env", "env_kwargs", "split", "task_start", "game_params", "max_steps", "seed")


@dataclasses.dataclass(frozen=True)
class Episode:
  episode_id: str
  policy: str
  task: Task
  seed: int


POLICY_BASES = ("expert", "explorer")  # the policies random noise is mixed with (a step source each)
EXPLORER_ENVS = ("textworld_express",)  # envs whose observations the explorer reads


def parse_policy(name: str) -> tuple[str, float]:
  """(base policy, probability of a random action): expert ("expert", 0), random ("random", 1), eps<p> ("expert", p),
  explorer ("explorer", 0), explorer-eps<p> ("explorer", p); and stale<p> ("stale", p: the probability of a stale
  action)."""
  if name in POLICY_BASES:
    return name, 0.0
  if name == "random":
    return "random", 1.0
  if name.startswith("stale"):
    base, noise = "stale", name[len("stale"):]
  elif name.startswith("explorer-eps"):
    base, noise = "explorer", name[len("explorer-eps"):]
  else:
    base, noise = "expert", name[len("eps"):] if name.startswith("eps") else ""
  try:
    p = float(noise)
  except ValueError:
    p = -1.0
  if 0.0 <= p <= 1.0:
    return base, p
  raise ValueError(f"unknown policy {name!r}: expected 'expert', 'random', 'eps<p>', 'explorer', 'explorer-eps<p>' "
                   "or 'stale<p>' with 0 <= p <= 1")


def parse_policies(items: Sequence[str]) -> list[tuple[str, int]]:
  out = []
  for item in items:
    name, sep, count = item.rpartition(":")
    if not sep or not count.strip().isdigit():
      raise ValueError(f"policies: expected 'policy:episodes', got {item!r}")
    parse_policy(name)
    out.append((name, int(count)))
  if len({n for n, _ in out}) != len(out):
    raise ValueError(f"policies: a policy is listed twice in {list(items)}")
  return out


def episode_seed(seed: int, episode_id: str) -> int:
  return int.from_bytes(hashlib.sha256(f"{seed}:{episode_id}".encode()).digest()[:4], "big")


def plan_episodes(cfg: CollectConfig, make_tasks: Callable[..., list[Task]] = env_tasks) -> list[Episode]:
  policies = parse_policies(cfg.policies)
  games = list(cfg.games)
  per_game = max((-(-count // len(games)) for _, count in policies), default=0)
  tasks = {g: make_tasks(cfg.env, g, cfg.split, per_game, start=cfg.task_start, params=cfg.game_params)
           for g in games}
  out = []
  for name, count in policies:
    for j in range(count):
      task = tasks[games[j % len(games)]][j // len(games)]
      episode_id = f"{name}:{task.task_id}"
      out.append(Episode(episode_id, name, task, episode_seed(cfg.seed, episode_id)))
  return out


def _expert_actions(batch, rows: list[int]) -> dict[int, str | None]:
  if not rows:
    return {}
  actions = batch.expert_actions(rows)  # SerialBatchEnv and EnvPool both ask each row's env
  return {i: actions[i] for i in rows}


_EXPLORER = TwxExplorer()


def run_episodes(batch, episodes: Sequence[Episode],
                 max_steps: int) -> Iterator[tuple[Episode, TrajectoryRecord | str]]:
  """Runs episodes together on a BatchEnv, one row each; yields (episode, record) as each ends, or (episode, error)
  when the env infrastructure failed it."""
  n = len(episodes)
  obs: list[Observation] = batch.reset_batch([e.task for e in episodes])
  rngs = [random.Random(e.seed) for e in episodes]
  base, eps = zip(*(parse_policy(e.policy) for e in episodes)) if episodes else ((), ())
  steps: list[list[StepRecord]] = [[] for _ in episodes]
  # what the explorer reads, and where a stale action comes from: the row's own episode so far
  history: list[list[tuple[Observation, str]]] = [[] for _ in episodes]
  live = [True] * n
  score: list[Any] = [None] * n
  while any(live):
    # (a stale row is always "random" here: whether this step is stale it draws below, from its own generator)
    use_random = [live[i] and (base[i] == "stale" or eps[i] >= 1.0 or (eps[i] > 0.0 and rngs[i].random() < eps[i]))
                  for i in range(n)]
    guided = [i for i in range(n) if live[i] and not use_random[i]]
    experts = _expert_actions(batch, [i for i in guided if base[i] == "expert"])
    experts.update({i: _EXPLORER.act(obs[i], history[i]) for i in guided if base[i] == "explorer"})
    actions: list[str | None] = [None] * n
    sources = [""] * n
    for i in range(n):
      if not live[i]:
        continue
      stale = sorted({a for o, _ in history[i] for a in o.admissible} - set(obs[i].admissible)) \
          if base[i] == "stale" else []
      if not use_random[i] and experts[i] is not None:
        actions[i], sources[i] = experts[i], base[i]
      elif stale and rngs[i].random() < eps[i]:
        actions[i], sources[i] = rngs[i].choice(stale), "stale"
      else:
        # No admissible list (or a row the pool already ended): "" is an invalid action the env records as such.
        # Admissible entries may be templates with a free-text slot (web forms: fill('15', <text>)).
        actions[i] = instantiate(rngs[i].choice(obs[i].admissible), rngs[i]) if obs[i].admissible else ""
        sources[i] = "random" if use_random[i] else "fallback"
    results = batch.step_batch(actions)
    for i in range(n):
      if not live[i]:
        continue
      r = results[i]
      if env_failed(r):
        live[i] = False
        yield episodes[i], str(r.info[ENV_ERROR])
        continue
      steps[i].append(StepRecord(obs[i].state, actions[i], r.observation.state, float(r.reward), bool(r.done),
                                 bool(r.success), bool(r.invalid), tuple(obs[i].admissible), sources[i]))
      history[i].append((obs[i], actions[i]))
      obs[i] = r.observation
      if isinstance(r.info.get("score"), int | float) and not isinstance(r.info.get("score"), bool):
        score[i] = float(r.info["score"])
      if r.done or len(steps[i]) >= max_steps:
        live[i] = False
        e = episodes[i]
        yield e, TrajectoryRecord(e.episode_id, e.task.env, e.task, obs[i].instruction or e.task.instruction, e.policy,
                                  e.seed, tuple(steps[i]), bool(r.success), len(steps[i]), score[i])


def play_expert(env, task: Task) -> tuple[TrajectoryRecord, list[Observation]]:
  """One episode of a single env's own expert (`expert_action`, until it has no action or the episode ends), recorded
  as `run_episodes` records an expert episode, and the observations the expert acted on: a known-good episode for
  tests and benchmarks, without a BatchEnv."""
  obs, steps, seen, score = env.reset(task), [], [], None
  while (action := env.expert_action()) is not None:
    seen.append(obs)
    r = env.step(action)
    steps.append(StepRecord(obs.state, action, r.observation.state, float(r.reward), bool(r.done), bool(r.success),
                            bool(r.invalid), tuple(obs.admissible), "expert"))
    obs = r.observation
    if isinstance(r.info.get("score"), int | float) and not isinstance(r.info.get("score"), bool):
      score = float(r.info["score"])
    if r.done:
      break
  record = TrajectoryRecord(f"expert:{task.task_id}", env.name, task, obs.instruction or task.instruction, "expert",
                            0, tuple(steps), bool(steps and steps[-1].success), len(steps), score)
  return record, seen


def _check_identity(cfg: CollectConfig, out: Path) -> None:
  path = out / "collect_config.json"
  mine = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(cfg))).items() if k in IDENTITY_FIELDS}
  if path.is_file():
    before = json.loads(path.read_text())
    for k in IDENTITY_FIELDS:
      if k in before and before[k] != mine[k]:
        raise ValueError(f"{path}: field {k!r} was {before[k]!r} for the episodes already collected, now {mine[k]!r};"
                         " use another out_dir")
  path.write_text(json.dumps(mine, indent=1, sort_keys=True) + "\n")


def _load_done(path: Path) -> dict[str, TrajectoryRecord]:
  """The episodes already in the JSONL by id (a repeated id is an error: `dreamjax.data.records`)."""
  return {r.episode_id: r for r in iter_trajectories(path)} if path.is_file() else {}


def collect(cfg: CollectConfig, episodes: Sequence[Episode] | None = None, batch=None) -> dict[str, Any]:
  """Collects the planned episodes that out_dir's JSONL lacks, then writes summary.json (and the TFDS dataset).
  `batch` may be any BatchEnv (it is not closed here); by default an EnvPool (or in-process envs) is made."""
  policies = parse_policies(cfg.policies)  # bad settings fail here, before any env starts or file is written
  explorers = [n for n, _ in policies if parse_policy(n)[0] == "explorer"]
  if explorers and cfg.env not in EXPLORER_ENVS:
    raise ValueError(f"collect: policy {explorers[0]!r} reads TextWorld-Express observations; env {cfg.env!r} is not"
                     f" one of {', '.join(EXPLORER_ENVS)}")
  parse_env_kwargs(cfg.env_kwargs)
  if not cfg.games or cfg.rows_per_worker < 1 or cfg.max_steps < 1:
    raise ValueError("collect: games must be non-empty and rows_per_worker and max_steps positive")
  out = Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  _check_identity(cfg, out)
  jsonl = out / "trajectories.jsonl"
  episodes = plan_episodes(cfg) if episodes is None else list(episodes)
  done = _load_done(jsonl)
  todo = collections.deque(e for e in episodes if e.episode_id not in done)
  rows = max(cfg.num_workers, 1) * cfg.rows_per_worker
  owned = batch is None
  batch = make_batch_env(cfg.env, cfg.env_kwargs, cfg.rows_per_worker, cfg.num_workers,
                         step_timeout_s=cfg.step_timeout_s, reset_timeout_s=cfg.reset_timeout_s) if owned else batch
  tries: collections.Counter = collections.Counter()
  errors: list[str] = []
  steps = written = 0
  t0 = time.perf_counter()
  bar = tqdm(total=len(episodes), initial=len(episodes) - len(todo), desc="collect", unit="ep",
             disable=not cfg.progress, dynamic_ncols=True)
  try:
    with JsonlWriter(jsonl) as writer:
      while todo:
        chunk = [todo.popleft() for _ in range(min(rows, len(todo)))]
        for e, outcome in run_episodes(batch, chunk, cfg.max_steps):
          if isinstance(outcome, str):
            tries[e.episode_id] += 1
            errors.append(f"{e.episode_id}: {outcome}")
            tqdm.write(f"collect: {e.episode_id} failed ({outcome})", file=sys.stderr)
            if tries[e.episode_id] <= cfg.max_retries:
              todo.append(e)
            continue
          writer.write(outcome.to_json())
          done[e.episode_id] = outcome
          written += 1
          steps += outcome.num_steps
          bar.update(1)
  finally:
    bar.close()
    if owned:
      batch.close()
  seconds = time.perf_counter() - t0
  planned = {e.episode_id for e in episodes}
  summary = {
      "env": cfg.env, "jsonl": str(jsonl), "episodes_planned": len(planned),
      "episodes_done": sum(i in done for i in planned), "episodes_this_run": written, "steps_this_run": steps,
      "seconds_this_run": round(seconds, 3), "steps_per_s": round(steps / seconds, 2) if seconds else 0.0,
      "episodes_per_s": round(written / seconds, 3) if seconds else 0.0, "rows": rows,
      "num_workers": cfg.num_workers, "infrastructure_errors": len(errors), "errors": errors[:20],
      "restarts": getattr(batch, "restarts", 0),
      "policies": summarize([done[i] for i in sorted(planned) if i in done]),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  if cfg.build_tfds and jsonl.is_file():
    from dreamjax.data.tfds_dataset import build_dataset

    build_dataset([jsonl], out / "tfds", eval_fraction=cfg.eval_fraction)
  return summary
