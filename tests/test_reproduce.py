"""`dreamjax reproduce` through the CLI on `make demo`'s own config, cut to a few steps per stage (the end-to-end test
is slow: `pytest -m slow tests/test_reproduce.py`): every stage runs and lands in its folder, the common evaluation
scores every row on the same tasks, S2R stops at its real-transition budget, the table is written, and a rerun reuses
every finished stage."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dreamjax.cli import main
from dreamjax.config import load_config
from tools import bank_run

pytest.importorskip("textworld_express")

SMALL = ["collect.policies=expert:12,random:4", "exp.steps=8", "exp.max_len=512", "sft.max_steps=40",
         "sft.eval.num_tasks=2", "sft.eval.num_envs=2", "eval.tasks.count=4", "eval.batch=4", "eval.sampled=false",
         "budgets.s2r=1"]
for _rl in ("real", "dreamgym.rl"):
  SMALL += [f"{_rl}.iterations=2", f"{_rl}.tasks_per_iteration=2", f"{_rl}.rollout.group_size=2",
            f"{_rl}.eval_tasks.count=2", f"{_rl}.rows_per_step=16", f"{_rl}.eval_batch=4"]
SMALL += ["dreamgym.curriculum.generate_every=1", "dreamgym.curriculum.max_new_tokens=16", "dreamgym.exp_max_new_tokens=48"]


@pytest.mark.slow  # about 3 minutes: every stage trains; the loops themselves are covered by the default suite
def test_reproduce_runs_every_stage_writes_the_table_and_resumes(tmp_path, capsys):
  args = ["reproduce", "--config", "configs/demo.py", "--set", f"out_dir={tmp_path}"]
  for item in SMALL:
    args += ["--set", item]
  assert main(args) == 0
  out = Path(tmp_path)
  result = json.loads((out / "results.json").read_text())
  methods = [r["method"] for r in result["rows"]]
  assert methods == ["SFT", "GRPO (real env)", "DreamGym GRPO", "DreamGym-S2R GRPO"]
  rows = {r["method"]: r for r in result["rows"]}
  # Every row is scored by the one evaluation: the same 4 held-out tasks.
  for r in result["rows"]:
    evaluation = json.loads((Path(r["folders"][0]) / "eval" / "eval.json").read_text())
    assert evaluation["episodes"] == 4 and evaluation["success_rate"] == r["success_rate"]
  tasks = {tuple(o[0] for o in json.loads((Path(r["folders"][0]) / "eval" / "eval.json").read_text())["outcomes"])
           for r in result["rows"]}
  assert len(tasks) == 1
  # Transition counts: DreamGym spends none online; S2R stops after the iteration that reaches its budget.
  assert rows["DreamGym GRPO"]["real_transitions"] == 0 and rows["DreamGym GRPO"]["synthetic_transitions"] > 0
  assert rows["GRPO (real env)"]["real_transitions"] > 0 and rows["SFT"]["offline_transitions"] > 0
  s2r = json.loads((out / "s2r_grpo" / "seed0" / "summary.json").read_text())
  assert s2r["iterations"] == 1 and s2r["real_transitions"] >= 1
  assert s2r["initial"]["iteration"] == 0 and s2r["final"]["iteration"] == 1
  # W&B names: the reproduce folder groups the stages, the command is the job type, method and seed the run.
  for stage, job, name in (("sft", "train-policy", "sft"), ("real_grpo/seed0", "rl", "real_grpo-seed0"),
                           ("s2r_grpo/seed0", "rl", "s2r_grpo-seed0")):
    track = json.loads((out / stage / "config.json").read_text())["track"]
    assert (track["group"], track["job_type"], track["name"]) == (out.name, job, name), stage
  dream = json.loads((out / "dreamgym_grpo" / "seed0" / "summary.json").read_text())
  assert Path(dream["checkpoint"]).is_dir()
  # Rows trained in M_exp show its held-out fidelity (the demo's M_exp: reasoning off); the others show none.
  fidelity = json.loads((out / "exp_model" / "summary.json").read_text())["held_out_fidelity"]["model"]
  for method in ("DreamGym GRPO", "DreamGym-S2R GRPO"):
    assert rows[method]["exp_model"]["eps_R_mean"] == fidelity["eps_R_mean"]
    assert rows[method]["exp_model"]["exact_match_determined"] == fidelity["exact_match_determined"]
  assert rows["SFT"]["exp_model"] is None and rows["GRPO (real env)"]["exp_model"] is None
  table = (out / "results.md").read_text()
  assert "| M_exp EM | EM determined | eps_R | eps_P |" in table
  assert "| DreamGym-S2R GRPO |" in table and "DreamGym GRPO" in (out / "results.svg").read_text()
  # The data-efficiency figure: real-env RL and S2R along the axis, DreamGym at 0 online real transitions.
  curves = result["efficiency"]
  assert list(curves) == ["GRPO (real env)", "DreamGym GRPO", "DreamGym-S2R GRPO"]
  assert curves["GRPO (real env)"][-1]["real_transitions"] == rows["GRPO (real env)"]["real_transitions"]
  assert {p["real_transitions"] for p in curves["DreamGym GRPO"]} == {0}
  assert curves["DreamGym-S2R GRPO"][0]["real_transitions"] == 0 and curves["DreamGym-S2R GRPO"][-1]["real_transitions"] >= 1
  assert "DreamGym GRPO, no online real" in (out / "data_efficiency.svg").read_text()
  assert table.strip() in capsys.readouterr().out
  # A rerun reuses every stage: nothing is trained or evaluated again, the table is the same.
  stamps = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
  assert main(args) == 0
  assert {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")} == stamps
  assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
  # A bank of the finished table (tools/bank_run.py), restored on a machine without the run folder, resumes it the
  # same way: every stage reused, the same rows.
  bank = Path(f"{tmp_path}_bank")
  assert bank_run.main(["save", str(out), str(bank)]) == 0
  shutil.rmtree(out)
  assert bank_run.main(["restore", str(bank), str(out)]) == 0
  capsys.readouterr()
  assert main(args) == 0
  assert "== " not in capsys.readouterr().out  # no stage ran
  assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]
  # A bank taken before the DreamGym rows ran: they train in the banked M_exp, whose replay retrieval embeds with its
  # initial model's backbone (the demo's M_exp retrieves with it), so the bank must hold that model too.
  for row in ("dreamgym_grpo", "s2r_grpo"):
    shutil.rmtree(out / row)
  assert bank_run.main(["save", str(out), str(bank)]) == 0
  shutil.rmtree(out)
  assert bank_run.main(["restore", str(bank), str(out)]) == 0
  assert main(args) == 0
  ran = capsys.readouterr().out
  assert f"== {out / 'dreamgym_grpo' / 'seed0'}" in ran and f"== {out / 'exp_model'}" not in ran


def test_reproduce_config_errors():
  with pytest.raises(ValueError, match="unknown algorithm or ablation 'sac'"):
    load_config("configs/reproduce_twx.py:tiny", ["algorithms=grpo,sac"])
  cfg = load_config("configs/reproduce_twx.py:tiny")
  assert cfg.algorithms == ("grpo", "ppo") and cfg.seeds == (0, 1, 2) and cfg.budgets.s2r > 0
  assert cfg.real.agent == cfg.sft.agent == cfg.dreamgym.rl.agent == cfg.eval.agent
  assert cfg.real.eval_tasks.game_params == cfg.eval.tasks.game_params == cfg.collect.game_params


@pytest.mark.parametrize("name", ["reproduce_alfworld.py", "reproduce_miniwob.py"])
@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_on_env_points_every_stage_at_one_env(name, variant):
  cfg = load_config(f"configs/{name}{variant}")
  twx = load_config(f"configs/reproduce_twx.py{variant}")
  env = cfg.eval.env
  assert env != "textworld_express"
  assert {cfg.collect.env, cfg.sft.env, cfg.dpo.env, cfg.real.env, cfg.dreamgym.rl.env} == {env}
  # Training draws from the train fold, every evaluator from the held-out one, with one prompt layout throughout.
  assert cfg.collect.split == cfg.real.train_tasks.split == "train" and cfg.collect.games == cfg.real.train_tasks.games
  held_out = cfg.eval.tasks
  for e in (cfg.sft.eval, cfg.dpo.eval):
    assert (e.games, e.split) == (held_out.games, held_out.split)
  for tasks in (cfg.real.eval_tasks, cfg.dreamgym.rl.eval_tasks):
    assert (tasks.games, tasks.split) == (held_out.games, held_out.split) and tasks.count <= held_out.count
  assert held_out.split != "train"
  assert cfg.real.agent == cfg.sft.agent == cfg.dpo.agent == cfg.dreamgym.rl.agent == cfg.eval.agent
  turns = {c.rollout.max_turns for c in (cfg.sft, cfg.dpo, cfg.real, cfg.dreamgym.rl, cfg.eval)}
  assert turns == {cfg.eval.rollout.max_turns}
  # What does not depend on the env stays as in the TWX comparison.
  assert cfg.real.rollout.temperature == twx.real.rollout.temperature and cfg.real.optim == twx.real.optim
  assert (cfg.algorithms, cfg.ablations, cfg.seeds) == (twx.algorithms, twx.ablations, twx.seeds)
  if not variant:
    assert cfg.real.rollout.group_size == twx.real.rollout.group_size == 8


def test_a_stage_on_another_env_is_refused():
  import dataclasses

  cfg = load_config("configs/reproduce_alfworld.py:tiny")
  with pytest.raises(ValueError, match=r"eval.env is 'alfworld' but sft.env is 'textworld_express'"):
    dataclasses.replace(cfg, sft=load_config("configs/reproduce_twx.py:tiny").sft)


def test_rows_sum_the_runs_costs_per_seed(tmp_path):
  from dreamjax.commands.reproduce import EXP_COLUMNS, exp_columns, row, table

  runs = []
  for seed, steps in ((0, [(1.5, 10.0, 30), (2.5, 12.0, 50)]), (1, [(3.0, 8.0, 40)])):
    folder = tmp_path / f"seed{seed}"
    folder.mkdir()
    lines = [json.dumps({"step": i + 1, "env_s": e, "update_s": u, "sampled_tokens": t, "loss": 0.1})
             for i, (e, u, t) in enumerate(steps)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    runs.append((folder, {"seconds": 100.0 + seed, "real_transitions": 20 + seed}))
  evals = [{"successes": 3, "episodes": 4, "success_rate": 0.75}, {"successes": 1, "episodes": 4, "success_rate": 0.25}]
  r = row("GRPO (real env)", runs, evals, offline=500, budget={"kind": "online", "cap": 30})
  # Means over seeds of each run's totals: env (1.5 + 2.5, 3.0), update (22, 8), tokens (80, 40).
  assert r["env_s"] == 3.5 and r["update_s"] == 15.0 and r["policy_tokens"] == 60.0
  assert r["success_rate"] == 0.5 and r["per_seed"] == [0.75, 0.25] and r["seconds"] == 100.5
  cfg = load_config("configs/reproduce_twx.py:tiny", ["seeds=0,1"])
  text = table([r], cfg)
  # Budget and spend: the cap, and the mean real transitions of the seeds (20 and 21).
  assert "| GRPO (real env) | 30 online | 20 | 500 | 20 | 0 | 0.500 [" in text
  assert text.rstrip().endswith("| 100 | 4 | 15 | 60 |")
  sft = row("SFT", runs[:1], evals[:1], offline=200, budget={"kind": "offline", "cap": None, "spent": 200})
  assert "| SFT | - offline | 200 | 200 | 20 |" in table([sft], cfg)
  # A row trained in an M_exp shows its held-out fidelity (train-exp's summary); the others leave the cells empty.
  fidelity = {"exact_match": 0.4, "exact_match_determined": 0.9, "eps_R_mean": 0.05, "eps_P_tf_mean": 0.7, "n": 9}
  dream = r | {"method": "DreamGym GRPO", "exp_model": exp_columns({"held_out_fidelity": {"model": fidelity}})}
  text = table([sft | {"exp_model": None}, dream], cfg)
  assert "| policy tokens | M_exp EM | EM determined | eps_R | eps_P |" in text
  sft_line, dream_line = text.rstrip().splitlines()[-2:]
  assert dream_line.endswith("| 60 | 0.400 | 0.900 | 0.050 | 0.700 |") and sft_line.endswith("|  |  |  |  |")
  assert exp_columns({"held_out_fidelity": {}}) == dict.fromkeys(EXP_COLUMNS)


def test_efficiency_curve_pools_the_seeds_evaluations(tmp_path):
  """The data-efficiency points: per iteration every seed evaluated, the seeds' mean real transitions and the success
  over all their episodes; an iteration one seed did not evaluate is left out, and a folder without evals.jsonl
  (a run that never evaluated) leaves nothing to pool."""
  from dreamjax.commands.reproduce import efficiency_curve
  from dreamjax.loop.evaluate import wilson_interval

  def seed(name, evals):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "evals.jsonl").write_text("".join(json.dumps({"iteration": i, "real_transitions": n, "successes": k,
                                                            "episodes": 10, "outcomes": []}) + "\n"
                                                for i, n, k in evals))
    return str(folder)

  folders = [seed("s0", [(0, 0, 3), (2, 100, 5), (4, 200, 6)]), seed("s1", [(0, 0, 4), (4, 180, 9)])]
  points = efficiency_curve(folders)
  assert [p["iteration"] for p in points] == [0, 4]
  assert [p["real_transitions"] for p in points] == [0, 190]
  assert [p["success_rate"] for p in points] == [0.35, 0.75] and points[1]["episodes"] == 20
  assert (points[1]["ci_low"], points[1]["ci_high"]) == wilson_interval(15, 20)
  (tmp_path / "empty").mkdir()
  assert efficiency_curve(folders + [str(tmp_path / "empty")]) == [] and efficiency_curve([]) == []


def test_ablations_are_their_own_experiments():
  """w/o replay trains its own M_exp without retrieval; w/o task generation keeps curriculum selection and turns
  M_task off; w/o curriculum draws seed tasks uniformly; w/o reasoning needs a reasoning M_exp to compare with."""
  from dreamjax.commands.reproduce import ablated

  cfg = load_config("configs/reproduce_twx.py")
  trained = []

  def exp_model(name, **fmt):
    trained.append((name, fmt))
    return f"runs/{name}"

  assert ablated(cfg, "no_replay", "full", exp_model) == ("runs/exp_model_no_replay", {"replay": False})
  assert ablated(cfg, "no_reasoning", "full", exp_model) == ("runs/exp_model_no_reasoning", {"reasoning": False})
  assert trained == [("exp_model_no_replay", {"retrieval": False}), ("exp_model_no_reasoning", {"reasoning": False})]
  exp, kw = ablated(cfg, "no_task_generation", "full", exp_model)
  assert exp == "full" and kw["curriculum"].enabled and kw["curriculum"].generate_every == 0
  exp, kw = ablated(cfg, "no_curriculum", "full", exp_model)
  assert exp == "full" and not kw["curriculum"].enabled
  tiny = load_config("configs/reproduce_twx.py:tiny")
  assert not tiny.exp.format.reasoning
  with pytest.raises(ValueError, match="no_reasoning ablation needs exp.format.reasoning=true"):
    ablated(tiny, "no_reasoning", "full", exp_model)


def test_budgets_keep_the_papers_ratios():
  full, small = load_config("configs/reproduce_twx.py").budgets, load_config("configs/reproduce_twx.py:tiny").budgets
  assert (full.sft, full.dpo, full.real_rl, full.s2r) == (20_000, 40_000, 80_000, 5_000)
  assert small.dpo == 2 * small.sft and small.real_rl == 4 * small.sft and small.real_rl == 16 * small.s2r
  with pytest.raises(ValueError, match="budgets.s2r must be >= 0"):
    load_config("configs/reproduce_twx.py:tiny", ["budgets.s2r=-1"])
  # The testbeds give DreamGym as many synthetic transitions as real-env RL spends real ones (shape (a)).
  for name in ("reproduce_twc.py", "reproduce_alfworld_pp.py", "reproduce_twc.py:tiny"):
    budgets = load_config(f"configs/{name}").budgets
    assert budgets.synthetic_rl == budgets.real_rl > 0, name


def test_ppo_rows_take_the_ppo_configs_own_settings():
  """PPO rows run PPO's objective, optimisers, epochs and separate critic (configs/ppo_real_twx.py), on the row's
  env, tasks, rollout and budget; GRPO rows run the GRPO config as given."""
  import dataclasses

  from dreamjax.commands.reproduce import ALGORITHM_FIELDS, as_algorithm

  cfg = load_config("configs/reproduce_twx.py:tiny")
  grpo, ppo = as_algorithm(cfg.real, "grpo", cfg.ppo), as_algorithm(cfg.real, "ppo", cfg.ppo)
  assert grpo == cfg.real
  assert all(getattr(ppo, f) == getattr(cfg.ppo, f) for f in ALGORITHM_FIELDS)
  assert ppo.critic.mode == "separate" and ppo.objective != cfg.real.objective and (ppo.gamma, ppo.lam) == (1.0, 1.0)
  assert (ppo.env, ppo.train_tasks, ppo.rollout, ppo.iterations) == (cfg.real.env, cfg.real.train_tasks,
                                                                     cfg.real.rollout, cfg.real.iterations)
  default = as_algorithm(cfg.real, "ppo", None)  # no ppo section: verl-agent's PPO on the row's config
  assert default.critic.optim.lr == 1e-5 and default.algorithm == "ppo"
  with pytest.raises(ValueError, match="must be GRPO configs"):
    as_algorithm(dataclasses.replace(cfg.real, **{f: getattr(cfg.ppo, f) for f in ALGORITHM_FIELDS}), "ppo", cfg.ppo)


def test_stage_runs_are_named_for_wandb_by_method_and_seed():
  from dreamjax.commands.reproduce import tracked

  cfg = load_config("configs/reproduce_twx.py:tiny")
  rl = tracked(cfg.real, "twx_tiny", "rl", "real_grpo-seed1").track
  assert (rl.group, rl.job_type, rl.name) == ("twx_tiny", "rl", "real_grpo-seed1")
  dream = tracked(cfg.dreamgym, "twx_tiny", "dreamgym", "dreamgym_grpo-seed0")
  assert (dream.rl.track.job_type, dream.rl.track.name) == ("dreamgym", "dreamgym_grpo-seed0")
  named = dataclasses.replace(cfg.sft, track=dataclasses.replace(cfg.sft.track, name="mine", group="exp7"))
  assert (tracked(named, "twx_tiny", "train-policy", "sft").track.name, tracked(named, "g", "j", "n").track.group) == \
      ("mine", "exp7")  # what the config sets wins


def test_shapes_compare_rows_paired_over_tasks_and_seeds():
  """The paper's four shapes from a table's rows: success differences paired over (seed, task), S2R's share of
  real-env RL's real transitions, each ablation against the full system, and the wall-time ratio."""
  from dreamjax.loop.results import shapes, shapes_table

  def episodes(won: int, n: int = 100) -> list:
    return [[f"task{i}", i < won, 5] for i in range(n)]

  wins = {"SFT": (50, 50), "GRPO (real env)": (70, 70), "DreamGym GRPO": (66, 68), "DreamGym-S2R GRPO": (75, 77),
          "DreamGym GRPO w/o replay": (60, 60), "DreamGym GRPO w/o reasoning": (70, 70), "PPO (real env)": (60, 60)}
  seconds = {"SFT": 100.0, "GRPO (real env)": 3600.0, "DreamGym GRPO": 7200.0, "DreamGym-S2R GRPO": 300.0,
             "DreamGym GRPO w/o replay": 7000.0, "DreamGym GRPO w/o reasoning": 5000.0, "PPO (real env)": 3600.0}
  real = {"GRPO (real env)": 16000, "DreamGym-S2R GRPO": 1000, "PPO (real env)": 16000}
  rows = [{"method": m, "success_rate": sum(w) / 200, "seconds": seconds[m], "real_transitions": real.get(m, 0)}
          for m, w in wins.items()]
  outcomes = {m: [(seed, episodes(w)) for seed, w in enumerate(ws)] for m, ws in wins.items()}
  got = shapes(rows, outcomes)
  assert [(e["shape"], e["method"]) for e in got] == [
      ("a", "DreamGym GRPO"), ("b", "DreamGym-S2R GRPO"), ("c", "DreamGym GRPO w/o replay"),
      ("c", "DreamGym GRPO w/o reasoning"), ("d", "DreamGym GRPO")]  # no DreamGym PPO row: no PPO comparisons
  a, b, c_replay, c_reasoning, d = got
  # Paired over 2 seeds x 100 tasks: DreamGym wins 66 + 68 where real-env RL wins 70 + 70, on nested task sets.
  assert a["episodes"] == 200 and a["gain"] == pytest.approx(-0.03) and a["holds"]  # within 0.05
  assert a["ci_low"] < a["gain"] < a["ci_high"] <= 0
  assert b["gain"] == pytest.approx(0.06) and b["real_ratio"] == pytest.approx(1000 / 16000) and b["holds"]
  assert c_replay["gain"] == pytest.approx(-0.07) and c_replay["holds"]
  assert c_reasoning["gain"] == pytest.approx(0.03) and not c_reasoning["holds"]  # above the full system
  assert d["seconds_ratio"] == 2.0 and not d["holds"]
  assert d["gain_per_hour"] == {"GRPO (real env)": pytest.approx(0.2), "DreamGym GRPO": pytest.approx(0.17 / 2)}
  # S2R spending more than a tenth of real-env RL's transitions does not hold, however well it scores.
  rows[3]["real_transitions"] = 2000
  assert not shapes(rows, outcomes)[1]["holds"]
  text = shapes_table(got)
  assert "| (a) | DreamGym within 0.05 of real-env RL" in text and "| DreamGym GRPO - GRPO (real env) | -0.030 [" in text
  assert "| (d) |" in text and "2.00x the wall time" in text and text.count("| no |") == 2
