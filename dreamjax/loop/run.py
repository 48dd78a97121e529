"""The RL loop every iterative command shares: `Run` owns the run folder (checkpoints, resume, tracker, evaluations),
`run_iterations` drives a `PolicyLearner` against an env with a task source and hooks.

One iteration: the hooks' `before_iteration`; `tasks.draw(iteration)` (a seeded uniform draw, or the curriculum);
`learner.iteration(env, tasks)` (rollouts, advantages, update); the hooks' `after_iteration` (DreamGym: replay
write-back, curriculum update, task generation), whose metrics join the learner's in metrics.jsonl. The env's steps are
counted as synthetic transitions when the env says it is synthetic (`env.synthetic`, SyntheticEnv) and as real ones
otherwise, so nothing zeroes a counter after the fact. Every `eval_every` iterations (and before the first and after
the last) the policy is evaluated greedily on held-out tasks of `eval_env`, always a real env, with the transitions
spent so far; `max_real_transitions` is an exact budget for a real env (`max_synthetic_transitions` for M_exp): the
iteration that would pass it steps only what is left (`RolloutEngine.run`'s `max_env_steps`; cut episodes are left out
of the update) and the run stops there.

Outputs in `out_dir`: config.json, metrics.jsonl (one row per iteration), evals.jsonl (each evaluation with per-task
outcomes), summary.json, learning_curve.svg (held-out success against iterations and transitions), metrics.svg
(training curves), checkpoints/ (the last `keep_checkpoints`; or `checkpoint_dir`, which may be a gs:// bucket), the
final policy as an HF folder `final/` (or `export_dir`), and what the hooks write. With `track.wandb` "online" or
"offline" the metrics also go to Weights & Biases.

Checkpoints and resume. Every `checkpoint_every` iterations (and after the last) the learner's arrays (train state,
frozen reference, root key), the hooks' arrays and, as JSON, the counters, evaluations, the tracker's run id, the
config and the hooks' state are saved with orbax. Rerunning the same command with the same `out_dir` resumes from the
latest committed checkpoint (a step that fails to read is moved aside with a warning and the one before it used;
one whose array data alone is bad is found only when the arrays are read, after the hooks were built from its meta, so
the command, wrapped in `resuming`, is built again from the earlier step): rows logged after it are dropped from
metrics.jsonl and evals.jsonl, and since every draw depends only on (seed, iteration, phase), the resumed run ends
with the same parameters, bit for bit, and the same files, timings aside, as a run that was never interrupted. W&B
continues the same run id. On a preemption notice (SIGTERM, or JAX's preemption sync point with several processes:
`dreamjax.loop.preemption`) the loop checkpoints the iteration it just finished, waits for the commit and raises
`Preempted` (the CLI exits with 75): rerunning the command resumes there.

`RunFolder` (lock, checkpointer, resume step and meta, preemption, `restore` / `save` / `after_step`) is the part of
`Run` that the step loops of policy SFT, DPO and M_exp SFT share with this one.

One run per folder: `Run` takes the folder's lock (`dreamjax.loop.lock`) before anything in it is opened or written
and holds it until `close`, so the same command started twice refuses the second run with the holder's pid and host.

Several processes: every process runs this same host program; process 0 alone writes the run folder's files
(checkpoints are written by every process through orbax), so `out_dir` must be a filesystem every process sees;
process 0 alone holds the lock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from dreamjax.envs.base import BatchEnv, Task
from dreamjax.loop.checkpoint import RunCheckpointer, StepUnreadable
from dreamjax.loop.config import checkpoint_folder, export_dtype, export_folder
from dreamjax.loop.learner import PolicyLearner, RLConfig
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.model import save_model
from dreamjax.loop.plots import learning_curve
from dreamjax.loop.preemption import Preempted, Preemption
from dreamjax.loop.track import TrackConfig, Tracker, echo, json_dumps, progress, to_json, truncate_jsonl
from dreamjax.rl.update import SkipCounter
from dreamjax.rollout.trajectory import Trajectories

# Training curves drawn into metrics.svg (those a run logs; PPO adds vf_loss, GRPO kl).
CURVES = ("loss", "kl", "vf_loss", "entropy", "grad_norm", "rollout_success", "rollout_return", "invalid_rate",
          "parse_failure_rate", "zero_variance_group_frac", "real_transitions", "synthetic_transitions", "iteration_s")


T = TypeVar("T")


class ResumeAgain(Exception):
  """The checkpoint a run resumed from held array data that failed to read; it was set aside, so building the run
  again resumes from the committed step before it."""

  def __init__(self, step: int, earlier: int):
    super().__init__(f"checkpoint {step} could not be read; starting again from checkpoint {earlier}")
    self.step, self.earlier = step, earlier


def resuming(command: Callable[[], T]) -> T:
  """`command()` (one that builds a `Run` and calls `run_iterations`), run again each time the step it resumed from
  turned out unreadable only once its arrays were read: the step's metadata opened, so the hooks and the tracker were
  already built from it, and everything is rebuilt from the earlier step rather than patched."""
  while True:
    try:
      return command()
    except ResumeAgain as e:
      echo(str(e))


class TaskSource(Protocol):
  def draw(self, iteration: int) -> list[Task]: ...


class Hook:
  """Work a loop adds around each iteration, with its share of the checkpoint; every method is optional."""

  def before_iteration(self, iteration: int) -> None:
    pass

  def after_iteration(self, iteration: int, traj: Trajectories, metrics: dict[str, Any]) -> dict[str, Any]:
    """Extra metrics for the iteration's row."""
    return {}

  def checkpoint_arrays(self) -> dict[str, Any]:
    return {}

  def checkpoint_meta(self) -> dict[str, Any]:
    return {}

  def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    pass

  def finish(self, out: Path) -> dict[str, Any]:
    """Called once after the last iteration on every process; returns summary entries."""
    return {}


