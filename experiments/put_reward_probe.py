"""Does M_exp's reward for a final put follow where the item goes? A counterfactual probe (issue 18).

The on-policy audit (experiments/on_policy_fidelity.py) found M_exp paying a success for most final puts of a DreamGym
run that the real game did not reward. This probe takes episodes that end on a put that M_exp or the game rewarded:
- the run's synthetic episodes that M_exp called successes, both those the real game also rewarded ("policy, real
  success") and those it did not ("policy, false success");
- the expert's successes in M_exp's collection, on its held-out tasks and on its training tasks.
Each episode's steps before that put are replayed in the real env. The put is then replaced by every put of the same
item that the state admits, the original included, and the real env says which one it rewards. M_exp answers each put
teacher-forced: the real history and state, greedy, and a malformed answer drawn again as SyntheticEnv does. Its pay
rate on the puts the game rewards and on those it does not shows whether its reward depends on the destination.

Each put is asked twice, with two retrievers:
- "trained": the collection's training side, without any episode of the put's own task. This is how M_exp was
  trained and how held-out fidelity is measured.
- "served": the run's final replay buffer (the offline data plus the write-back of M_exp's own answers), without
  the episode itself. This is what the DreamGym run retrieved from by its end. Each row records whether the shown
  neighbour was synthetic and whether it came from the same task.
An M_exp trained without retrieval (the w/o-replay ablation) is asked once, with retriever "none".

The table also counts the final puts in the non-expert episodes M_exp trained on (`final_puts`): the unrewarded ones
are all M_exp learns a wrong put from.

Run: python experiments/put_reward_probe.py --run runs/reproduce/twc/dreamgym_grpo/seed0 --out runs/put_probe/twc
Writes table.md, results.json and rows.jsonl (every put asked, with M_exp's answer) to --out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreamjax.data.records import TrajectoryRecord, Transition, read_trajectory_files, transitions
from dreamjax.envs import make_env
from dreamjax.envs.base import ENV_ERROR, Env, Task, env_failed
from dreamjax.envs.registry import parse_env_kwargs
from dreamjax.experience.exp_model import META_FILE, exp_format, exp_retriever
from dreamjax.experience.fidelity import Predictor, replay_in_env, synthetic_episodes
from dreamjax.experience.format import list_items
from dreamjax.experience.sft_data import ExampleBuilder, retrieve, split_by_task
from dreamjax.loop.model import load_model
from dreamjax.replay.buffer import ReplayBuffer

SOURCES = ("policy, false success", "policy, real success", "expert, held-out task", "expert, training task")


def put_item(state: str, action: str) -> str | None:
  """The inventory item that `action` puts somewhere (the longest that matches), or None when it is not a put."""
  inventory = next((line.split(":", 1)[1] for line in state.splitlines() if line.startswith("Inventory:")), "")
  items = [i for i in list_items(inventory.strip()) if action.startswith(f"put {i} ")]
  return max(items, key=len) if items else None


def step(env: Env, task: Task, action: str) -> Any:
  """The real env's StepResult of `action`; an env failure is an error naming the task."""
  r = env.step(action)
  if env_failed(r):
    raise RuntimeError(f"put_reward_probe: the real env failed on {task.task_id}: {r.info[ENV_ERROR]}")
  return r


def replay_prefix(env: Env, task: Task, actions: Sequence[str]) -> tuple[Any, list[tuple[str, str]]]:
  """The real observation after `actions` from the task's reset, and the (state, action) history that led there."""
  obs, history = env.reset(task), []
  for a in actions:
    r = step(env, task, a)
    history.append((obs.state, a))
    obs = r.observation
  return obs, history


