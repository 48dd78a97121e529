"""`dreamjax reproduce`: the paper's comparison end to end, stage by stage, into one run folder, then its table.

Stages (each the library's own command on a sub-config, its paths rewired into `out_dir`):
  data/        offline trajectories from the real env (`collect`)
  exp_model/   M_exp trained on them (`train-exp`); exp_model_no_reasoning/ for that ablation
  sft/         the policy SFT baseline and everyone's warm start (`train-policy`)
  dpo/         DPO from the SFT policy (`dpo`), when configured
  real_<alg>/seed<s>/       PPO/GRPO against the real env from the SFT policy (`rl`)
  dreamgym_<alg>/seed<s>/   DreamGym from the SFT policy (`dreamgym`); ablations as dreamgym_grpo_<ablation>/
  s2r_<alg>/seed<s>/        DreamGym-S2R: real-env RL from the DreamGym policy with a real-transition budget
Every final policy is then evaluated by `dreamjax eval` with the same `eval` settings (same held-out tasks, greedy,
optionally sampled), so the rows differ only by how the policy was trained. A stage whose summary.json (eval.json for
evaluations) exists is reused: rerunning after a crash or with more seeds redoes only what is missing.

The table (results.md, results.json, results.svg) has per method: offline real transitions behind it (the collected
data: every method starts from the SFT policy trained on it, and DreamGym's M_exp learns from it too), online real transitions spent in training, synthetic transitions,
held-out success as the mean over seeds with a 95% Wilson interval over all its episodes and the per-seed rates,
the training wall time (the cost comparison), and for rows trained in an M_exp its held-out fidelity (`exp_columns`).
Under it, the paper's four result shapes as this table measures them (dreamjax.loop.results.shapes; results.json
keeps them under `shapes`): each a paired comparison of two rows on the same held-out tasks and seeds.
data_efficiency.svg is the paper's data-efficiency figure: held-out success against the online real transitions spent,
for real-env RL, DreamGym and S2R, from the loops' own periodic evaluations pooled over seeds (`efficiency_curve`;
results.json keeps the points).

Several processes (a command started on every worker of a pod): `run` first joins them with its own `distributed`
section (set it there: the stages' `start_run` then finds the processes joined and does not read the stage sections'),
then runs every stage on every process, each stage multi-process safe by itself (`collect` on process 0
while the others wait; the training and evaluation commands as one program over all processes). Process 0 alone
writes this command's own files (config.json, results.json, results.md, results.svg); after each stage every process
meets at a barrier, so all read the stage's summary once it is written and all agree on which stages to reuse.

Run: `dreamjax reproduce --config configs/reproduce_twx.py[:tiny]`; `make demo` runs configs/demo.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dreamjax.commands.dpo import DpoConfig
from dreamjax.commands.dreamgym import DreamGymConfig
from dreamjax.commands.eval import EvalRunConfig
from dreamjax.commands.train_exp import ExpSftConfig
from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.data.collect import CollectConfig
from dreamjax.data.jsonl import read_jsonl
from dreamjax.data.records import read_trajectory_files
from dreamjax.loop.evaluate import EvalConfig, wilson_interval
from dreamjax.loop.learner import RLConfig, TaskSpec, as_ppo
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.plots import data_efficiency, success_bars
from dreamjax.loop.results import ABLATIONS, ablation_method, budget_text, shapes, shapes_table
from dreamjax.loop.track import TrackConfig, json_dumps, to_json
from dreamjax.parallel import DistributedConfig, barrier, from_primary, initialize, is_primary
from dreamjax.rollout.agent import AgentFormat

@dataclasses.dataclass(frozen=True)
class Budgets:
  """Real transitions each method may use, and DreamGym's synthetic ones; 0: no cap. The paper's (Table 1): SFT 20K
  offline, DPO 40K offline, real-env RL 80K online, DreamGym-S2R 5K online, DreamGym 0 online (its synthetic count is
  not reported). Offline caps take whole episodes of the collected data in file order (`read_trajectory_files`);
  online caps are exact: the run's last iteration is cut to what remains (`RLConfig.max_real_transitions`,
  `max_synthetic_transitions`)."""

  sft: int = 0  # offline: the SFT policy's demonstrations, everyone's warm start
  dpo: int = 0  # offline: DPO's preference pairs
  real_rl: int = 0  # online: real-env PPO/GRPO
  s2r: int = 0  # online: DreamGym-S2R's real-env phase; 0: no S2R rows
  # DreamGym's synthetic transitions, every DreamGym row and ablation (0: its iterations decide). Set to real_rl so
  # that the DreamGym and real-env rows learn from as many transitions: the comparison shape (a) makes.
  synthetic_rl: int = 0

  def __post_init__(self):
    bad = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 0]
    if bad:
      raise ValueError(f"ReproduceConfig.budgets.{bad[0]} must be >= 0, got {getattr(self, bad[0])}")


@dataclasses.dataclass(frozen=True)
class ReproduceConfig:
  collect: CollectConfig = CollectConfig()
  exp: ExpSftConfig = ExpSftConfig()
  sft: PolicySftConfig = PolicySftConfig()
  dpo: DpoConfig | None = None
  real: RLConfig | None = None  # the real-env GRPO baseline's settings (PPO rows take `ppo`'s algorithm settings)
  # PPO's own settings (objective, optimisers, epochs, critic, GAE: ALGORITHM_FIELDS) for every PPO row; the row keeps
  # its env, tasks, agent format, rollout and budgets. None: `as_ppo` on the row's GRPO config.
  ppo: RLConfig | None = None
  dreamgym: DreamGymConfig | None = None
  algorithms: tuple[str, ...] = ("grpo",)  # run for real-env RL, DreamGym and S2R
  budgets: Budgets = Budgets()
  ablations: tuple[str, ...] = ()  # DreamGym GRPO without one component each (ABLATIONS)
  eval: EvalRunConfig = EvalRunConfig()  # the common final evaluation (its checkpoint and out_dir are set per row)
  seeds: tuple[int, ...] = (0,)
  # The policy backbone's name in merged tables (`dreamjax tables`); "": the SFT checkpoint folder's name, or "tiny".
  backbone: str = ""
  out_dir: str = "runs/reproduce"
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs, for every stage (module docstring)

  def __post_init__(self):
    unknown = [a for a in self.algorithms if a not in ("grpo", "ppo")] + [a for a in self.ablations
                                                                         if a not in ABLATIONS]
    if unknown:
      raise ValueError(f"ReproduceConfig: unknown algorithm or ablation {unknown[0]!r} (algorithms: grpo, ppo; "
                       f"ablations: {', '.join(ABLATIONS)})")
    if not self.seeds:
      raise ValueError("ReproduceConfig: at least one seed")
    if (self.ablations or self.budgets.s2r) and self.dreamgym is None:
      raise ValueError("ReproduceConfig: ablations and S2R need the dreamgym section")
    # Every row must be trained and scored on one environment; a section left on another one is a config slip.
    envs = {"collect": self.collect.env, "sft": self.sft.env, "dpo": self.dpo and self.dpo.env,
            "real": self.real and self.real.env, "dreamgym.rl": self.dreamgym and self.dreamgym.rl.env}
    wrong = {k: v for k, v in envs.items() if v is not None and v != self.eval.env}
    if wrong:
      raise ValueError(f"ReproduceConfig: eval.env is {self.eval.env!r} but {', '.join(f'{k}.env is {v!r}' for k, v in wrong.items())}; "
                       f"point every stage at one env (dreamjax.commands.reproduce.on_env does)")
    # Every stage and seed gets a folder of its own under out_dir; one checkpoint_dir or export_dir would be shared.
    stages = {"exp": self.exp, "sft": self.sft, "dpo": self.dpo, "real": self.real,
              "dreamgym.rl": self.dreamgym and self.dreamgym.rl}
    for name, stage in stages.items():
      for field in ("checkpoint_dir", "export_dir"):
        if stage is not None and getattr(stage, field):
          raise ValueError(f"ReproduceConfig: {name}.{field} must be empty: reproduce puts each stage's checkpoints "
                           f"and model in the stage's own folder under out_dir")


def on_env(cfg: ReproduceConfig, *, env: str, env_kwargs: tuple[str, ...], agent: AgentFormat,
           rollout: dict[str, Any], train: TaskSpec, held_out: TaskSpec) -> ReproduceConfig:
  """`cfg` with every stage on one environment: the offline data and RL draw from `train`, every evaluation (SFT's
  and DPO's progress checks, the RL loops' periodic ones, the final common one) from `held_out`; all policies see the
  same `agent` prompt layout; `rollout` replaces the env-dependent budgets (turns, tokens, prompt buckets) in each
  section's own rollout settings, so the RL group size and temperature stay as they were."""
  def sft_eval(e: EvalConfig) -> EvalConfig:
    return dataclasses.replace(e, games=held_out.games, split=held_out.split, task_start=held_out.start,
                               game_params=held_out.game_params)

  def policy(c):  # the fields PolicySftConfig, DpoConfig, RLConfig and EvalRunConfig share
    return dataclasses.replace(c, env=env, env_kwargs=env_kwargs, agent=agent,
                               rollout=dataclasses.replace(c.rollout, **rollout))

  def rl(c: RLConfig) -> RLConfig:
    return dataclasses.replace(policy(c), train_tasks=train, eval_tasks=dataclasses.replace(
        held_out, count=min(held_out.count, c.eval_tasks.count)))

  return dataclasses.replace(
      cfg,
      collect=dataclasses.replace(cfg.collect, env=env, env_kwargs=env_kwargs, games=train.games, split=train.split,
                                  task_start=train.start, game_params=train.game_params),
      sft=dataclasses.replace(policy(cfg.sft), eval=sft_eval(cfg.sft.eval)),
      dpo=cfg.dpo and dataclasses.replace(policy(cfg.dpo), eval=sft_eval(cfg.dpo.eval)),
      real=cfg.real and rl(cfg.real),
      dreamgym=cfg.dreamgym and dataclasses.replace(cfg.dreamgym, rl=rl(cfg.dreamgym.rl)),
      eval=dataclasses.replace(policy(cfg.eval), tasks=held_out))


