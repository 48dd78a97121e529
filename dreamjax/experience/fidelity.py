"""How faithful the experience model is to the real env, on held-out real trajectories.

Two protocols (`one_step`, `open_loop`), each scored against the real transitions by `score`, next to the
copy-the-state baseline (next state = current state, reward 0, not done, valid: what a model that learned nothing
about the dynamics would say):
- **Teacher-forced one step**: the prompt is built from the true history and true current state (exactly the SFT
  example's prompt); M_exp decodes greedily and its output is parsed.
- **Open-loop multi-step**: from the episode's real first state, M_exp's own predicted states are fed back as the
  current state and history along the recorded action sequence (retrieval queried with the predicted state, and
  the predicted admissible actions shown as the current ones, as SyntheticEnv does); step h is compared with the real
  state after h actions. Copy baseline: the first state forever.

A third protocol audits a DreamGym run rather than a held-out set:
- **On policy** (`replay_in_env`, scored by `on_policy`): the synthetic episodes the policy played in M_exp (the
  replay buffer's write-back) have their actions replayed in the real env from the same task's reset. Step h
  compares M_exp's state after h actions with the real one, as open loop does, but along the policy's actions, which
  is what the update learns from; and each episode M_exp ended is compared with what the real env did on the same
  actions (success precision: of the episodes M_exp called successes, the share the real env calls successes).

Metrics (`score`): next-state exact match (on TextWorld-Express also apart on the transitions whose next state the
prompt determines and on those that reveal a room it does not show, `reveal_mask`) and whitespace-token F1;
accuracy, precision and recall of the reward (positive: reward 1), success, done and invalid flags (precision is None
when nothing is predicted positive, recall when nothing is); the parse-failure rate; with the format's actions block,
`actions_exact` (the predicted list of admissible actions is the recorded one, order included) and `actions_f1` (F1 of
the two lists as sets), over the transitions whose next list is recorded; and the two error terms of the paper's
bound (Appendix B), which it defines as suprema and never measures:
- eps_R = sup |R - R_hat|: reported as the mean and the max of |r - r_hat| over held-out transitions (greedy r_hat; a
  failed parse predicts 0). The max over a sample is all a finite set can give of the sup.
- eps_P = sup TV(P(.|s, a), P_hat(.|s, a)). Write q(s') for the model's probability of writing next state s'. For a
  transition whose real next state is s* with probability P(s*), E_{s*~P}[1 - q(s*)] = 1 - sum_s P(s) q(s) >=
  1 - sum_s min(P(s), q(s)) = TV, with equality when P is a point mass (a deterministic env such as TextWorld-Express,
  given the full history). So 1 - q(s*) per held-out transition estimates TV from above, exactly for deterministic
  dynamics. Two estimates of q(s*):
  * `eps_P_sampled`: the fraction of n samples at temperature 1 whose parsed next state equals s*: unbiased for q(s*)
    with reasoning marginalised (the sampled max over transitions is biased upwards at small n);
  * `eps_P_tf`: from teacher-forced log-probs, q(s*) >= p(R*) p(<next_state> block of s* | R*) (one reasoning trace of
    the sum over traces, one tokenization of s*, and the newline after the closing tag included), so
    1 - exp(logp) bounds each transition's TV from above; without reasoning the R* factor is absent.
  The copy baseline is deterministic: its TV per transition is 1 - [s* == s].
Teacher-forced NLL per target token is reported by region (reasoning, next state, actions, outcome flags): Eq. 5's
two terms, the actions block apart.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from dreamjax.parallel.distributed import to_host
from dreamjax.data.records import TrajectoryRecord, Transition, transitions
from dreamjax.envs.base import ENV_ERROR, Env, env_failed
from dreamjax.envs import alfworld, twx_explorer
from dreamjax.experience.annotate import Annotation
from dreamjax.experience.format import ExpFormatConfig, ExpPrediction, action_lists, parse_output, transition_target
from dreamjax.experience.sft_data import NEXT_STATE, REASONING, REGION_NAMES, ExampleBuilder, ExpExample, retrieve
from dreamjax.models import ModelConfig
from dreamjax.models.params import sampling_copy
from dreamjax.replay.retriever import Retriever
from dreamjax.rl.logprobs import LogpScorer
from dreamjax.sampling import Sampler, left_pad, sampling_params
from dreamjax.text import Tokenizer

MIN_BUCKET = 64


def prompt_buckets(max_len: int) -> tuple[int, ...]:
  """Prompt lengths the sampler compiles for: powers of two from 64, then `max_len` rounded up to 64."""
  top = -(-max_len // MIN_BUCKET) * MIN_BUCKET
  out, b = [], MIN_BUCKET
  while b < top:
    out.append(b)
    b *= 2
  return (*out, top)


def _bucket(n: int, buckets: Sequence[int]) -> int:
  return next((b for b in buckets if b >= n), -(-n // MIN_BUCKET) * MIN_BUCKET)


class Predictor:
  """M_exp as a batched text predictor: prompts in, decoded outputs and parsed predictions out.

  Prompts are left-padded to a few bucket lengths and grouped into batches of exactly `batch_size` rows (short
  groups repeat their last row), so the sampler compiles once per bucket. Row i of a call draws from
  fold_in(key(seed), ids[i]) (ids: the rows' indices unless given), so a prompt's sample does not depend on its batch
  neighbours.
  """

  def __init__(self, model_cfg: ModelConfig, params: Any, tokenizer: Tokenizer, builder: ExampleBuilder,
               max_new_tokens: int, batch_size: int = 16, mesh: jax.sharding.Mesh | None = None):
    self.tokenizer, self.builder, self.fmt = tokenizer, builder, builder.fmt
    self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
    self.model_cfg = model_cfg
    self.sampler = Sampler(model_cfg, max_new_tokens, pad_id=tokenizer.pad_id, mesh=mesh)
    self.set_params(params)
    self.buckets = prompt_buckets(builder.max_len)
    self.stop = [[i] for i in tokenizer.eos_ids]

  def set_params(self, params: Any) -> None:
    """Uses `params` (training parameters) from now on, as the sampler wants them (`sampling_copy`: unrolled, in the
    compute dtype, resharded for sampling when there is a mesh); None drops the copy (a training loop holds it only
    while it evaluates)."""
    shardings = None if self.sampler.mesh is None else self.sampler.param_shardings()
    self.params = None if params is None else sampling_copy(params, self.model_cfg, shardings)

  def generate(self, prompts: Sequence[np.ndarray], temperature: float = 0.0, seed: int = 0,
               ids: Sequence[int] | None = None) -> list[str]:
    """Decoded outputs (without the stop token), one per prompt."""
    ids = range(len(prompts)) if ids is None else ids
    out: list[str] = [""] * len(prompts)
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prompts):
      groups[_bucket(len(p), self.buckets)].append(i)
    base = jax.random.key(seed)
    for width, rows in sorted(groups.items()):
      for start in range(0, len(rows), self.batch_size):
        chunk = rows[start:start + self.batch_size]
        padded = chunk + [chunk[-1]] * (self.batch_size - len(chunk))
        tokens, mask = left_pad([prompts[i] for i in padded], self.batch_size, width, self.tokenizer.pad_id)
        keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(np.asarray([ids[i] for i in padded], np.uint32))
        sp = sampling_params(self.batch_size, self.max_new_tokens, temperature, stop=self.stop)
        res = to_host(self.sampler(self.params, tokens, mask, keys, sp))  # gathers rows sharded over other processes
        for j, i in enumerate(chunk):
          n = int(res.lengths[j]) - int(bool(res.stopped[j]))  # the stop token is not part of the answer
          out[i] = self.tokenizer.decode(res.tokens[j, :n])
    return out

  def predict(self, prompts: Sequence[np.ndarray], states: Sequence[str], admissible: Sequence[Sequence[str]],
              temperature: float = 0.0, seed: int = 0, ids: Sequence[int] | None = None
              ) -> tuple[list[str], list[ExpPrediction]]:
    """Greedy (or sampled) answers to `prompts`, parsed against each prompt's current state and admissible actions."""
    texts = self.generate(prompts, temperature, seed, ids)
    return texts, [parse_output(t, self.fmt, s, a) for t, s, a in zip(texts, states, admissible, strict=True)]

  def resample(self, prompts: Sequence[np.ndarray], states: Sequence[str], admissible: Sequence[Sequence[str]],
               texts: Sequence[str], preds: Sequence[ExpPrediction], retries: int, temperature: float = 1.0,
               seed: int = 0) -> tuple[list[str], list[ExpPrediction], list[int]]:
    """What SyntheticEnv's retries make of a first answer (`texts`, `preds`): each malformed answer is drawn again
    at `temperature`, up to `retries` times (attempt a of row i from fold_in(key(seed + a), i)). Returns the final
    texts, predictions and attempts per row."""
    texts, preds, attempts = list(texts), list(preds), [1] * len(preds)
    for attempt in range(1, retries + 1 if temperature > 0 else 1):  # greedy would write the same answer again
      bad = [i for i, p in enumerate(preds) if not p.ok]
      if not bad:
        break
      again, parsed = self.predict([prompts[i] for i in bad], [states[i] for i in bad], [admissible[i] for i in bad],
                                   temperature, seed + attempt, ids=bad)
      for i, t, p in zip(bad, again, parsed):
        texts[i], preds[i], attempts[i] = t, p, attempt + 1
    return texts, preds, attempts


# --- scoring ---------------------------------------------------------------------------------------------------------


def token_f1(predicted: str, true: str) -> float:
  """Bag-of-whitespace-tokens F1 (SQuAD style); 1 when both are empty."""
  p, t = predicted.split(), true.split()
  if not p and not t:
    return 1.0
  common = sum((collections.Counter(p) & collections.Counter(t)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(p), common / len(t)
  return 2 * precision * recall / (precision + recall)


def _rate(num: int, den: int) -> float | None:
  return num / den if den else None


def _flag_metrics(name: str, pred: np.ndarray, true: np.ndarray) -> dict[str, float | None]:
  return {f"{name}_acc": float(np.mean(pred == true)) if len(true) else None,
          f"{name}_precision": _rate(int(np.sum(pred & true)), int(np.sum(pred))),
          f"{name}_recall": _rate(int(np.sum(pred & true)), int(np.sum(true)))}


def copy_prediction(t: Transition) -> ExpPrediction:
  """The copy-the-state baseline's prediction for a transition."""
  return ExpPrediction(t.state, 0.0, False, False, "", True, "", False)


def _set_f1(predicted: Sequence[str], true: Sequence[str]) -> float:
  p, t = set(predicted), set(true)
  if not p and not t:
    return 1.0
  common = len(p & t)
  return 2 * common / (len(p) + len(t))


# The envs whose states say what a step reveals: TextWorld-Express (a room not seen yet) and ALFWorld (an object no
# shown state lists: a receptacle's contents, seen on arriving or opening it).
REVEALS = {"textworld_express": twx_explorer.reveals, "alfworld": alfworld.reveals}


def reveal_mask(truths: Sequence[Transition], fmt: ExpFormatConfig) -> list[bool] | None:
  """Per transition, whether its real next state reveals what the prompt's states (the current one and the history
  `fmt` shows) do not (`REVEALS`); None unless every transition is of one env with such a reader. The history counted
  is the last `fmt.max_history` steps, an upper bound on what a prompt cut to its length budget shows."""
  envs = {t.task.env for t in truths}
  if len(envs) != 1 or not envs <= REVEALS.keys():
    return None
  reveals, depth = REVEALS[envs.pop()], fmt.max_history if fmt.history else 0
  return [reveals([s for s, _ in (t.history[-depth:] if depth else ())] + [t.state], t.next_state)
          for t in truths]


def score(truths: Sequence[Transition], preds: Sequence[ExpPrediction],
          admissible: Sequence[Sequence[str] | None] | None = None,
          reveal: Sequence[bool] | None = None) -> dict[str, Any]:
  """Fidelity metrics of predictions against real transitions (see the module docstring). `admissible`: the actions
  admissible after each transition (None where not recorded), to score the predicted lists against. `reveal`
  (`reveal_mask`): exact match is also given apart on the transitions whose next state the prompt determines and on
  those that reveal unseen parts of the world, with the latter's share."""
  if len(truths) != len(preds):
    raise ValueError(f"score: {len(truths)} transitions but {len(preds)} predictions")
  for name, given in (("admissible lists", admissible), ("reveal flags", reveal)):
    if given is not None and len(given) != len(truths):
      raise ValueError(f"score: {len(truths)} transitions but {len(given)} {name}")
  n = len(truths)
  if n == 0:
    return {"n": 0}
  exact = np.array([p.next_state == t.next_state for t, p in zip(truths, preds)])
  out: dict[str, Any] = {
      "n": n,
      "exact_match": float(exact.mean()),
      "exact_count": int(exact.sum()),
      "token_f1": float(np.mean([token_f1(p.next_state, t.next_state) for t, p in zip(truths, preds)])),
      "parse_failure": float(np.mean([not p.ok for p in preds])),
  }
  for name in ("reward", "success", "done", "invalid"):
    if name == "reward":
      pred = np.array([p.reward == 1.0 for p in preds])
      true = np.array([t.reward == 1.0 for t in truths])
    else:
      pred = np.array([bool(getattr(p, name)) for p in preds])
      true = np.array([bool(getattr(t, name)) for t in truths])
    out |= _flag_metrics(name, pred, true)
  if reveal is not None:
    hidden = np.array(reveal, bool)
    out["reveal_fraction"] = float(hidden.mean())
    out["exact_match_determined"] = float(exact[~hidden].mean()) if (~hidden).any() else None
    out["exact_match_reveal"] = float(exact[hidden].mean()) if hidden.any() else None
  err = np.abs(np.array([t.reward for t in truths]) - np.array([p.reward for p in preds]))
  out["eps_R_mean"], out["eps_R_max"] = float(err.mean()), float(err.max())
  if admissible is not None:
    known = [(tuple(a), p.admissible) for a, p in zip(admissible, preds) if a is not None]
    out["actions_exact"] = float(np.mean([a == q for a, q in known])) if known else None
    out["actions_f1"] = float(np.mean([_set_f1(q, a) for a, q in known])) if known else None
  return out


# --- one step --------------------------------------------------------------------------------------------------------


def region_logps(scorer: LogpScorer, params: Any, examples: Sequence[ExpExample],
                 pad_to: int = MIN_BUCKET) -> tuple[np.ndarray, np.ndarray]:
  """(summed log-prob [N, R], token count [N, R]) of each example's regions, indexed by region code (R = the largest
  code + 1; the PROMPT column is unused), teacher-forced."""
  width = max(REGION_NAMES) + 1
  sums = np.zeros((len(examples), width), np.float64)
  counts = np.zeros((len(examples), width), np.int64)
  order = np.argsort([len(e.ids) for e in examples], kind="stable")  # similar lengths share a padded batch
  for start in range(0, len(examples), scorer.batch_size):
    rows = order[start:start + scorer.batch_size]
    width = -(-max(len(examples[i].ids) for i in rows) // pad_to) * pad_to
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros(tokens.shape, bool)
    for j, i in enumerate(rows):
      tokens[j, :len(examples[i].ids)], valid[j, :len(examples[i].ids)] = examples[i].ids, True
    logp, _ = scorer(params, tokens, None, valid)
    for j, i in enumerate(rows):
      e = examples[i]
      lp = logp[j, :len(e.ids)]
      for r in REGION_NAMES:
        sel = (e.regions == r) & (e.loss_mask == 1)
        sums[i, r], counts[i, r] = float(lp[sel].sum()), int(sel.sum())
  return sums, counts


def teacher_forced(scorer: LogpScorer, params: Any, examples: Sequence[ExpExample]) -> dict[str, Any]:
  """NLL per target token by region and overall, and the teacher-forced eps_P bound (module docstring)."""
  if not examples:
    return {}
  sums, counts = region_logps(scorer, params, examples)
  out: dict[str, Any] = {}
  for r, name in REGION_NAMES.items():
    out[f"nll_{name}"] = float(-sums[:, r].sum() / counts[:, r].sum()) if counts[:, r].sum() else None
  out["nll"] = float(-sums.sum() / counts.sum())
  tv = 1.0 - np.exp(sums[:, REASONING] + sums[:, NEXT_STATE])
  out["eps_P_tf_mean"], out["eps_P_tf_max"] = float(tv.mean()), float(tv.max())
  return out


def one_step(predictor: Predictor, examples: Sequence[ExpExample], *, scorer: LogpScorer | None = None,
             tv_samples: int = 0, seed: int = 0, retries: int = 0, retry_temperature: float = 1.0) -> dict[str, Any]:
  """Teacher-forced one-step fidelity of M_exp and of the copy baseline on `examples`.

  Returns {"model": metrics, "copy": metrics, "rows": per-example predictions}; with a `scorer`, the model's metrics
  include the teacher-forced NLLs and eps_P bound; with `tv_samples` n > 0, the sampled eps_P estimate. "model" scores
  the greedy answers; with `retries` > 0, "retried" scores what SyntheticEnv makes of them at temperature 0 with that
  many resamples at `retry_temperature` (`Predictor.resample`), and each row gains its attempts and exact match.
  """
  truths = [e.transition for e in examples]
  prompts = [e.prompt for e in examples]
  states = [t.state for t in truths]
  shown = [e.admissible for e in examples]
  texts, preds = predictor.predict(prompts, states, shown)
  reveal = reveal_mask(truths, predictor.fmt)
  next_lists = [e.next_admissible for e in examples] if predictor.fmt.actions else None
  model = score(truths, preds, next_lists, reveal)
  copy = score(truths, [copy_prediction(t) for t in truths], reveal=reveal)
  if examples:
    tv_copy = np.array([t.next_state != t.state for t in truths], np.float64)
    copy["eps_P_mean"], copy["eps_P_max"] = float(tv_copy.mean()), float(tv_copy.max())
  if scorer is not None:
    model |= teacher_forced(scorer, predictor.params, examples)
  if tv_samples > 0 and examples:
    hits = np.zeros(len(examples))
    for s in range(tv_samples):
      _, sampled = predictor.predict(prompts, states, shown, temperature=1.0, seed=seed + 1 + s)
      hits += [p.next_state == t.next_state for t, p in zip(truths, sampled)]
    tv = 1.0 - hits / tv_samples
    model |= {"eps_P_sampled_mean": float(tv.mean()), "eps_P_sampled_max": float(tv.max()), "tv_samples": tv_samples}
  rows = [{"episode_id": t.episode_id, "step": t.step, "state": t.state, "action": t.action,
           "true_next_state": t.next_state, "output": text, "ok": p.ok, "error": p.error,
           "exact": p.next_state == t.next_state}
          for t, text, p in zip(truths, texts, preds)]
  out = {"model": model, "copy": copy, "rows": rows}
  if retries > 0:
    _, again, attempts = predictor.resample(prompts, states, shown, texts, preds, retries, retry_temperature, seed)
    out["retried"] = score(truths, again, next_lists, reveal) | {"retries": retries,
                                                                 "retry_temperature": retry_temperature}
    for row, t, p, a in zip(rows, truths, again, attempts):
      row |= {"attempts": a, "retried_exact": p.next_state == t.next_state}
  return out


# --- open loop -------------------------------------------------------------------------------------------------------


def _horizon_curve(truths: list[list[Transition]], preds: list[list[ExpPrediction]], horizon: int) -> list[float]:
  curve = []
  for h in range(horizon):
    pairs = [(t[h], p[h]) for t, p in zip(truths, preds) if len(t) > h]
    curve.append(float(np.mean([p.next_state == t.next_state for t, p in pairs])) if pairs else math.nan)
  return curve


def open_loop(predictor: Predictor, records: Sequence[TrajectoryRecord], annotations: dict[str, Annotation],
              retriever: Retriever | None, max_steps: int = 20) -> dict[str, Any]:
  """Open-loop rollouts of M_exp along each record's actions (see the module docstring), and the copy baseline.

  Each step's prompt is fitted like the SFT example of the real step (the real target's tokens and the assistant
  wrapper's closing are reserved), so at step 1 the prompt is exactly the one-step prompt. Returns {"model", "copy"}
  metrics over all steps, each with "exact_by_step" (exact match at horizon 1, 2, ...) and "episode_exact" (episodes
  whose every step matched), plus "horizon".
  """
  builder, fmt, tok = predictor.builder, predictor.fmt, predictor.tokenizer
  kept = [r for r in records if r.steps]
  episodes = [list(transitions([r]))[:max_steps] for r in kept]
  lists = [list(action_lists([r]))[:max_steps] for r in kept]  # (recorded list, next recorded list) per step
  states = [e[0].state for e in episodes]
  shown = [lst[0][0] for lst in lists]  # the admissible actions shown: the recorded first list, then predicted ones
  history: list[list[tuple[str, str]]] = [[] for _ in episodes]
  preds: list[list[ExpPrediction]] = [[] for _ in episodes]
  horizon = max((len(e) for e in episodes), default=0)
  for h in range(horizon):
    live = [i for i, e in enumerate(episodes) if len(e) > h]
    steps = [episodes[i][h] for i in live]
    found = retrieve(retriever, fmt, [states[i] for i in live], [t.action for t in steps],
                     [t.episode_id for t in steps])
    prompts = []
    for i, t, neighbours in zip(live, steps, found):
      reasoning = annotations[t.episode_id].reasons[t.step]
      following = lists[i][h][1] or ()  # an unknown list (a cut episode's last step) reserves an empty block
      reserve = len(tok.encode(transition_target(fmt, t, reasoning, following, lists[i][h][0]))) + len(
          tok.chat_format.assistant.suffix)
      prompts.append(builder.prompt(t.instruction, history[i], neighbours, states[i], t.action, h, reserve,
                                    admissible=shown[i]))
    _, out = predictor.predict(prompts, [states[i] for i in live], [shown[i] for i in live])
    for i, t, p in zip(live, steps, out):
      preds[i].append(p)
      history[i].append((states[i], t.action))
      states[i], shown[i] = p.next_state, p.admissible
  copies = [[ExpPrediction(e[0].state, 0.0, False, False, "", True, "", False) for _ in e] for e in episodes]
  result: dict[str, Any] = {"horizon": horizon}
  flat_lists = [following for e in lists for _, following in e] if fmt.actions else None
  flat_t = [t for e in episodes for t in e]
  reveal = reveal_mask(flat_t, fmt)
  for name, ps in (("model", preds), ("copy", copies)):
    flat_p = [p for e in ps for p in e]
    m = score(flat_t, flat_p, flat_lists if name == "model" else None, reveal)
    m["exact_by_step"] = _horizon_curve(episodes, ps, horizon)
    m["episode_exact"] = float(np.mean([all(p.next_state == t.next_state for t, p in zip(e, q))
                                        for e, q in zip(episodes, ps)])) if episodes else None
    result[name] = m
  return result



# --- on policy -------------------------------------------------------------------------------------------------------


def synthetic_episodes(items: Iterable[Transition]) -> list[list[Transition]]:
  """The synthetic transitions among `items` (a DreamGym replay buffer's write-back) grouped into their episodes, in
  step order. Write-back keeps every step M_exp answered under its turn index, so an episode's steps are distinct: a
  step twice is an error naming the episode. Steps may skip a turn: one whose answer did not parse never reached
  M_exp (twc seed 0's DreamGym GRPO had 2 such episodes of 3,117, after M_exp listed "(no change)" as an action),
  and replaying the rest in order steps the real env as the rollout stepped M_exp. An episode's last step is missing
  only where M_exp failed on it (an env failure)."""
  episodes: dict[str, list[Transition]] = {}
  for t in items:
    if t.origin == "synthetic":
      episodes.setdefault(t.episode_id, []).append(t)
  for eid, steps in episodes.items():
    steps.sort(key=lambda t: t.step)
    if len({t.step for t in steps}) != len(steps):
      raise ValueError(f"synthetic episode {eid!r}: steps {[t.step for t in steps]} repeat a step")
  return list(episodes.values())


Replay = tuple[Sequence[Transition], list[tuple[Transition, ExpPrediction]], bool]


def replay_in_env(env: Env, episodes: Sequence[Sequence[Transition]]) -> list[Replay | None]:
  """Each synthetic episode (`synthetic_episodes`) replayed in the real `env` from its task's reset with the same
  actions, up to the real end: (its steps, (the real transition, M_exp's step as a prediction) per replayed step,
  whether the real env reached success). None for an episode of a curriculum-generated task (params
  "generated_from"): its instruction is not the game's goal, so the real env's reward measures something else."""
  out: list[Replay | None] = []
  for steps in episodes:
    if steps[0].task.param.get("generated_from") is not None:
      out.append(None)
      continue
    obs = env.reset(steps[0].task)
    real_success, pairs = False, []
    for t in steps:
      r = env.step(t.action)
      if env_failed(r):
        raise RuntimeError(f"on_policy: the real env failed on {t.episode_id}:{t.step}: {r.info[ENV_ERROR]}")
      pairs.append((Transition(t.episode_id, t.step, t.task, t.instruction, obs.state, t.action,
                               r.observation.state, r.reward, r.done, r.success, r.invalid),
                    ExpPrediction(t.next_state, t.reward, t.done, t.success, "", True, "", t.invalid)))
      obs, real_success = r.observation, real_success or r.success
      if r.done:
        break
    out.append((steps, pairs, real_success))
  return out


def on_policy(replays: Sequence[Replay | None]) -> dict[str, Any]:
  """The on-policy audit (module docstring) of episodes replayed by `replay_in_env`; the episodes of generated tasks
  are counted ("skipped_generated"). A real episode that ended before M_exp's is compared up to its end. Returns
  `score`'s metrics over the replayed steps (the copy baseline is not given: the steps are the policy's, not recorded
  ones), "exact_by_step", "real_invalid" (the share of the policy's actions the real env refused: M_exp offered or
  accepted them), and the episode outcomes: "episodes", "ended_by_m_exp" (M_exp said done), "m_exp_success" and
  "real_success" (rates over the episodes M_exp ended, the real env's after the same actions), "success_precision"
  and "success_recall" over those, and "real_ended_first" (the real env said done before M_exp's last step)."""
  kept = [r for r in replays if r is not None]
  by_episode = [pairs for _, pairs, _ in kept]
  truths = [x for pairs in by_episode for x, _ in pairs]
  preds = [p for pairs in by_episode for _, p in pairs]
  outcomes = [(steps[-1].success, real) for steps, _, real in kept if steps[-1].done]  # the episodes M_exp ended
  out = score(truths, preds)
  out["real_invalid"] = float(np.mean([t.invalid for t in truths])) if truths else None
  out["exact_by_step"] = _horizon_curve([[x for x, _ in e] for e in by_episode], [[p for _, p in e] for e in by_episode],
                                        max((len(e) for e in by_episode), default=0))
  said, real = np.array([o[0] for o in outcomes], bool), np.array([o[1] for o in outcomes], bool)
  ended = len(outcomes)
  out |= {"episodes": len(kept), "skipped_generated": len(replays) - len(kept), "ended_by_m_exp": ended,
          "m_exp_success": float(said.mean()) if ended else None, "real_success": float(real.mean()) if ended else None,
          "success_precision": _rate(int(np.sum(said & real)), int(np.sum(said))),
          "success_recall": _rate(int(np.sum(said & real)), int(np.sum(real))),
          "real_ended_first": sum(len(pairs) < len(steps) for steps, pairs, _ in kept)}
  return out