def config_changes(saved: Any, current: Any, prefix: str = "") -> list[str]:
  """Dotted names of the config fields that differ between the checkpointed run and this one."""
  if not (isinstance(saved, dict) and isinstance(current, dict)):
    return [] if saved == current else [prefix.rstrip(".") or "config"]
  return [c for k in sorted(set(saved) | set(current)) for c in config_changes(saved.get(k), current.get(k),
                                                                                f"{prefix}{k}.")]


class RunFolder:
  """A run folder with its checkpoints, for any loop that resumes (the RL loop through `Run`; policy SFT, DPO and
  M_exp SFT directly): takes the folder's lock, opens `checkpoints/` keeping `keep` steps, and knows, before anything
  else is built, `resume` (the step the latest committed checkpoint ended; None: a fresh run) and `meta` (its JSON
  state). It also holds the run's `Preemption` (`should_stop`). `restore`, `save` and `after_step` are the rest of
  resuming and checkpointing a step loop."""

  def __init__(self, config: Any, out_dir: str | Path, keep: int | None, checkpoints: str | Path | None = None):
    self.config, self.out, self._opened = config, Path(out_dir), time.perf_counter()
    # Before the checkpointer opens the folder (it removes unfinished steps) and before any file is written: a second
    # run on this folder is refused here.
    self.lock = lock_run_folder(self.out)
    try:
      self.ckpt = RunCheckpointer(checkpoints or self.out / "checkpoints", keep=keep)
    except BaseException:
      self.lock.release()
      raise
    self.preemption = Preemption().open()
    try:
      self.resume = self.ckpt.latest_step()
      self.meta: dict[str, Any] = self.ckpt.meta(self.resume) if self.resume is not None else {}
    except BaseException:  # an unreadable checkpoints folder: release the folder for the next try
      self.close()
      raise

  def elapsed(self) -> float:
    """The run's wall seconds: those its checkpoint recorded for the processes before this one (the gaps between them
    are not counted) plus this one's since the folder opened. A summary's "seconds" (the tables' training cost)."""
    return float(self.meta.get("seconds", 0.0)) + time.perf_counter() - self._opened

  def check_last(self, last: int, name: str) -> None:
    """Refuses a checkpoint past the run's end (`last` steps, which the setting `name` decides)."""
    if self.resume is not None and self.resume > last:
      raise ValueError(f"{name} gives {last} steps but {self.ckpt.folder} holds step {self.resume}; raise "
                       f"{name} or use another out_dir")

  def tracker(self, track: TrackConfig) -> Tracker:
    """The run's tracker: on resume it continues the checkpoint's run id (W&B resumes that run) and metrics.jsonl
    up to the checkpoint's step; a fresh run starts a new id and an empty metrics.jsonl."""
    return Tracker(self.out, to_json(self.config), track, run_id=self.meta.get("tracker_run_id"),
                   resume_step=self.resume)

  def restore(self, like: Any) -> tuple[Any, dict[str, Any]]:
    """(arrays, meta) of the step `resume` names, laid out as `like`; a step whose array data fails to read is set
    aside and `ResumeAgain` raised (the command is built again from the step before: `resuming`)."""
    try:
      arrays, meta = self.ckpt.restore(self.resume, like=like)
    except StepUnreadable as e:
      if e.earlier is None:
        raise
      self.ckpt.set_aside(e.step, e.problem, e.earlier)
      raise ResumeAgain(e.step, e.earlier) from None
    changed = config_changes(meta.get("config", {}), to_json(self.config))
    echo(f"resuming {self.out} after step {self.resume}" + (f" (config changed: {', '.join(changed)})" if changed
                                                             else ""))
    return arrays, meta

  def save(self, step: int, arrays: Any, meta: dict[str, Any], tracker: Tracker) -> None:
    """Starts saving checkpoint `step`: `arrays`, and `meta` with the tracker's run id and the config."""
    self.ckpt.save(step, arrays, {**meta, "tracker_run_id": tracker.run_id, "config": to_json(self.config),
                                  "seconds": self.elapsed()})

  def resume_step_loop(self, state: Any, skips: SkipCounter, last: int) -> tuple[Any, int, list, list]:
    """(TrainState, step, logged rows, evaluations) a step loop of `last` steps starts from (policy SFT, DPO): the
    checkpoint's on resume, its skip counts put back into `skips`; else `state` at step 0 with none."""
    if self.resume is None:
      return state, 0, [], []
    self.check_last(last, "max_steps (or epochs)")
    arrays, meta = self.restore({"state": state})
    skips.total, skips.streak = int(meta["skipped_updates"]), int(meta["nonfinite_streak"])
    return arrays["state"], int(meta["step"]), meta["history"], meta["evals"]

  def save_step_loop(self, step: int, state: Any, history: list, evals: list, skips: SkipCounter,
                     tracker: Tracker) -> None:
    """Checkpoint `step` of a step loop: what `resume_step_loop` reads back."""
    self.save(step, {"state": state}, {"step": step, "history": history, "evals": evals, **skips.check()}, tracker)

  def after_step(self, step: int, last: int, every: int, save: Callable[[int], None], what: str) -> None:
    """A step loop's checkpoint point after `step` of `last`: `save(step)` every `every` steps (0: never) before the
    last (the loop saves the last itself, after its final evaluation), and on a preemption notice, after which the
    save is waited for and `Preempted` raised."""
    stop = self.preemption.should_stop(step) and step < last  # every process asks at every step (preemption.py)
    if stop or (every and step % every == 0 and step < last):
      save(step)
    if stop:
      self.ckpt.wait()
      raise Preempted(what, step, self.ckpt.folder)

  def close(self) -> None:
    self.preemption.close()
    try:
      self.ckpt.close()  # waits for the last checkpoint to commit, so the lock outlives every write
    finally:
      self.lock.release()

  def __enter__(self) -> RunFolder:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class Run(RunFolder):
  """The RL loop's run folder: a `RunFolder` keeping `cfg.keep_checkpoints` steps, whose step is the iteration."""

  def __init__(self, cfg: RLConfig, config: Any, out_dir: str):
    super().__init__(config, out_dir, cfg.keep_checkpoints, checkpoint_folder(cfg))
    self.cfg = cfg
    try:
      self.check_last(cfg.iterations, "iterations")
    except BaseException:
      self.close()
      raise