def for_slow_env(cfg: ReproduceConfig, *, iterations: int, group_size: int, check_tasks: int,
                 micro_batches: int) -> ReproduceConfig:
  """`cfg` cut for an env whose steps cost seconds (ALFWorld, MiniWoB on a CPU): shorter RL runs (2 tasks x
  `group_size` per iteration), the stages' own progress checks on `check_tasks` held-out tasks (the common final
  evaluation keeps its count, greedy only), and the update split into `micro_batches` (long turn rows)."""
  def rl(c: RLConfig) -> RLConfig:
    return dataclasses.replace(c, tasks_per_iteration=2, iterations=iterations, micro_batches=micro_batches,
                               rollout=dataclasses.replace(c.rollout, group_size=group_size),
                               eval_tasks=dataclasses.replace(c.eval_tasks, count=check_tasks))

  return dataclasses.replace(
      cfg, sft=dataclasses.replace(cfg.sft, eval=dataclasses.replace(cfg.sft.eval, num_tasks=check_tasks)),
      dpo=cfg.dpo and dataclasses.replace(cfg.dpo, eval=dataclasses.replace(cfg.dpo.eval, num_tasks=check_tasks)),
      real=cfg.real and rl(cfg.real), dreamgym=cfg.dreamgym and dataclasses.replace(cfg.dreamgym, rl=rl(cfg.dreamgym.rl)),
      eval=dataclasses.replace(cfg.eval, sampled=False))