def alternatives(env: Env, source: str, episode_id: str, task: Task, instruction: str, actions: Sequence[str]
                 ) -> list[dict[str, Any]]:
  """One row per put of the last action's item that the real state before it admits: the real transition of that put
  (history included) and the next state's admissible actions. Empty when the last action is not a put."""
  obs, history = replay_prefix(env, task, actions[:-1])
  item = put_item(obs.state, actions[-1])
  if item is None:
    return []
  rows = []
  for a in [a for a in obs.admissible if a.startswith(f"put {item} ")]:
    before, _ = replay_prefix(env, task, actions[:-1])  # the env is deterministic: the same state every time
    r = step(env, task, a)
    t = Transition(episode_id, len(history), task, instruction, before.state, a, r.observation.state, r.reward,
                   r.done, r.success, r.invalid, history=tuple(history))
    rows.append({"source": source, "episode_id": episode_id, "transition": t, "original": a == actions[-1],
                 "admissible": tuple(before.admissible),
                 "next_admissible": () if r.done else tuple(r.observation.admissible)})
  return rows


def policy_episodes(run: Path, env: Env) -> dict[str, list[tuple[str, Task, str, list[str]]]]:
  """The run's synthetic episodes that M_exp ended with a success, by whether the same actions won the real game:
  (episode id, task, instruction, actions) each."""
  with ReplayBuffer(run / "replay", read_only=True) as buffer:
    episodes = synthetic_episodes(buffer.iter_from(0))
  out: dict[str, list] = {SOURCES[0]: [], SOURCES[1]: []}
  for replay in replay_in_env(env, episodes):
    if replay is None:  # a generated task: the game does not judge it
      continue
    steps, _, real_success = replay
    if steps[-1].done and steps[-1].success:
      out[SOURCES[1] if real_success else SOURCES[0]].append(
          (steps[0].episode_id, steps[0].task, steps[0].instruction, [t.action for t in steps]))
  return out


def expert_episodes(train: Sequence[TrajectoryRecord], held: Sequence[TrajectoryRecord]
                    ) -> dict[str, list[tuple[str, Task, str, list[str]]]]:
  """The expert's successes in M_exp's collection, on its held-out and on its training tasks (its own split)."""

  def pick(side):
    return [(r.episode_id, r.task, r.instruction, [s.action for s in r.steps]) for r in side
            if r.policy == "expert" and r.success]
  return {SOURCES[2]: pick(held), SOURCES[3]: pick(train)}


FINAL_PUTS = ("rewarded", "unrewarded, earlier items where the expert put them", "unrewarded, an earlier item elsewhere")


def put_place(state: str, action: str) -> tuple[str, str] | None:
  """(item, place) of a put, or None when `action` puts no inventory item."""
  item = put_item(state, action)
  return None if item is None else (item, action[len(f"put {item} "):].split(" ", 1)[-1])


def final_puts(records: Sequence[TrajectoryRecord]) -> dict[str, int]:
  """What M_exp could learn about a final put from its data: the collection's final puts (a valid put that empties
  the inventory once every item the task's expert put away was taken) of the non-expert episodes, by outcome.
  Unrewarded ones are split by whether the earlier items were where the task's expert put them; a task without an
  expert success is left out, since nothing says where its items go."""
  right = {r.task.task_id: dict(filter(None, (put_place(s.state, s.action) for s in r.steps)))
           for r in records if r.policy == "expert" and r.success}
  counts = dict.fromkeys(FINAL_PUTS, 0)
  for r in records:
    places = right.get(r.task.task_id)
    if r.policy == "expert" or not places:
      continue
    taken, placed = set(), {}
    for s in r.steps:
      if s.invalid:
        continue
      if s.action.startswith("take ") and s.action[5:] in places:
        taken.add(s.action[5:])
        placed.pop(s.action[5:], None)
      put = put_place(s.state, s.action)
      if put is None:
        continue
      if taken == set(places) and "Inventory: nothing" in s.next_state:
        earlier_right = all(placed.get(i) == places[i] for i in places if i != put[0])
        counts[FINAL_PUTS[0] if s.reward > 0 else FINAL_PUTS[1] if earlier_right else FINAL_PUTS[2]] += 1
      placed[put[0]] = put[1]
  return counts


