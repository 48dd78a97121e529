"""Experience-model SFT (Eq. 5) and fidelity: the data builder, the metrics against exact references, and the CI check
that a tiny M_exp trained from scratch on real TextWorld-Express coin episodes beats the copy-the-state baseline on
held-out tasks; then the fidelity script on that model."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dreamjax.commands.train_exp import ExpSftConfig, _batches, length_buckets, run
from dreamjax.config import load_config
from dreamjax.data.collect import CollectConfig, collect
from dreamjax.data.records import Transition, read_trajectories, transitions
from dreamjax.experience.exp_model import exp_format, load_exp_model
from dreamjax.experience.fidelity import Predictor, region_logps, score, teacher_forced, token_f1
from dreamjax.experience.format import ExpFormatConfig, ExpPrediction, action_lists, build_prompt, transition_target
from dreamjax.experience.sft_data import (
    ACTIONS,
    NEXT_STATE,
    OUTCOME,
    REASONING,
    ExampleBuilder,
    annotations_for,
    build_examples,
    build_sft_data,
    corpus,
    split_by_task,
)
from dreamjax.loop.model import ModelSource, build_tiny_checkpoint, load_model
from dreamjax.loop.track import read_metrics
from dreamjax.models import Transformer, tiny
from dreamjax.replay.encoder import BackbonePooledEncoder
from dreamjax.replay.retriever import Retriever
from dreamjax.rl.logprobs import LogpScorer
from experiments import exp_model_quality
from tests.jax_settings import optimized

ROOT = Path(__file__).resolve().parents[1]
TINY = f"{ROOT / 'configs' / 'train_exp_twx.py'}:tiny"
COIN = "numLocations=2,includeDoors=0,numDistractorItems=0"
FMT = ExpFormatConfig(k=2, max_history=2)


@pytest.fixture(scope="module")
def coin_path(tmp_path_factory) -> Path:
  """Real coin episodes (two rooms, so states stay short): 150 tasks, the expert on each, eps0.5 on 100, random on 50
  (the collection the tiny config's docstring describes; about 15 s)."""
  pytest.importorskip("textworld_express")
  out = tmp_path_factory.mktemp("coin")
  collect(CollectConfig(env_kwargs=("step_limit=8",), games=("coin",), game_params=COIN,
                        policies=("expert:150", "random:50", "eps0.5:100"), num_workers=0, rows_per_worker=8,
                        out_dir=str(out), progress=False, build_tfds=False))
  return out / "trajectories.jsonl"


@pytest.fixture(scope="module")
def small_model(coin_path, tmp_path_factory):
  """(records, tokenizer folder + random tiny model) built like a tiny run's, for the data-builder checks."""
  records = read_trajectories(coin_path)
  folder = tmp_path_factory.mktemp("small_model")
  source = ModelSource(tiny=tiny("qwen2", vocab_size=1024, max_position_embeddings=2048))
  build_tiny_checkpoint(source, corpus(records, annotations_for(records), FMT), folder, seed=0)
  return records, folder


# --- data ------------------------------------------------------------------------------------------------------------


def test_split_keeps_tasks_whole_and_is_deterministic(coin_path):
  records = read_trajectories(coin_path)
  train, held = split_by_task(records, 0.25, seed=0)
  tasks_train, tasks_held = {r.task.task_id for r in train}, {r.task.task_id for r in held}
  assert not tasks_train & tasks_held and len(tasks_held) == round(0.25 * len(tasks_train | tasks_held))
  assert sorted(r.episode_id for r in train + held) == sorted(r.episode_id for r in records)
  assert split_by_task(records[::-1], 0.25, seed=0)[1] == held[::-1]  # by task hash, not by position
  assert {r.task.task_id for r in split_by_task(records, 0.25, seed=1)[1]} != tasks_held
  assert split_by_task(records, 0.0)[1] == [] and len(split_by_task(records[:1], 0.5)[1]) == 0
  with pytest.raises(ValueError, match="held_out_fraction"):
    split_by_task(records, 1.0)


def test_examples_retrieve_no_own_episode_and_mask_exactly_the_target(small_model):
  records, folder = small_model
  records = records[::3]  # 100 episodes of every policy
  _, _, tok = load_model(folder)
  retriever = Retriever(BackbonePooledEncoder.from_folder(folder))
  builder = ExampleBuilder(tok, FMT, 4096)
  data = build_sft_data(records, builder, retriever, held_out_fraction=0.25, seed=0)
  train_episodes = {r.episode_id for r in data.train_records}
  assert len(data.train) + len(data.held_out) == sum(r.num_steps for r in records)  # nothing dropped at 4096
  assert len(retriever) == sum(r.num_steps for r in data.train_records)
  assert any(d.task == ex.transition.task for ex in data.train for d in ex.retrieved)  # other episodes of a task
  other_tasks = build_examples(builder, data.train_records, data.annotations, retriever, {}, exclude="task")
  assert all(len(ex.retrieved) == FMT.k and all(d.task != ex.transition.task for d in ex.retrieved)
             for ex in other_tasks)
  eot = tok.decode([tok.chat_format.end_of_turn])
  by_id = {r.episode_id: r for r in records}
  for i, ex in enumerate(data.train + data.held_out):
    t = ex.transition
    assert len(ex.retrieved) == FMT.k
    assert all(d.episode_id != t.episode_id and d.episode_id in train_episodes for d in ex.retrieved)
    # the state's recorded list in the prompt, the next step's as the target (none after the end)
    steps = by_id[t.episode_id].steps
    assert ex.admissible == steps[t.step].admissible
    assert ex.next_admissible == (() if t.done else steps[t.step + 1].admissible)
    if i % 4:
      continue  # the token-level checks below on every fourth example
    reason = data.annotations[t.episode_id].reasons[t.step]
    target = transition_target(FMT, t, reason, ex.next_admissible)
    history = t.history[len(t.history) - ex.shown_history:]
    prompt = build_prompt(tok, FMT, t.instruction, history, ex.retrieved, t.state, t.action, step=t.step,
                          admissible=ex.admissible).prompt()
    assert np.array_equal(ex.prompt, prompt) and ex.shown_history == min(t.step, FMT.max_history)
    assert tok.decode(ex.ids[ex.loss_mask == 1]) == target + eot
    assert np.array_equal(ex.regions > 0, ex.loss_mask == 1)
    assert tok.decode(ex.ids[ex.regions == REASONING]) == f"<think>\n{reason}\n</think>\n"
    assert tok.decode(ex.ids[ex.regions == NEXT_STATE]) == f"<next_state>\n{t.next_state}\n</next_state>\n"
    actions = "".join(f"{a}\n" for a in ex.next_admissible)
    assert tok.decode(ex.ids[ex.regions == ACTIONS]) == f"<actions>\n{actions}</actions>\n"
    assert tok.decode(ex.ids[ex.regions == OUTCOME]).startswith("<invalid>")
  assert {e.transition.episode_id for e in data.held_out} == {r.episode_id for r in data.held_out_records}


def test_fitting_trims_history_then_retrieval_then_drops(small_model):
  records, folder = small_model
  _, _, tok = load_model(folder)
  notes = annotations_for(records)
  later = [r for r in records if r.num_steps >= 3][:3]
  retrieved = [list(transitions(records[-1:]))[0]] * 2
  full = ExampleBuilder(tok, FMT, 4096)
  t = list(transitions(later))[2]
  ex = full.fit(t, retrieved, notes[t.episode_id].reasons[2])
  assert ex.shown_history == 2 and len(ex.retrieved) == 2
  stats: dict[str, int] = {}
  cut = ExampleBuilder(tok, FMT, len(ex.ids) - 1).fit(t, retrieved, notes[t.episode_id].reasons[2], stats=stats)
  assert cut.shown_history == 1 and len(cut.retrieved) == 2 and stats == {"trimmed_history": 1}
  stats = {}
  bare = ExampleBuilder(tok, FMT, 4096).fit(dataclasses.replace(t, history=()), [], notes[t.episode_id].reasons[2])
  tight = ExampleBuilder(tok, FMT, len(bare.ids)).fit(t, retrieved, notes[t.episode_id].reasons[2], stats=stats)
  assert (tight.shown_history, len(tight.retrieved)) == (0, 0) and np.array_equal(tight.ids, bare.ids)
  assert stats == {"trimmed_history": 1, "trimmed_retrieval": 1}
  stats = {}
  assert build_examples(ExampleBuilder(tok, FMT, 64), later, notes, None, stats) == []
  assert stats == {"dropped_too_long": sum(r.num_steps for r in later), "examples": 0}


def test_a_cut_episode_s_last_step_is_left_out_with_the_actions_block(small_model):
  """The last step of an episode cut before it ended has no recorded next list: no target rather than an empty one."""
  records, folder = small_model
  _, _, tok = load_model(folder)
  r = next(r for r in records if r.num_steps >= 3)
  cut = dataclasses.replace(r, steps=r.steps[:2], num_steps=2, success=False)
  notes = annotations_for([cut])
  assert list(action_lists([cut]))[-1] == (r.steps[1].admissible, None)
  stats: dict[str, int] = {}
  kept = build_examples(ExampleBuilder(tok, FMT, 4096), [cut], notes, None, stats)
  assert [e.transition.step for e in kept] == [0] and stats == {"dropped_unknown_actions": 1, "examples": 1}
  assert kept[0].next_admissible == r.steps[1].admissible
  stats = {}
  bare = dataclasses.replace(FMT, actions=False)  # without the block the step makes a target
  kept = build_examples(ExampleBuilder(tok, bare, 4096), [cut], notes, None, stats)
  assert len(kept) == 2 and stats == {"examples": 2} and kept[0].admissible == kept[0].next_admissible == ()
  assert not (kept[0].regions == ACTIONS).any()


def test_ablation_switches_shape_the_examples(small_model):
  records, folder = small_model
  _, _, tok = load_model(folder)
  notes = annotations_for(records)
  t = next(t for t in transitions(records) if t.step >= 1)
  retrieved = list(transitions(records[-1:]))[:1]
  for fmt, absent in [(dataclasses.replace(FMT, reasoning=False), "<think>"),
                      (dataclasses.replace(FMT, history=False), "# History"),
                      (dataclasses.replace(FMT, retrieval=False), "# Similar past transitions")]:
    ex = ExampleBuilder(tok, fmt, 4096).fit(t, retrieved, notes[t.episode_id].reasons[t.step])
    assert absent not in tok.decode(ex.ids)
    assert (ex.regions == REASONING).any() == fmt.reasoning
  with pytest.raises(ValueError, match="has no annotation"):
    annotations_for(records, {})


# --- metrics ---------------------------------------------------------------------------------------------------------


def _t(state: str, next_state: str, reward=0.0, done=False, success=False, invalid=False) -> Transition:
  return Transition("e", 0, None, "", state, "a", next_state, reward, done, success, invalid)


def test_score_matches_hand_computed_metrics():
  truths = [_t("s", "s"), _t("s", "x y z", 1.0, True, True), _t("s", "a b", invalid=True), _t("s", "q", 0.0, True)]
  preds = [ExpPrediction("s", 0.0, False, False, "", True, "", False),
           ExpPrediction("x y", 1.0, True, True, "", True, "", False),
           ExpPrediction("a b", 0.0, False, False, "", True, "", True),
           ExpPrediction.failure("missing <think>")]
  m = score(truths, preds)
  assert m["n"] == 4 and m["exact_match"] == 0.5 and m["exact_count"] == 2 and m["parse_failure"] == 0.25
  assert m["token_f1"] == pytest.approx((1 + 0.8 + 1 + 0) / 4, abs=1e-12)
  assert (m["reward_acc"], m["reward_precision"], m["reward_recall"]) == (1.0, 1.0, 1.0)
  assert (m["done_acc"], m["done_precision"], m["done_recall"]) == (1.0, 1.0, 1.0)  # failures end the episode
  assert (m["invalid_acc"], m["invalid_precision"], m["invalid_recall"]) == (1.0, 1.0, 1.0)
  assert (m["eps_R_mean"], m["eps_R_max"]) == (0.0, 0.0)
  m = score(truths[1:2], [ExpPrediction("x y z", 0.0, False, False, "", True, "", False)])
  assert m["reward_precision"] is None and m["reward_recall"] == 0.0 and m["eps_R_max"] == 1.0
  assert "actions_exact" not in m
  # admissible lists: exact (order included) and set F1, over the transitions whose next list is recorded
  preds = [ExpPrediction("s", 0.0, False, False, "", True, "", False, ("a", "b")),
           ExpPrediction("s", 0.0, False, False, "", True, "", False, ("b", "a", "c")),
           ExpPrediction("s", 0.0, False, False, "", True, "", False, ("a",)),
           ExpPrediction.failure("missing <actions>")]
  m = score(truths, preds, [("a", "b"), ("a", "b"), None, ("q",)])
  assert m["actions_exact"] == pytest.approx(1 / 3) and m["actions_f1"] == pytest.approx((1 + 0.8 + 0) / 3)
  with pytest.raises(ValueError, match="4 transitions but 1 admissible lists"):
    score(truths, preds, [()])
  assert token_f1("a a b", "a b b") == pytest.approx(2 / 3) and token_f1("", "") == 1.0 and token_f1("a", "") == 0.0


def test_region_logps_and_tv_bound_match_a_direct_forward(small_model):
  records, folder = small_model
  cfg, params, tok = load_model(folder)
  notes = annotations_for(records)
  builder = ExampleBuilder(tok, FMT, 4096)
  examples = build_examples(builder, records[:2], notes, None, {})[:3]
  sums, counts = region_logps(LogpScorer(cfg, 2), params, examples)
  for i, ex in enumerate(examples):
    ids = ex.ids[None]
    logits = Transformer(cfg).apply({"params": params}, ids, np.arange(len(ex.ids))[None], np.ones_like(ids, bool))
    logits = np.asarray(logits.logits[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    token_logp = np.r_[0.0, logp[np.arange(len(ex.ids) - 1), ex.ids[1:]]]
    for r in (REASONING, NEXT_STATE, ACTIONS, OUTCOME):
      assert counts[i, r] == (ex.regions == r).sum() > 0
      np.testing.assert_allclose(sums[i, r], token_logp[ex.regions == r].sum(), rtol=1e-5, atol=1e-4)
  tf = teacher_forced(LogpScorer(cfg, 2), params, examples)
  assert tf["nll_actions"] == pytest.approx(-sums[:, ACTIONS].sum() / counts[:, ACTIONS].sum())
  tv = 1 - np.exp(sums[:, REASONING] + sums[:, NEXT_STATE])
  assert tf["eps_P_tf_mean"] == pytest.approx(tv.mean()) and tf["nll"] == pytest.approx(-sums.sum() / counts.sum())


def test_predictor_output_does_not_depend_on_batch_neighbours(small_model):
  records, folder = small_model
  cfg, params, tok = load_model(folder)
  builder = ExampleBuilder(tok, FMT, 1024)
  examples = build_examples(builder, records[:6], annotations_for(records), None, {})
  predictor = Predictor(cfg, params, tok, builder, max_new_tokens=8, batch_size=4)
  alone = predictor.generate([examples[0].prompt])
  mixed = predictor.generate([e.prompt for e in examples[:6]])
  assert alone[0] == mixed[0] and len(mixed) == 6 and predictor.sampler.compilations() <= 3


def test_resampling_draws_only_the_malformed_answers_again(small_model):
  """`Predictor.resample` (SyntheticEnv's retries on held-out examples): a row whose answer parsed keeps it; each other
  row is drawn again at the retry temperature, up to `retries` times, attempt a of row i as that row alone would be
  drawn from seed + a; at temperature 0 nothing is drawn again."""
  records, folder = small_model
  cfg, params, tok = load_model(folder)
  builder = ExampleBuilder(tok, FMT, 1024)
  examples = build_examples(builder, records[:3], annotations_for(records), None, {})[:5]
  predictor = Predictor(cfg, params, tok, builder, max_new_tokens=8, batch_size=4)
  prompts, states = [e.prompt for e in examples], [e.transition.state for e in examples]
  shown = [e.admissible for e in examples]
  texts, preds = predictor.predict(prompts, states, shown)
  assert not any(p.ok for p in preds)  # a random model's 8 tokens never parse
  read = ExpPrediction("s", 0.0, False, False, "", True, "", False)
  texts[1], preds[1] = "kept", read
  again, final, attempts = predictor.resample(prompts, states, shown, texts, preds, retries=2, temperature=1.0, seed=5)
  assert attempts == [3, 1, 3, 3, 3] and final[1] is read and again[1] == "kept"
  for i in (0, 2, 3, 4):
    assert again[i] == predictor.generate([prompts[i]], 1.0, seed=7, ids=[i])[0] and not final[i].ok
  assert predictor.resample(prompts, states, shown, texts, preds, retries=2, temperature=0.0)[2] == [1] * 5


# --- training and the CI check ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(coin_path, tmp_path_factory) -> tuple[ExpSftConfig, dict]:
  cfg = load_config(TINY, [f"trajectories={coin_path}", f"out_dir={tmp_path_factory.mktemp('exp_sft')}",
                           "eval_retries=2"])
  with optimized():  # hundreds of steps: worth XLA's full optimisation
    return cfg, run(cfg)


def test_tiny_exp_model_beats_the_copy_baseline_on_held_out_tasks(trained):
  """On held-out tasks the model predicts rewards and episode ends (which the policy's returns come from) clearly
  better than the copy baseline, which repeats the state and predicts neither, gets some next states exactly, and
  lists most of the next state's admissible actions. Exact match is not compared with copying: with the actions block
  this tiny model rarely learns to copy the exit direction from the state, and exact match measured 0.11-0.31 over
  nine runs (seeds, sizes, learning rates), against 0.30-0.69 without the block (configs/train_exp_twx.py:tiny)."""
  cfg, summary = trained
  model, copy = summary["held_out_fidelity"]["model"], summary["held_out_fidelity"]["copy"]
  print(f"held-out one-step exact match: model {model['exact_match']:.3f} ({model['exact_count']}/{model['n']}), "
        f"copy {copy['exact_match']:.3f} ({copy['exact_count']}/{copy['n']})")
  assert model["n"] == copy["n"] > 40
  for key in ("reward_acc", "done_acc"):
    assert model[key] >= copy[key] + 0.1, (key, model[key], copy[key])
  assert model["exact_match"] >= 0.1 and model["parse_failure"] <= 0.05
  metrics = read_metrics(Path(cfg.out_dir) / "metrics.jsonl")
  losses = [m["loss"] for m in metrics if "loss" in m]
  assert losses[-1] < 0.2 * losses[0]
  checkpoint = Path(summary["checkpoint"])
  meta = json.loads((checkpoint / "exp_model.json").read_text())
  assert meta["format"] == dataclasses.asdict(cfg.format) and meta["max_len"] == cfg.max_len
  assert meta["format"]["actions"] and exp_format(meta) == cfg.format
  # the lists are learned (the copy baseline has none): F1 0.69-0.78 measured; whole lists exact 0.21-0.41
  assert model["actions_f1"] >= 0.65 and model["actions_exact"] >= 0.15, (model["actions_f1"], model["actions_exact"])
  assert (checkpoint / "tokenizer.json").is_file() and summary["compilations"] == 1
  # eval_retries: the same greedy answers, the malformed ones drawn again (SyntheticEnv's decoding at temperature 0)
  retried = summary["held_out_fidelity"]["retried"]
  assert retried["n"] == model["n"] and retried["retries"] == 2
  assert retried["exact_match"] >= model["exact_match"] and retried["parse_failure"] <= model["parse_failure"]
  rows = [json.loads(line) for line in (Path(cfg.out_dir) / "held_out_predictions.jsonl").read_text().splitlines()]
  assert all(r["attempts"] == 1 and r["retried_exact"] == r["exact"] for r in rows if r["ok"])
  assert all(1 <= r["attempts"] <= 3 for r in rows)
  assert sum(r["retried_exact"] for r in rows) == retried["exact_count"]


def test_fidelity_script_scores_a_checkpoint_and_prints_its_table(trained, coin_path, tmp_path, capsys):
  cfg, summary = trained
  out = tmp_path / "quality"
  args = ["--config", TINY, "--set", f"trajectories={coin_path}", "--tv-samples", "1", "--open-loop-steps", "3",
          "--retries", "2", "--out", str(out)]
  assert exp_model_quality.main(args + ["--checkpoints", f"full={summary['checkpoint']}"]) == 2
  assert "trained with reasoning=False, so it is not variant 'full'" in capsys.readouterr().err
  rc = exp_model_quality.main(args + ["--checkpoints", f"no_reasoning={summary['checkpoint']}"])
  printed = capsys.readouterr().out
  assert rc == 0 and "| no_reasoning |" in printed and "| copy baseline |" in printed
  assert "| no_reasoning, 2 resamples |" in printed
  assert (out / "table.md").read_text().strip() in printed
  plot = (out / "plot.svg").read_text()
  assert "<svg" in plot and "copy baseline" in plot and "steps since the real first state" in plot
  result = json.loads((out / "results.json").read_text())["no_reasoning"]
  one, loop = result["one_step"], result["open_loop"]
  assert one["exact_match"] == summary["held_out_fidelity"]["model"]["exact_match"]
  assert result["one_step_retried"] == summary["held_out_fidelity"]["retried"]  # the same seed draws the same
  assert 0.0 <= one["eps_P_sampled_mean"] <= one["eps_P_sampled_max"] <= 1.0
  assert 0.0 <= one["eps_P_tf_mean"] <= one["eps_P_tf_max"] <= 1.0
  # At horizon 1 the open-loop prompt is the one-step prompt of each episode's first transition.
  rows = [json.loads(line) for line in (out / "no_reasoning_predictions.jsonl").read_text().splitlines()]
  first = [r["exact"] for r in rows if r["step"] == 0]
  assert loop["exact_by_step"][0] == pytest.approx(np.mean(first)) and result["horizon"] == 3
  copy_first = [r["true_next_state"] == r["state"] for r in rows if r["step"] == 0]
  assert result["open_loop_copy"]["exact_by_step"][0] == pytest.approx(np.mean(copy_first))


def test_an_m_exp_without_the_actions_block_is_refused(tmp_path):
  """A folder written before the actions block (its format has no `actions`) was trained without it: DreamGym, whose
  SyntheticEnv needs the block, refuses it before loading any weights; a run that asks for no block gets it."""
  old = {"format": {k: v for k, v in dataclasses.asdict(ExpFormatConfig(reasoning=False)).items() if k != "actions"}}
  assert exp_format(old) == ExpFormatConfig(reasoning=False, actions=False)
  assert exp_format({"format": dataclasses.asdict(ExpFormatConfig())}).actions
  (tmp_path / "exp_model.json").write_text(json.dumps(old))
  with pytest.raises(ValueError, match=r"records format.actions=false .* but this run expects actions=true"):
    load_exp_model(str(tmp_path), reasoning=False, replay=True, dtype="float32", mesh=None)
  with pytest.raises(ValueError, match="reasoning"):  # past the actions check, the reasoning one still holds
    load_exp_model(str(tmp_path), reasoning=True, replay=True, dtype="float32", mesh=None, actions=False)


def test_config_variants_load_and_bad_settings_are_refused():
  assert load_config(TINY, []).format.k == 1
  assert load_config(TINY.rsplit(":", 1)[0], ["batch_size=64"]).batch_size == 64
  with pytest.raises(ValueError, match="defines no nope"):
    load_config(TINY.rsplit(":", 1)[0] + ":nope", [])
  with pytest.raises(ValueError, match="retrieval_encoder"):
    ExpSftConfig(retrieval_encoder="bert")
  with pytest.raises(ValueError, match=r"group_rows must be 0 or a multiple of batch_size \(8\), got 20"):
    ExpSftConfig(batch_size=8, group_rows=20)


def test_grouped_batches_hold_the_same_rows_sorted_by_length_in_a_seeded_order():
  n, bs, window = 96, 8, 32  # three windows an epoch
  lengths = np.random.default_rng(1).integers(300, 900, n)
  plain = np.concatenate(list(_batches(n, bs, 36, seed=3)))
  grouped = list(_batches(n, bs, 36, seed=3, lengths=lengths, group_rows=window))
  assert len(grouped) == 36 and all(len(b) == bs for b in grouped)
  flat = np.concatenate(grouped)
  for epoch in range(3):  # every row once an epoch
    assert sorted(flat[epoch * n:(epoch + 1) * n]) == list(range(n))
  for w in range(len(flat) // window):
    rows = slice(w * window, (w + 1) * window)
    if w < n // window:  # the first epoch's windows hold the plain stream's rows (later ones its own permutations)
      assert sorted(flat[rows]) == sorted(plain[rows])
    batches = grouped[w * window // bs:(w + 1) * window // bs]
    spans = sorted((lengths[b].min(), lengths[b].max()) for b in batches)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))  # batches cut a sorted window
  maxima = [lengths[b].max() for b in grouped]
  assert maxima != sorted(maxima)  # taken in a seeded random order, not shortest first
  again = list(_batches(n, bs, 36, seed=3, lengths=lengths, group_rows=window))
  assert all((a == b).all() for a, b in zip(grouped, again))
  # A grouped batch pads to within 128 of its longest row; ungrouped widths stay powers of two.
  assert length_buckets(896, grouped=True) == (128, 256, 384, 512, 640, 768, 896)
  assert length_buckets(896) == (64, 128, 256, 512, 896)


# --- require_teacher_annotations: the scale configs' guard against training M_exp on rule-based reasoning ----------

def _guard_data(tmp_path: Path):
  """Four hand-made two-step coin episodes, and one annotation file per annotator mix (teacher only; rules; a teacher
  file with two fallbacks; teacher plus a stray rules line for an episode that is not read)."""
  from dreamjax.data.records import StepRecord, TrajectoryRecord
  from dreamjax.envs.base import Task
  from dreamjax.experience.annotate import Annotation, write_annotations

  records = []
  for i in range(4):
    task = Task.make("textworld_express", f"coin/train/{i}", "Find the coin.", game="coin", seed=i)
    steps = (StepRecord("You are in the kitchen. Exits: north.", "move north", "You are in the hall. You see a coin.",
                        0.0, False, False, False, ("move north", "look around"), "expert"),
             StepRecord("You are in the hall. You see a coin.", "take coin", "You take the coin.", 1.0, True, True,
                        False, ("take coin", "move south"), "expert"))
    records.append(TrajectoryRecord(f"expert:coin/train/{i}", task.env, task, task.instruction, "expert", i, steps,
                                    True, 2, 1.0))
  data = tmp_path / "trajectories.jsonl"
  data.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))

  def note(r, annotator):
    return Annotation(r.episode_id, "Go north, then take the coin.", ("The coin is north.", "The coin is here."),
                      annotator)

  files = {}
  mixes = {"teacher": ["teacher:llama-70b"] * 4, "rules": ["rules:textworld_express"] * 4,
           "fallback": ["teacher:llama-70b", "rules:textworld_express (teacher fallback)"] * 2}
  for name, annotators in mixes.items():
    files[name] = tmp_path / f"annotations.{name}.jsonl"
    write_annotations(files[name], [note(r, a) for r, a in zip(records, annotators)])
  stray = dataclasses.replace(records[0], episode_id="expert:coin/train/99")
  files["stray"] = tmp_path / "annotations.stray.jsonl"
  write_annotations(files["stray"], [note(r, "teacher:llama-70b") for r in records] + [note(stray, "rules:x")])
  return records, data, files


def test_teacher_guard_refuses_rule_based_annotations_and_fallbacks(tmp_path):
  from dreamjax.commands.train_exp import annotation_source, check_teacher_annotations
  from dreamjax.experience.annotate import Annotation, read_annotations

  records, data, files = _guard_data(tmp_path)
  kinds = [annotation_source(Annotation("e", "", (), name)) for name in
           ("teacher:gpt-4o", "rules:alfworld", "rules:alfworld (teacher fallback)", "", "gpt-4o")]
  assert kinds == ["teacher", "rules", "fallback", "rules", "rules"]  # an unnamed annotator is no teacher either
  check = lambda *names: check_teacher_annotations(  # noqa: E731
      {str(files[n]): read_annotations(files[n]) for n in names}, records, (str(data),))
  check("teacher")
  check("stray")  # the rules line annotates an episode that is not read
  with pytest.raises(ValueError) as e:
    check("teacher", "fallback")
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"{files['fallback']}: 2 of the 4 annotations used are not a teacher")
  assert "'rules:textworld_express (teacher fallback)'; 2 of them teacher fallbacks" in msg
  assert "require_teacher_annotations=false" in msg and "dreamjax annotate" in msg
  with pytest.raises(ValueError, match=r"annotations\.rules\.jsonl: 4 of the 4 .*'rules:textworld_express'; 0 of them"):
    check("rules")
  with pytest.raises(ValueError, match=r"no annotation files .* \(rules:textworld_express\) .*trajectories\.jsonl"):
    check_teacher_annotations({}, records, (str(data),))