def at_test_size(cfg: ReproduceConfig, *, policies: tuple[str, ...], out_dir: str) -> ReproduceConfig:
  """A testbed's every stage at test size (the collectors' `policies`, a few steps, 2 RL iterations of 2 tasks, one
  seed, the reasoning ablation only): it checks that the stages fit together, not what they measure."""
  def rl(c: RLConfig) -> RLConfig:
    return dataclasses.replace(c, iterations=2, eval_every=0, tasks_per_iteration=2,
                               eval_tasks=dataclasses.replace(c.eval_tasks, count=4))

  def steps(optim):
    return dataclasses.replace(optim, warmup_steps=2, total_steps=20)

  return dataclasses.replace(
      cfg,
      collect=dataclasses.replace(cfg.collect, policies=policies),
      sft=dataclasses.replace(cfg.sft, max_steps=20, optim=steps(cfg.sft.optim),
                              eval=dataclasses.replace(cfg.sft.eval, num_tasks=4, every_steps=0)),
      dpo=dataclasses.replace(cfg.dpo, eval=dataclasses.replace(cfg.dpo.eval, num_tasks=4), epochs=1),
      exp=dataclasses.replace(cfg.exp, steps=20, optim=steps(cfg.exp.optim)),
      real=rl(cfg.real),
      dreamgym=dataclasses.replace(cfg.dreamgym, rl=rl(cfg.dreamgym.rl)),
      ablations=("no_reasoning",),
      budgets=Budgets(sft=100, dpo=200, real_rl=400, s2r=25, synthetic_rl=400),
      eval=dataclasses.replace(cfg.eval, tasks=dataclasses.replace(cfg.eval.tasks, count=8)),
      seeds=(0,),
      out_dir=out_dir,
  )


