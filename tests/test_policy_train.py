"""Policy SFT and DPO baselines: row layout equal to rollout rows, DPO pairing, and tiny end-to-end runs on real
TextWorld-Express coin games (two rooms, no doors: look around, move to the other room if the coin is not in sight,
take the coin; a 4-step limit, so random runs mostly fail and make DPO's rejected side)."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dreamjax.cli import main as cli_main
from dreamjax.config import load_config
from dreamjax.data.collect import CollectConfig, collect
from dreamjax.data.records import StepRecord, TrajectoryRecord, read_trajectories
from dreamjax.envs.base import Task
from dreamjax.loop.model import ModelSource
from dreamjax.loop.policy_data import (
    PairConfig,
    RowConfig,
    policy_texts,
    preference_episodes,
    preference_pairs,
    sft_rows,
)
from dreamjax.loop.track import read_metrics
from dreamjax.models import tiny
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat, build_turn_prompt, format_answer, parse_answer
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.text import train_bpe_tokenizer

COIN = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=3, history_token_budget=256)
ROLLOUT = RolloutConfig(max_turns=4, max_action_tokens=16, max_episode_tokens=64, prompt_buckets=(768,))
ROWS = 6  # envs stepped together (collection and evaluation)


@pytest.fixture(scope="module")
def twx():
  pytest.importorskip("textworld_express")
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv

  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=4) for _ in range(ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def collected(twx, tmp_path_factory):
  out = tmp_path_factory.mktemp("collect")
  cfg = CollectConfig(env_kwargs=("step_limit=4",), games=("coin",), game_params=COIN,
                      policies=("expert:12", "random:12", "eps0.5:6"), num_workers=0, rows_per_worker=ROWS,
                      out_dir=str(out), build_tfds=False, progress=False)
  collect(cfg, batch=twx)
  path = out / "trajectories.jsonl"
  return path, read_trajectories(path)


@pytest.fixture(scope="module")
def tok(collected, tmp_path_factory):
  _, records = collected
  return train_bpe_tokenizer(policy_texts(records, FMT) * 2, tmp_path_factory.mktemp("tok"), vocab_size=800)


def _history(record, t):
  return [(s.state, s.action) for s in record.steps[:t]]


def test_rows_are_the_rollout_prompt_plus_the_answer(collected, tok):
  _, records = collected
  experts = [r for r in records if r.policy == "expert" and r.success]
  assert len(experts) >= 10
  rows, stats = sft_rows(records, tok, FMT, RowConfig(), ROLLOUT)
  assert len(rows) == stats["rows"] == sum(r.num_steps for r in experts) and stats["history_trimmed"] == 0
  assert stats["episodes_used"] == len(experts)
  assert stats["episodes_other_policy"] == sum(r.policy != "expert" for r in records)
  by_id = {r.episode_id: r for r in records}
  end = tok.chat_format.end_of_turn
  for row in rows:
    record = by_id[row.episode_id]
    step = record.steps[row.turn]
    prompt = build_turn_prompt(tok, FMT, record.instruction, row.turn, _history(record, row.turn), step.state,
                               step.admissible).prompt()
    answer = np.asarray(tok.encode(format_answer(step.action)) + [end])
    np.testing.assert_array_equal(row.ids, np.concatenate([prompt, answer]))
    np.testing.assert_array_equal(row.loss_mask, np.r_[np.zeros(len(prompt)), np.ones(len(answer))])
    assert row.prompt_len == len(prompt) and row.ids.dtype == np.int32 and row.loss_mask.dtype == np.int32
    assert parse_answer(tok.decode(row.answer_ids[:-1])).action == step.action
  # a think template: the answer parses back to the action, with the template as its think block
  think_fmt = dataclasses.replace(FMT, think=True)
  templated, _ = sft_rows(records, tok, think_fmt, RowConfig(think="auto"), dataclasses.replace(ROLLOUT, max_action_tokens=64))
  parsed = parse_answer(tok.decode(templated[0].answer_ids[:-1]))
  assert parsed.action == by_id[templated[0].episode_id].steps[templated[0].turn].action
  assert parsed.action in parsed.think and len(templated) == len(rows)
  # prompt_loss: the same rows, every token but the first a target
  lm, lm_stats = sft_rows(records, tok, FMT, RowConfig(prompt_loss=True), ROLLOUT)
  assert [(r.episode_id, r.turn, r.prompt_len) for r in lm] == [(r.episode_id, r.turn, r.prompt_len) for r in rows]
  for a, b in zip(rows, lm):
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(b.loss_mask, np.r_[0, np.ones(len(b.ids) - 1)])
  assert lm_stats == stats and stats["answer_tokens"] == sum(int(r.loss_mask.sum()) for r in rows)


def test_restricted_rows_score_each_answer_token_among_the_admissible_actions_tokens(collected, tok):
  import jax

  from dreamjax.models import Transformer, init_params
  from dreamjax.rl.batch import sft_batch
  from dreamjax.rl.objectives import make_objective

  _, records = collected
  restricted = dataclasses.replace(ROLLOUT, constrain_actions=True)
  rows, stats = sft_rows(records, tok, FMT, RowConfig(), restricted)
  limited, limited_stats = sft_rows(records, tok, FMT, RowConfig(restricted_loss=True), restricted)
  assert [(r.episode_id, r.turn) for r in limited] == [(r.episode_id, r.turn) for r in rows]
  assert limited_stats == stats and all(r.allowed is None for r in rows)
  by_id = {r.episode_id: r for r in records}
  end = tok.chat_format.end_of_turn
  for row in limited:
    step = by_id[row.episode_id].steps[row.turn]
    answers = [tok.encode(format_answer(a)) + [end] for a in step.admissible]
    assert row.allowed.shape[0] == len(row.answer_ids)
    for j, token in enumerate(row.answer_ids):  # the tokens of the admissible answers that agree with it so far
      expect = {a[j] for a in answers if len(a) > j and a[:j] == row.answer_ids[:j].tolist()}
      assert set(row.allowed[j][row.allowed[j] >= 0].tolist()) == expect and token in expect
  # A demonstrated action that is not admissible is left out, and the option needs restricted decoding.
  record = next(r for r in records if r.policy == "expert" and r.success)
  step = dataclasses.replace(record.steps[0], action="dance with the coin")
  odd = dataclasses.replace(record, steps=(step, *record.steps[1:]))
  kept, odd_stats = sft_rows([odd], tok, FMT, RowConfig(restricted_loss=True), restricted)
  assert odd_stats["skipped_not_admissible"] == 1 and [r.turn for r in kept] == list(range(1, record.num_steps))
  with pytest.raises(ValueError, match="restricted_loss .* needs RolloutConfig.constrain_actions"):
    sft_rows(records, tok, FMT, RowConfig(restricted_loss=True), ROLLOUT)
  # The SFT loss then is the mean over answer tokens of -log p(token | its allowed set); forced tokens cost 0.
  cfg = tiny("qwen2", vocab_size=800, max_position_embeddings=1024)
  params = init_params(cfg, jax.random.key(0))
  batch_rows = limited[:4]
  batch = sft_batch([r.ids for r in batch_rows], [r.loss_mask for r in batch_rows], pad_to=64, allowed_width=8,
                    allowed=[(r.prompt_len, r.allowed) for r in batch_rows])
  loss, _ = make_objective("sft").loss(cfg, params, batch, jax.random.key(1))
  expect, count = 0.0, 0
  for row in batch_rows:
    n = len(row.ids)
    logits = np.asarray(Transformer(cfg).apply({"params": params}, row.ids[None], np.arange(n)[None],
                                               np.ones((1, n), bool)).logits[0], np.float64)
    for j, token in enumerate(row.answer_ids):
      keep = row.allowed[j][row.allowed[j] >= 0]
      z = logits[row.prompt_len + j - 1, keep]
      expect -= z[keep == token][0] - (np.log(np.exp(z - z.max()).sum()) + z.max())
      count += 1
  np.testing.assert_allclose(float(loss), expect / count, rtol=2e-4)
  forced = sum(int(((r.allowed >= 0).sum(-1) == 1).sum()) for r in batch_rows)
  assert 0 < forced < count  # both kinds of token are in the check


def test_history_is_dropped_exactly_as_the_rollout_engine_drops_it(collected, tok):
  _, records = collected
  experts = [r for r in records if r.policy == "expert" and r.success]
  bare = [len(build_turn_prompt(tok, FMT, r.instruction, t, [], s.state, s.admissible).prompt())
          for r in experts for t, s in enumerate(r.steps)]
  bucket = max(bare)  # every turn fits without history; later turns with their history mostly do not
  rollout = dataclasses.replace(ROLLOUT, prompt_buckets=(bucket,))
  engine = RolloutEngine(tiny("qwen2", vocab_size=tok.vocab_size), tok, FMT, rollout)
  rows, stats = sft_rows(records, tok, FMT, RowConfig(), rollout)
  assert len(rows) == len(bare) and stats["history_trimmed"] >= 1
  by_id = {r.episode_id: r for r in records}
  for row in rows:
    record = by_id[row.episode_id]
    step = record.steps[row.turn]
    expected = engine.turn_prompt(record.instruction, row.turn, _history(record, row.turn), step.state,
                                  step.admissible).prompt()
    np.testing.assert_array_equal(row.ids[:row.prompt_len], expected)
  # turns that fit no bucket, and answers beyond the per-turn budget, are counted and left out
  _, short = sft_rows(records, tok, FMT, RowConfig(), dataclasses.replace(ROLLOUT, prompt_buckets=(bucket - 1,)))
  assert short["skipped_prompt_too_long"] == sum(b == bucket for b in bare) >= 1
  _, tight = sft_rows(records, tok, FMT, RowConfig(), dataclasses.replace(ROLLOUT, max_action_tokens=3))
  assert tight["rows"] == 0 and tight["skipped_answer_too_long"] == len(bare)


def test_only_expert_steps_of_noisy_episodes_are_cloned(collected, tok):
  _, records = collected
  noisy = [r for r in records if r.policy == "eps0.5" and r.success]
  assert noisy
  rows, stats = sft_rows(records, tok, FMT, RowConfig(experts=("eps0.5",)), ROLLOUT)
  cloned = {(r.episode_id, r.turn) for r in rows}
  expected = {(r.episode_id, t) for r in noisy for t, s in enumerate(r.steps) if s.source == "expert"
              and not s.invalid}
  assert cloned == expected and stats["skipped_source"] == sum(s.source != "expert" for r in noisy for s in r.steps)
  # a random step and a rejected expert step are not cloned, but later turns show them in their history
  record = _rec("E", "eps0.5", 0, ["inventory", "look around", "open fridge", "take coin"], True,
                sources=["random", "expert", "expert", "expert"], invalid=[False, False, True, False])
  rows, stats = sft_rows([record], tok, FMT, RowConfig(experts=("eps0.5",)), ROLLOUT)
  assert [r.turn for r in rows] == [1, 3] and stats["skipped_source"] == stats["skipped_invalid"] == 1
  assert "| action: inventory" in tok.decode(rows[0].ids[:rows[0].prompt_len])
  assert "| action: open fridge" in tok.decode(rows[1].ids[:rows[1].prompt_len])
  assert not sft_rows([record], tok, FMT, RowConfig(), ROLLOUT)[0]  # not an expert episode by default


def _rec(task: str, policy: str, i: int, actions: list[str], success: bool, sources=None,
         invalid=None) -> TrajectoryRecord:
  t = Task.make("textworld_express", task, "Find the coin.", game="coin", seed=0, split="train")
  sources = sources or ["expert" if policy == "expert" else "random"] * len(actions)
  invalid = invalid or [False] * len(actions)
  last = len(actions) - 1
  steps = tuple(StepRecord(f"Location: room {j}", a, f"Location: room {j + 1}", float(success and j == last),
                           j == last, success and j == last, invalid[j], ("look around", a), sources[j])
                for j, a in enumerate(actions))
  return TrajectoryRecord(f"{policy}:{task}:{i}", "textworld_express", t, "Find the coin.", policy, i, steps, success,
                          len(steps), None)


def test_dpo_pairing_is_deterministic_capped_and_per_task(tok):
  good = [_rec("A", "expert", i, ["look around"] * (3 - i) + ["take coin"], True) for i in range(2)]
  bad = [_rec("A", "random", i, ["look around", f"move {d}"], False) for i, d in enumerate(["north", "south", "east"])]
  others = [_rec("B", "expert", 0, ["take coin"], True), _rec("C", "random", 0, ["inventory"], False),
            _rec("A", "random", 9, ["take coin"], True)]  # a random success is neither chosen nor rejected
  records = good + bad + others
  cfg = PairConfig(max_pairs_per_task=5)
  pairs = preference_episodes(records, cfg)
  assert [p[0].episode_id for p in pairs] == ["expert:A:1", "expert:A:0", "expert:A:1"]  # shortest first, cycled
  assert sorted(p[1].episode_id for p in pairs) == sorted(r.episode_id for r in bad)  # each failure once
  assert preference_episodes(records[::-1], cfg) == pairs  # independent of file order
  assert len(preference_episodes(records, PairConfig(max_pairs_per_task=2))) == 2
  assert preference_episodes(records, PairConfig(rejected_policies=("eps0.5",))) == []
  # rows: the shared first turn ("look around" in room 0) cancels in the margin and is dropped
  built, stats = preference_pairs(records, tok, FMT, cfg, ROLLOUT)
  assert len(built) == 3 and stats["common_rows_dropped"] == 3
  for p in built:
    assert [r.turn for r in p.rejected] == [1] and p.chosen[0].turn == 1
    assert not np.array_equal(p.chosen[0].ids, p.rejected[0].ids)
  # identical single-turn episodes keep their one row on each side
  same, _ = preference_pairs([_rec("D", "expert", 0, ["take coin"], True), _rec("D", "random", 0, ["take coin"], False)],
                             tok, FMT, cfg, ROLLOUT)
  assert len(same[0].chosen) == len(same[0].rejected) == 1
  cut, cut_stats = preference_pairs(records, tok, FMT, PairConfig(max_turns=1, drop_common_prefix=False), ROLLOUT)
  assert all(len(p.chosen) == len(p.rejected) == 1 for p in cut) and cut_stats["turns_cut"] > 0


@pytest.fixture(scope="module")
def sft_run(collected, twx, tmp_path_factory):
  from dreamjax.commands.train_policy import PolicySftConfig, run
  from dreamjax.loop.evaluate import EvalConfig

  path, _ = collected
  cfg = PolicySftConfig(  # every row in each batch (one step per epoch), as in test_rollout's fine-tuned policy
      data=(str(path),), env_kwargs=("step_limit=4",), agent=FMT, rollout=ROLLOUT,
      model=ModelSource(tiny=tiny("qwen2", vocab_size=800, max_position_embeddings=1024)),
      optim=OptimConfig(lr=5e-3, warmup_steps=3), batch_size=32, epochs=40,
      eval=EvalConfig(games=("coin",), split="dev", num_tasks=ROWS, game_params=COIN, train_tasks=ROWS, num_envs=ROWS),
      devices=1, log_every=10, out_dir=str(tmp_path_factory.mktemp("sft")), seed=0)
  return cfg, run(cfg, env=twx)


def test_sft_learns_to_act_in_the_real_env(sft_run):
  cfg, summary = sft_run
  out = Path(cfg.out_dir)
  metrics = [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
  assert [m["step"] for m in metrics] == [1, 10, 20, 30, 40]
  assert summary["final_loss"] < 0.1 * summary["first_loss"] and summary["first_loss"] > 1.0
  assert summary["compilations"] == 1 and summary["steps"] == 40 and summary["epochs"] == 40
  train = summary["eval"]["train"]
  assert train["episodes"] == ROWS and train["successes"] >= ROWS // 2, train["outcomes"]
  assert train["parse_failures"] == 0
  saved = json.loads((out / "summary.json").read_text())
  assert saved["eval"]["held_out"]["success_rate"] == summary["eval"]["held_out"]["success_rate"]
  assert (out / "checkpoint" / "config.json").is_file() and (out / "checkpoint" / "tokenizer.json").is_file()


def test_dpo_from_the_sft_checkpoint_raises_the_margin(sft_run, collected, twx, tmp_path):
  from dreamjax.commands.dpo import DpoConfig, run
  from dreamjax.loop.evaluate import EvalConfig

  sft_cfg, sft_summary = sft_run
  path, records = collected
  cfg = DpoConfig(data=(str(path),), checkpoint=sft_summary["checkpoint"], env_kwargs=("step_limit=4",), agent=FMT,
                  rollout=ROLLOUT, pairs=PairConfig(rejected_policies=("random", "eps0.5"), max_pairs_per_task=2),
                  beta=0.1, optim=OptimConfig(lr=1e-3), pairs_per_step=4, max_steps=8,
                  eval=EvalConfig(num_tasks=0), devices=1, log_every=4, out_dir=str(tmp_path), seed=0)
  summary = run(cfg, env=twx)
  assert summary["pairs"]["pairs"] >= 4 and summary["compilations"] == 1
  assert abs(summary["first_margin"]) < 1e-3  # the first step scores the reference itself
  assert math.isclose(summary["first_loss"], math.log(2), abs_tol=1e-3)
  assert summary["final_margin"] > 0.5 and summary["final_loss"] < 0.5 * math.log(2)
  margins = [m["margin"] for m in read_metrics(tmp_path / "metrics.jsonl") if "margin" in m]
  assert margins[-1] == max(margins)
  assert (tmp_path / "checkpoint" / "config.json").is_file()


def test_grouped_epoch_holds_every_row_once_in_length_sorted_batches_of_a_seeded_order():
  from types import SimpleNamespace

  from dreamjax.commands.train_policy import _batches

  lengths = np.random.default_rng(1).integers(200, 1200, 100)
  rows = [SimpleNamespace(ids=np.zeros(n, np.int32), i=i) for i, n in enumerate(lengths)]
  plain = _batches(rows, 8, np.random.default_rng([0, 2]))
  grouped = _batches(rows, 8, np.random.default_rng([0, 2]), group_rows=32)  # windows of 32, 32, 32 and 4 rows
  assert [len(b) for b in plain] == [8] * 12 + [4] and sorted(map(len, grouped)) == [4] + [8] * 12
  assert sorted(r.i for b in grouped for r in b) == list(range(100))  # every row once an epoch
  order = [r.i for b in plain for r in b]  # the ungrouped epoch's order: its windows are the grouped epoch's
  for w in range(4):
    window = sorted(order[32 * w:32 * w + 32])
    batches = [b for b in grouped if b[0].i in window]
    assert sorted(r.i for b in batches for r in b) == window
    spans = sorted((min(len(r.ids) for r in b), max(len(r.ids) for r in b)) for b in batches)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # batches cut a length-sorted window
  maxima = [max(len(r.ids) for r in b) for b in grouped[:4]]
  assert maxima != sorted(maxima)  # a window's batches come in a seeded order, not shortest first
  again = _batches(rows, 8, np.random.default_rng([0, 2]), group_rows=32)
  assert [[r.i for r in b] for b in again] == [[r.i for r in b] for b in grouped]


def test_grouped_batches_pad_to_their_own_rows_and_train_as_the_plain_ones(collected, twx, tmp_path, monkeypatch):
  """group_rows = batch_size keeps each batch's rows (sorted inside it), so the only change is each batch's width:
  its own longest row rounded up to GROUPED_WIDTH instead of the data's longest. The token-mean loss must not see it.
  The coin rows are 257-320 tokens, all in one width of 128, so the test rounds to 16 to see several widths."""
  from dreamjax.commands import train_policy
  from dreamjax.commands.train_policy import PolicySftConfig, _batches, run
  from dreamjax.loop.evaluate import EvalConfig
  from dreamjax.text.tokenizer import load_tokenizer

  monkeypatch.setattr(train_policy, "GROUPED_WIDTH", 16)

  path, records = collected
  base = PolicySftConfig(
      data=(str(path),), env_kwargs=("step_limit=4",), agent=FMT, rollout=ROLLOUT,
      model=ModelSource(tiny=tiny("qwen2", vocab_size=800, max_position_embeddings=1024)),
      optim=OptimConfig(lr=5e-3, warmup_steps=1), batch_size=8, max_steps=4, eval=EvalConfig(num_tasks=0),
      devices=1, log_every=1, seed=0)
  plain = run(dataclasses.replace(base, out_dir=str(tmp_path / "plain")), env=twx)
  grouped = run(dataclasses.replace(base, group_rows=8, out_dir=str(tmp_path / "grouped")), env=twx)
  losses = [[m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in m]
            for name in ("plain", "grouped")]
  assert len(losses[0]) == 4 and np.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6), losses
  rows, _ = sft_rows(records, load_tokenizer(tmp_path / "grouped" / "init_model"), FMT, RowConfig(), ROLLOUT)
  widths = {-(-max(len(r.ids) for r in b) // 16) * 16
            for b in _batches(rows, 8, np.random.default_rng([0, 0]), group_rows=8)[:4]}
  assert plain["compilations"] == 1 and grouped["compilations"] == len(widths) > 1, widths
  assert min(widths) < plain["row_length"], (widths, plain["row_length"])


def test_configs_load_and_bad_settings_are_clear_errors(tmp_path):
  from dreamjax.commands import dpo
  from dreamjax.commands import train_policy as policy_sft

  for spec, kind in [("configs/train_policy_twx.py", policy_sft.PolicySftConfig),
                     ("configs/train_policy_twx.py:tiny", policy_sft.PolicySftConfig),
                     ("configs/dpo_twx.py", dpo.DpoConfig), ("configs/dpo_twx.py:tiny", dpo.DpoConfig)]:
    assert isinstance(load_config(spec), kind)
  cfg = load_config("configs/train_policy_twx.py:tiny", ["eval.num_tasks=3", "rows.think=none"])
  assert cfg.eval.num_tasks == 3 and cfg.rows.think == "none"
  with pytest.raises(ValueError, match="defines no small\\(\\) function"):
    load_config("configs/train_policy_twx.py:small")
  with pytest.raises(ValueError, match="PolicySftConfig.batch_size must be >= 1"):
    dataclasses.replace(cfg, batch_size=0)
  with pytest.raises(ValueError, match=r"group_rows must be a multiple of batch_size \(\d+\) .* got group_rows=5"):
    dataclasses.replace(cfg, group_rows=5)
  with pytest.raises(ValueError, match="not used with pad_to"):
    dataclasses.replace(cfg, group_rows=cfg.batch_size, pad_to=256)
  with pytest.raises(ValueError, match="RowConfig.think must be one of"):
    RowConfig(think="long")
  with pytest.raises(ValueError, match="data: .*missing.jsonl does not exist"):
    policy_sft.run(dataclasses.replace(cfg, data=(str(tmp_path / "missing.jsonl"),), out_dir=str(tmp_path / "o")))
  with pytest.raises(ValueError, match="checkpoint: .* is not an HF checkpoint folder"):
    dpo.run(dpo.DpoConfig(checkpoint=str(tmp_path), out_dir=str(tmp_path / "d")))
  assert cli_main(["train-policy", "--config", "configs/train_policy_twx.py:tiny", "--set", "batch_size=0"]) == 2
  assert cli_main(["train-policy", "--config", "configs/dpo_twx.py:tiny"]) == 2  # a DpoConfig