def test_teacher_guard_in_train_exp_both_ways(tmp_path):
  """The run refuses before building a model (flag on, rule-based or no annotations) and trains with a teacher's
  annotations (flag on) or, overridden, with the rule-based ones."""
  _, data, files = _guard_data(tmp_path)
  base = dataclasses.replace(
      load_config(TINY, []), trajectories=(str(data),), format=ExpFormatConfig(k=0, retrieval=False, max_history=1),
      steps=1, eval_every=0, held_out_fraction=0.0, batch_size=2, require_teacher_annotations=True)
  for annotations, match in (((str(files["rules"]),), "annotations.rules.jsonl: 4 of the 4"),
                             ((), "no annotation files are given")):
    out = tmp_path / f"refused{len(annotations)}"
    with pytest.raises(ValueError, match=match):
      run(dataclasses.replace(base, annotations=annotations, out_dir=str(out)))
    assert not (out / "init").exists()  # refused before the tiny model was built
  summary = run(dataclasses.replace(base, annotations=(str(files["teacher"]),), out_dir=str(tmp_path / "teacher")))
  assert summary["steps"] == 1 and summary["examples"] == 8
  overridden = dataclasses.replace(base, annotations=(str(files["rules"]),), require_teacher_annotations=False,
                                   out_dir=str(tmp_path / "overridden"))
  assert run(overridden)["steps"] == 1
  assert load_config(TINY, ["require_teacher_annotations=true"]).require_teacher_annotations