# The fields that make a run PPO rather than GRPO: what a PPO row takes from `ReproduceConfig.ppo`.
ALGORITHM_FIELDS = ("algorithm", "objective", "critic", "advantage", "gamma", "lam", "step_advantage_weight",
                    "normalize_std", "whiten_advantages", "drop_zero_variance_groups", "optim", "epochs")


def as_algorithm(rl: RLConfig, algorithm: str, ppo: RLConfig | None) -> RLConfig:
  """The row's RL config (a GRPO config) for `algorithm`: GRPO as given; PPO with `ppo`'s algorithm settings (or
  `as_ppo`'s when None), so PPO rows run PPO's own objective, optimisers, epochs and critic rather than GRPO's."""
  if rl.algorithm != "grpo":
    raise ValueError(f"ReproduceConfig: the real and dreamgym.rl sections must be GRPO configs (got {rl.algorithm!r}); "
                     f"PPO rows take their settings from `ppo`")
  if algorithm == "grpo":
    return rl
  source = ppo if ppo is not None else as_ppo(rl)
  return dataclasses.replace(rl, **{f: getattr(source, f) for f in ALGORITHM_FIELDS})


def tracked(c: Any, group: str, job_type: str, name: str) -> Any:
  """Stage config `c` named for W&B: the reproduce folder is the group, the command the job type, the method and seed
  the run name ("real_grpo-seed1"); what the config already sets wins."""
  def named(t: TrackConfig) -> TrackConfig:
    return dataclasses.replace(t, group=t.group or group, job_type=t.job_type or job_type, name=t.name or name)

  if isinstance(c, DreamGymConfig):
    return dataclasses.replace(c, rl=dataclasses.replace(c.rl, track=named(c.rl.track)))
  return dataclasses.replace(c, track=named(c.track))


def _stage(folder: Path, marker: str, fn: Callable[[], Any]) -> dict[str, Any]:
  """Runs `fn` unless `folder/marker` exists (a finished earlier run); returns that file's contents. With several
  processes, process 0's view decides: the others could see the marker of a short stage process 0 already finished,
  skip it and its collectives, and leave process 0 waiting in them."""
  path = folder / marker
  if not from_primary(path.is_file()):
    print(f"== {folder}", flush=True)
    fn()
    barrier(f"reproduce {folder}")  # process 0 writes the marker last; every process reads it
  return json.loads(path.read_text())


def run(cfg: ReproduceConfig) -> dict[str, Any]:
  out = Path(cfg.out_dir)
  initialize(cfg.distributed)  # once, before the lock (process 0 alone takes it) and before any stage
  with lock_run_folder(out):  # once: every stage locks its own subfolder, a folder of its own
    return _reproduce(cfg, out)