def eval_row(iteration: int, counts: dict[str, int], result: dict[str, Any]) -> dict[str, Any]:
  """An evaluation without its per-task outcomes (those go to evals.jsonl only)."""
  row = {"iteration": iteration, **counts, **{k: v for k, v in result.items() if k not in ("outcomes", "sampled")}}
  if "sampled" in result:
    row["sampled"] = {k: v for k, v in result["sampled"].items() if k != "outcomes"}
  return row


def run_iterations(run: Run, learner: PolicyLearner, tasks: TaskSource, env: BatchEnv, *, eval_env: BatchEnv,
                   eval_tasks: Sequence[Task], model_folder: Path, hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Trains for `run.cfg.iterations` iterations (resuming where the run's checkpoint ended), evaluates, checkpoints,
  saves the final policy; returns the summary (also summary.json)."""
  cfg, out = run.cfg, run.out
  kind = "synthetic_transitions" if getattr(env, "synthetic", False) else "real_transitions"
  counts = {"real_transitions": 0, "synthetic_transitions": 0}
  evals: list[dict[str, Any]] = []
  train_curve: list[tuple[int, int, float]] = []  # (iteration, transitions of the env's kind, rollout success)
  if run.resume is not None:
    # The hooks and the tracker were built from this step's meta: an unreadable step restarts the whole command.
    arrays, meta = run.restore(_arrays(learner, hooks))
    learner.load_checkpoint_arrays(arrays)
    for hook in hooks:
      hook.restore(arrays, meta)
    counts = {k: int(meta.get(k, 0)) for k in counts}
    evals, train_curve = list(meta["evals"]), [tuple(r) for r in meta["train_curve"]]
  first = run.resume or 0
  title = ("DreamGym " if kind == "synthetic_transitions" else "") + f"{cfg.algorithm.upper()} on {cfg.env}"
  with run.tracker(cfg.track) as tracker:
    evals_path = out / "evals.jsonl" if tracker.primary else Path(os.devnull)  # one process writes the files
    if run.resume is None:
      evals_path.write_text("")
    elif tracker.primary:  # evaluations logged after the checkpoint are run again
      truncate_jsonl(evals_path, lambda row: row["iteration"] <= run.resume)

    def plots() -> None:
      if tracker.primary:
        learning_curve(evals, out / "learning_curve.svg", train=train_curve, transitions=kind,
                       title=f"{title}: held-out success (95% CI)")
        tracker.plot_metrics(CURVES, title=f"{title}: training")

    def do_eval(iteration: int) -> None:
      result = learner.evaluate(eval_env, list(eval_tasks))
      row = eval_row(iteration, counts, result)
      evals.append(row)
      outcomes = {"outcomes": result["outcomes"]}
      if "sampled" in result:
        outcomes["sampled_outcomes"] = result["sampled"]["outcomes"]
      with open(evals_path, "a", encoding="utf-8") as f:
        f.write(json_dumps({**row, **outcomes}, sort_keys=True) + "\n")
      tracker.log(iteration, {"eval": row}, jsonl=False)
      sampled = row.get("sampled")
      echo(f"eval @ iteration {iteration} ({counts[kind]} {kind.replace('_', ' ')}): greedy success "
           f"{row['success_rate']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]" +
           (f", sampled {sampled['success_rate']:.3f} [{sampled['ci_low']:.3f}, {sampled['ci_high']:.3f}]"
            if sampled else "") + f" over {row['episodes']} tasks")

    def checkpoint(iteration: int) -> None:
      meta = {"iteration": iteration, **counts, "evals": evals, "train_curve": train_curve}
      for hook in hooks:
        meta |= hook.checkpoint_meta()
      run.save(iteration, _arrays(learner, hooks), meta, tracker)
      plots()

    budget = cfg.max_real_transitions if kind == "real_transitions" else cfg.max_synthetic_transitions

    def spent() -> bool:
      return bool(budget) and counts[kind] >= budget

    if run.resume is None:
      do_eval(0)
    last = first
    with progress(cfg.iterations, out.name, initial=first, unit="iter", enabled=cfg.track.progress and tracker.primary
                  ) as bar:
      for it in range(first, cfg.iterations):
        if spent():  # a resumed run whose budget ran out before its last checkpoint
          break
        last = it + 1
        for hook in hooks:
          hook.before_iteration(it)
        left = budget - counts[kind] if budget else 0
        metrics, traj = learner.iteration(env, tasks.draw(it), it, max_env_steps=left)
        counts[kind] += metrics["env_steps"]
        for hook in hooks:
          metrics.update(hook.after_iteration(it, traj, metrics))
        metrics.update(counts)
        tracker.log(it + 1, metrics)
        train_curve.append((it + 1, counts[kind], metrics["rollout_success"]))
        bar.update()
        update = f"loss {metrics['loss']:.4f}" if "loss" in metrics else "no update (no group with unequal returns)"
        pool = (f", generated tasks in batch {metrics['batch_generated_frac']:.2f}, pool {metrics['pool_tasks']}"
                if "pool_tasks" in metrics else "")
        echo(f"iteration {it + 1}: {update}, rollout success {metrics['rollout_success']:.3f}, zero-variance groups "
             f"{metrics['zero_variance_group_frac']:.2f}{pool} ({metrics['iteration_s']:.1f} s)")
        final = it + 1 == cfg.iterations or spent()
        if (cfg.eval_every and (it + 1) % cfg.eval_every == 0) or final:
          do_eval(it + 1)
        if final:
          checkpoint(it + 1)
          break
        run.after_step(it + 1, cfg.iterations, cfg.checkpoint_every, checkpoint, f"{title} in {out}")
    exported = save_model(learner.params, learner.model_cfg, model_folder, export_folder(cfg, "final"),
                          dtype=export_dtype(learner.cfg))  # every process: gathers
    summary = {"algorithm": cfg.algorithm, "iterations": last, **counts, "initial": evals[0], "final": evals[-1],
               "evals": evals}
    for hook in hooks:
      summary |= hook.finish(out)
    summary |= {"seconds": run.elapsed(), "checkpoint": str(exported), "resumed_from": run.resume,
                "run_id": tracker.run_id}
    tracker.summary(summary)
    plots()
  return summary


def _arrays(learner: PolicyLearner, hooks: Sequence[Hook]) -> dict[str, Any]:
  arrays = learner.checkpoint_arrays()
  for hook in hooks:
    arrays |= hook.checkpoint_arrays()
  return arrays