def rate(rows: Sequence[dict[str, Any]], key: str = "m_exp_paid") -> float | None:
  return sum(bool(r[key]) for r in rows) / len(rows) if rows else None


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Pay rates of one (source, retriever) cell; an answer malformed after the retries pays nothing."""
  rewarded = [r for r in rows if r["real_reward"] > 0]
  unrewarded = [r for r in rows if r["real_reward"] <= 0]
  by_episode: dict[str, list] = {}
  for r in rows:
    by_episode.setdefault(r["episode_id"], []).append(r)
  return {"episodes": len(by_episode),
          "episodes_with_a_rewarded_put": sum(any(r["real_rewarded"] for r in e) for e in by_episode.values()),
          "puts": len(rows), "rewarded_puts": len(rewarded),
          "paid_when_rewarded": rate(rewarded), "unrewarded_puts": len(unrewarded),
          "paid_when_unrewarded": rate(unrewarded),
          "original_real_rewarded": rate([r for r in rows if r["original"]], "real_rewarded"),
          "original_paid": rate([r for r in rows if r["original"]]),
          "episodes_paid_exactly_the_rewarded": sum(all(r["m_exp_paid"] == r["real_rewarded"] for r in e)
                                                    for e in by_episode.values()),
          "malformed": sum(not r["ok"] for r in rows),
          "neighbour_synthetic": rate(rows, "neighbour_synthetic"),
          "neighbour_same_task": rate(rows, "neighbour_same_task")}


COLUMNS = [("episodes", "episodes"), ("episodes_with_a_rewarded_put", "with a rewarded put"),
           ("rewarded_puts", "rewarded puts"), ("paid_when_rewarded", "paid when rewarded"),
           ("unrewarded_puts", "unrewarded puts"), ("paid_when_unrewarded", "paid when unrewarded"),
           ("original_real_rewarded", "original put rewarded"), ("original_paid", "original put paid"),
           ("episodes_paid_exactly_the_rewarded", "episodes right on every put"), ("malformed", "malformed"),
           ("neighbour_synthetic", "neighbour synthetic"), ("neighbour_same_task", "neighbour same task")]


def table(results: dict[str, dict[str, Any]], collection: dict[str, int], run: Path) -> str:
  def cell(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

  lines = [f"M_exp's reward for every put of the final item, {run}", "",
           "| episodes | retriever | " + " | ".join(label for _, label in COLUMNS) + " |",
           "|---|---|" + "---|" * len(COLUMNS)]
  for name, r in results.items():
    source, retriever = name.split(" / ")
    lines.append(f"| {source} | {retriever} | " + " | ".join(cell(r[k]) for k, _ in COLUMNS) + " |")
  lines += ["", "Final puts of the non-expert episodes M_exp trained on:", "", "| outcome | puts |", "|---|---|"]
  lines += [f"| {k} | {n} |" for k, n in collection.items()]
  return "\n".join(lines)


def probe(run: Path, episodes: int, seed: int, batch_size: int
          ) -> tuple[dict[str, dict[str, Any]], list[dict], dict[str, int]]:
  """(pay rates by source and retriever, every put asked, `final_puts` of M_exp's training side)."""
  cfg = json.loads((run / "config.json").read_text())
  checkpoint = Path(cfg["exp_model"])
  meta = json.loads((checkpoint / META_FILE).read_text())
  exp_cfg = json.loads((checkpoint.parent / "config.json").read_text())
  fmt = exp_format(meta)
  records = read_trajectory_files(exp_cfg["trajectories"], "trajectories", exp_cfg["max_episodes"])
  train_side, held_side = split_by_task(records, exp_cfg["held_out_fraction"], exp_cfg["seed"])
  env = make_env(cfg["rl"]["env"], **parse_env_kwargs(cfg["rl"]["env_kwargs"]))
  rng = random.Random(seed)
  try:
    chosen = policy_episodes(run, env) | expert_episodes(train_side, held_side)
    rows = []
    for source in SOURCES:
      pool = chosen[source]
      for eid, task, instruction, actions in rng.sample(pool, min(episodes, len(pool))):
        rows += alternatives(env, source, eid, task, instruction, actions)
  finally:
    env.close()
  if not rows:
    raise ValueError(f"{run}: no episode ends on a put")
  model_cfg, params, tokenizer = load_model(checkpoint)
  builder = ExampleBuilder(tokenizer, fmt, meta["max_len"])
  predictor = Predictor(model_cfg, params, tokenizer, builder, cfg["exp_max_new_tokens"] or meta["max_new_tokens"],
                        batch_size)
  ts = [r["transition"] for r in rows]
  states, actions = [t.state for t in ts], [t.action for t in ts]
  if fmt.retrieval and fmt.k:
    trained = exp_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
    trained.add(list(transitions(train_side, max_history=0)))
    served = exp_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
    with ReplayBuffer(run / "replay", read_only=True) as buffer:
      served.add(list(buffer.iter_from(0)))
    found = {"trained": retrieve(trained, fmt, states, actions, exclude_tasks=[t.task.task_id for t in ts]),
             "served": retrieve(served, fmt, states, actions, exclude_episodes=[r["episode_id"] for r in rows])}
  else:  # the w/o-replay ablation's M_exp: each put is asked once, with no neighbour
    found = {"none": retrieve(None, fmt, states, actions)}
  out_rows, results = [], {}
  for name, neighbours in found.items():
    asked = []
    for row, shown in zip(rows, neighbours):
      ex = builder.fit(row["transition"], shown, "", "", None, row["admissible"], row["next_admissible"])
      if ex is not None:
        asked.append((row, ex))
    prompts = [ex.prompt for _, ex in asked]
    current = [row["transition"].state for row, _ in asked]
    lists = [row["admissible"] for row, _ in asked]
    texts, preds = predictor.predict(prompts, current, lists)
    texts, preds, _ = predictor.resample(prompts, current, lists, texts, preds, cfg["exp_retries"],
                                         cfg["exp_retry_temperature"], seed)
    for (row, ex), text, pred in zip(asked, texts, preds):
      t, n = row["transition"], (ex.retrieved[0] if ex.retrieved else None)
      out_rows.append({"source": row["source"], "retriever": name, "episode_id": row["episode_id"],
                       "state": t.state, "action": t.action, "original": row["original"],
                       "real_reward": t.reward, "real_rewarded": t.reward > 0, "ok": pred.ok,
                       "m_exp_reward": pred.reward, "m_exp_paid": bool(pred.ok and pred.reward > 0),
                       "neighbour": None if n is None else f"{n.episode_id}:{n.step}",
                       "neighbour_action": None if n is None else n.action,
                       "neighbour_reward": None if n is None else n.reward,
                       "neighbour_synthetic": n is not None and n.origin == "synthetic",
                       "neighbour_same_task": n is not None and n.task.task_id == t.task.task_id,
                       "output": text})
  for source in SOURCES:
    for name in found:
      cell = [r for r in out_rows if r["source"] == source and r["retriever"] == name]
      if cell:
        results[f"{source} / {name}"] = summarize(cell)
  return results, out_rows, final_puts(train_side)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--run", required=True, help="a `dreamjax dreamgym` run folder (config.json, replay/)")
  p.add_argument("--out", required=True, help="folder for table.md, results.json and rows.jsonl")
  p.add_argument("--episodes", type=int, default=48, help="episodes drawn from each of the four sources")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-size", type=int, default=64)
  args = p.parse_args(argv)
  run = Path(args.run)
  try:
    results, rows, collection = probe(run, args.episodes, args.seed, args.batch_size)
  except (ValueError, FileNotFoundError) as e:
    print(f"put_reward_probe: {e}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  text = table(results, collection, run)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps(results | {"collection final puts": collection}, indent=2))
  with open(out / "rows.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(text)
  print(f"table: {out / 'table.md'}; rows: {out / 'rows.jsonl'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