def _reproduce(cfg: ReproduceConfig, out: Path) -> dict[str, Any]:
  from dreamjax.commands import dpo, dreamgym, rl, train_exp, train_policy
  from dreamjax.commands import eval as eval_run
  from dreamjax.commands.collect import run as collect

  if is_primary():  # the one writer of the run folder
    (out / "config.json").write_text(json_dumps(to_json(cfg), indent=2, sort_keys=True))
  t0 = time.perf_counter()
  data = out / "data" / "trajectories.jsonl"
  _stage(out / "data", "summary.json", lambda: collect(dataclasses.replace(cfg.collect, out_dir=str(out / "data"))))
  budgets = cfg.budgets

  def offline(cap: int = 0, episodes: int = 0) -> int:
    """Real transitions in the collected data a stage reads under its caps (they all read prefixes of one file)."""
    return sum(r.num_steps for r in read_trajectory_files([data], max_episodes=episodes, max_transitions=cap))

  n_sft, n_exp = offline(budgets.sft), offline(episodes=cfg.exp.max_episodes)

  exp_fidelity: dict[str, dict[str, Any]] = {}  # M_exp checkpoint -> its held-out fidelity (`exp_columns`)

  def exp_model(name: str, **fmt) -> str:
    exp = tracked(dataclasses.replace(cfg.exp, trajectories=(str(data),), out_dir=str(out / name),
                                      format=dataclasses.replace(cfg.exp.format, **fmt)), out.name, "train-exp", name)
    summary = _stage(out / name, "summary.json", lambda: train_exp.run(exp))
    exp_fidelity[summary["checkpoint"]] = exp_columns(summary)
    return summary["checkpoint"]

  sft_cfg = tracked(dataclasses.replace(cfg.sft, data=(str(data),), data_transitions=budgets.sft,
                                       out_dir=str(out / "sft")), out.name, "train-policy", "sft")
  sft = _stage(out / "sft", "summary.json", lambda: train_policy.run(sft_cfg))["checkpoint"]
  rows: list[dict[str, Any]] = []
  outcomes: dict[str, list[tuple[int, list]]] = {}  # method -> each run's greedy held-out outcomes (`shapes`)

  def add_row(method: str, runs: list[tuple[Path, dict[str, Any]]], offline_n: int, budget: dict[str, Any],
              exp: str = "") -> None:
    """Evaluates each seed's final policy with the common settings and appends the method's row; `exp`: the M_exp
    checkpoint its policy trained in, whose fidelity the row shows."""
    evals = []
    for folder, summary in runs:
      ev = dataclasses.replace(cfg.eval, checkpoint=summary["checkpoint"], out_dir=str(folder / "eval"))
      evals.append(_stage(folder / "eval", "eval.json", lambda ev=ev: eval_run.run(ev)))
    outcomes[method] = list(enumerate(e["outcomes"] for e in evals))  # runs in seed order: index i is seed i's
    rows.append(row(method, runs, evals, offline_n, budget) | {"exp_model": exp_fidelity.get(exp)})

  add_row("SFT", [(out / "sft", {"checkpoint": sft, "seconds": _seconds(out / "sft")})], n_sft,
          {"kind": "offline", "cap": budgets.sft or None, "spent": n_sft})
  if cfg.dpo is not None:
    n_dpo = offline(budgets.dpo)
    dpo_cfg = tracked(dataclasses.replace(cfg.dpo, data=(str(data),), data_transitions=budgets.dpo, checkpoint=sft,
                                          out_dir=str(out / "dpo")), out.name, "dpo", "dpo")
    add_row("DPO", [(out / "dpo", _stage(out / "dpo", "summary.json", lambda: dpo.run(dpo_cfg)))],
            max(n_sft, n_dpo), {"kind": "offline", "cap": budgets.dpo or None, "spent": n_dpo})

  def seeds(name: str, make: Callable[[int, Path], Any], runner: Callable[[Any], Any]) -> list:
    runs = []
    for s in cfg.seeds:
      folder = out / name / f"seed{s}"
      c = make(s, folder)
      c = tracked(c, out.name, "dreamgym" if isinstance(c, DreamGymConfig) else "rl", f"{name}-seed{s}")
      runs.append((folder, _stage(folder, "summary.json", lambda c=c: runner(c))))
    return runs

  def online(cap: int | None) -> dict[str, Any]:
    return {"kind": "online", "cap": cap}  # spent: the runs' mean real transitions (`row`)

  def real_rl(alg: str, checkpoint: str, s: int, folder: Path, budget: int) -> RLConfig:
    rl = as_algorithm(cfg.real, alg, cfg.ppo)
    return dataclasses.replace(rl, model=dataclasses.replace(rl.model, checkpoint=checkpoint), seed=s,
                               out_dir=str(folder), max_real_transitions=budget)

  if cfg.real is not None:
    for alg in cfg.algorithms:
      add_row(f"{alg.upper()} (real env)",
              seeds(f"real_{alg}", lambda s, f, alg=alg: real_rl(alg, sft, s, f, budgets.real_rl), rl.run), n_sft,
              online(budgets.real_rl or None))

  def dream(alg: str, s: int, folder: Path, exp: str, **kw) -> DreamGymConfig:
    d = cfg.dreamgym
    rl = dataclasses.replace(as_algorithm(d.rl, alg, cfg.ppo), model=dataclasses.replace(d.rl.model, checkpoint=sft),
                             seed=s, max_synthetic_transitions=budgets.synthetic_rl)
    return dataclasses.replace(d, rl=rl, exp_model=exp, offline_data=(str(data),), out_dir=str(folder), **kw)

  if cfg.dreamgym is not None:
    exp = exp_model("exp_model")
    dream_offline = max(n_sft, n_exp)  # the warm start's demonstrations and M_exp's training data
    dream_runs = {}
    for alg in cfg.algorithms:
      dream_runs[alg] = seeds(f"dreamgym_{alg}", lambda s, f, alg=alg: dream(alg, s, f, exp), dreamgym.run)
      add_row(f"DreamGym {alg.upper()}", dream_runs[alg], dream_offline, online(0), exp)
    if budgets.s2r:
      for alg in cfg.algorithms:
        starts = {s: summary["checkpoint"] for s, (_, summary) in zip(cfg.seeds, dream_runs[alg])}
        add_row(f"DreamGym-S2R {alg.upper()}",
                seeds(f"s2r_{alg}", lambda s, f, alg=alg, starts=starts: real_rl(alg, starts[s], s, f, budgets.s2r),
                      rl.run), dream_offline, online(budgets.s2r), exp)  # S2R rows exist only with a budget
    for ablation in cfg.ablations:
      exp_ab, kw = ablated(cfg, ablation, exp, exp_model)
      add_row(ablation_method(ablation),
              seeds(f"dreamgym_grpo_{ablation}", lambda s, f, kw=kw, e=exp_ab: dream("grpo", s, f, e, **kw),
                    dreamgym.run), dream_offline, online(0), exp_ab)

  # The data-efficiency figure: the RL rows but the ablations, which spend no online real transitions either and
  # would only add lines at 0 (the table compares them).
  ablations = {ablation_method(a) for a in cfg.ablations}
  efficiency = {r["method"]: efficiency_curve(r["folders"]) for r in rows
                if r["budget"]["kind"] == "online" and r["method"] not in ablations}
  shown = shapes(rows, outcomes)
  result = {"env": cfg.eval.env, "backbone": backbone_name(cfg), "rows": rows, "seeds": list(cfg.seeds),
            "offline_transitions": offline(), "budgets": to_json(budgets), "eval": to_json(cfg.eval.tasks),
            "efficiency": efficiency, "shapes": shown, "seconds": time.perf_counter() - t0}
  text = table(rows, cfg) + (f"\n\n{shapes_table(shown)}" if shown else "")
  if is_primary():
    (out / "results.json").write_text(json_dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(text + "\n")
    success_bars(rows, out / "results.svg")
    data_efficiency(efficiency, out / "data_efficiency.svg",
                    title=f"{cfg.eval.env}: held-out success (95% CI) by real transitions")
  print(text, flush=True)
  return result


def ablated(cfg: ReproduceConfig, ablation: str, exp: str, exp_model: Callable[..., str]
            ) -> tuple[str, dict[str, Any]]:
  """(the M_exp checkpoint, DreamGymConfig overrides) of an ablation row (ABLATIONS)."""
  curriculum = cfg.dreamgym.curriculum
  if ablation == "no_replay":  # its own M_exp, trained without retrieved transitions in its prompts
    return exp_model("exp_model_no_replay", retrieval=False), {"replay": False}
  if ablation == "no_reasoning":  # its own M_exp, trained to predict without a reasoning trace
    if not cfg.exp.format.reasoning:
      raise ValueError("ReproduceConfig: the no_reasoning ablation needs exp.format.reasoning=true for the full M_exp")
    return exp_model("exp_model_no_reasoning", reasoning=False), {"reasoning": False}
  if ablation == "no_task_generation":  # curriculum selection on, M_task off
    return exp, {"curriculum": dataclasses.replace(curriculum, generate_every=0)}
  return exp, {"curriculum": dataclasses.replace(curriculum, enabled=False)}  # no_curriculum: uniform seed tasks


EXP_COLUMNS = ("exact_match", "exact_match_determined", "eps_R_mean", "eps_P_tf_mean")  # `exp_columns`


def exp_columns(summary: dict[str, Any]) -> dict[str, Any]:
  """What the table shows of an M_exp (its train-exp summary's held-out fidelity): one-step exact match, also on the
  transitions its prompt determines, and the paper's error terms eps_R (mean |r - r_hat|) and eps_P (the
  teacher-forced TV bound, mean), as dreamjax.experience.fidelity defines them. Missing values are None."""
  m = (summary.get("held_out_fidelity") or {}).get("model") or {}
  return {k: m.get(k) for k in EXP_COLUMNS}


def backbone_name(cfg: ReproduceConfig) -> str:
  return cfg.backbone or (Path(cfg.sft.model.checkpoint).name if cfg.sft.model.checkpoint else "tiny")


def _seconds(folder: Path) -> float | None:
  path = folder / "summary.json"
  if not path.is_file():
    return None
  s = json.loads(path.read_text())
  return s.get("seconds") or s.get("train_seconds")


# Per-iteration costs the RL loops log (metrics.jsonl), summed over a run: seconds inside the environment's step and
# reset (the real env, or M_exp decoding plus retrieval for DreamGym), in the policy update, and tokens the policy
# sampled. They split the wall time into what the real env costs and what the model costs.
COSTS = {"env_s": "env_s", "update_s": "update_s", "policy_tokens": "sampled_tokens"}


def run_costs(folder: Path) -> dict[str, float]:
  path = folder / "metrics.jsonl"
  totals = dict.fromkeys(COSTS, 0.0)
  if path.is_file():
    for _, values in read_jsonl(path):
      for name, key in COSTS.items():
        totals[name] += float(values.get(key, 0.0))
  return totals


def row(method: str, runs: list[tuple[Path, dict[str, Any]]], evals: list[dict[str, Any]], offline: int,
        budget: dict[str, Any]) -> dict[str, Any]:
  """A method's table row. `budget`: {"kind": "offline" | "online", "cap": transitions (None: no cap), "spent"
  (offline rows: transitions read)}; an online row's spend is its runs' mean real transitions."""
  successes, episodes = sum(e["successes"] for e in evals), sum(e["episodes"] for e in evals)
  costs = [run_costs(folder) for folder, _ in runs]
  low, high = wilson_interval(successes, episodes)
  per_seed = [e["success_rate"] for e in evals]
  sampled = [e["sampled"]["success_rate"] for e in evals if "sampled" in e]
  seconds = [s.get("seconds") for _, s in runs if s.get("seconds") is not None]
  real = int(sum(s.get("real_transitions", 0) for _, s in runs) / len(runs))
  budget = {"spent": real, **budget}
  return {"method": method, "budget": budget, "offline_transitions": offline, "real_transitions": real,
          "synthetic_transitions": int(sum(s.get("synthetic_transitions", 0) for _, s in runs) / len(runs)),
          "success_rate": successes / episodes, "ci_low": low, "ci_high": high, "per_seed": per_seed,
          "sampled_success_rate": sum(sampled) / len(sampled) if sampled else None,
          "seconds": sum(seconds) / len(seconds) if seconds else None, "folders": [str(f) for f, _ in runs],
          **{name: sum(c[name] for c in costs) / len(costs) for name in COSTS}}


def efficiency_curve(folders: list[str]) -> list[dict[str, Any]]:
  """A method's held-out success at each periodic evaluation its RL loops ran (evals.jsonl: the start, every
  `eval_every` iterations, the end), pooled over its seeds at the iterations every seed evaluated: the seeds' mean
  online real transitions spent by then, and the success over all their episodes with its 95% Wilson interval."""
  by_seed = []
  for folder in folders:
    path = Path(folder) / "evals.jsonl"
    by_seed.append({e["iteration"]: e for _, e in read_jsonl(path)} if path.is_file() else {})
  points = []
  for it in sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else ():
    evals = [s[it] for s in by_seed]
    successes, episodes = sum(e["successes"] for e in evals), sum(e["episodes"] for e in evals)
    low, high = wilson_interval(successes, episodes)
    points.append({"iteration": it, "real_transitions": sum(e["real_transitions"] for e in evals) / len(evals),
                   "success_rate": successes / episodes, "ci_low": low, "ci_high": high, "episodes": episodes})
  return points


def table(rows: list[dict[str, Any]], cfg: ReproduceConfig) -> str:
  tasks = cfg.eval.tasks
  head = (f"Held-out success on {tasks.count} {cfg.eval.env} tasks per game ({', '.join(tasks.games)}, split "
          f"{tasks.split}{', ' + tasks.game_params if tasks.game_params else ''}), greedy, one episode per task; "
          f"mean over seeds {list(cfg.seeds)} with a 95% Wilson interval over all their episodes. Budget: the real "
          f"transitions the method may use (offline data, or online interaction; - : no cap) and what it spent (per "
          f"seed). Offline: real transitions in the collected data the method learns from (SFT's warm start, and for "
          f"DreamGym M_exp's training data); online: real transitions spent in training (per seed). Cost per seed: "
          f"training wall time, of it the seconds inside the environment (the real env, or M_exp and retrieval for "
          f"DreamGym) and in the policy update, and the tokens the policy sampled; S2R rows count their real-env "
          f"phase only (add the DreamGym row above them). M_exp (rows trained in one): its held-out one-step exact "
          f"match, on the transitions its prompt determines (dreamjax.experience.fidelity), eps_R and eps_P.")
  sampled = any(r["sampled_success_rate"] is not None for r in rows)
  exp = any(r.get("exp_model") for r in rows)
  lines = [head, "", "| method | budget | spent | offline real | online real | synthetic | success [95% CI] | "
           "per seed |" + (" sampled |" if sampled else "") + " seconds | env s | update s | policy tokens |"
           + (" M_exp EM | EM determined | eps_R | eps_P |" if exp else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|" if sampled else "") + "---|---|---|---|"
           + ("---|---|---|---|" if exp else "")]
  for r in rows:
    cells = [r["method"], budget_text(r["budget"]), str(r["budget"]["spent"]), str(r["offline_transitions"]),
             str(r["real_transitions"]), str(r["synthetic_transitions"]),
             f"{r['success_rate']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
             ", ".join(f"{x:.3f}" for x in r["per_seed"])]
    if sampled:
      cells.append("" if r["sampled_success_rate"] is None else f"{r['sampled_success_rate']:.3f}")
    cells.append("" if r["seconds"] is None else f"{r['seconds']:.0f}")
    cells += [f"{r['env_s']:.0f}", f"{r['update_s']:.0f}", f"{r['policy_tokens']:.0f}"]
    if exp:
      m = r.get("exp_model") or {}
      cells += ["" if m.get(k) is None else f"{m[k]:.3f}" for k in EXP_COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)

