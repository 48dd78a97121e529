"""M_task: variants of seed tasks written by the experience model's weights under their own prompts, in two rounds.

docs/paper_map.md, "Curriculum": M_task shares M_exp's weights and writes variations of high-variance seed tasks that
change constraints, goals or context but keep the action types; generated tasks are rolled out against M_exp only (a
real env would ignore the new instruction), so a variant is the seed's `Task` with its instruction replaced, its params
copied plus {"generated_from": seed id, "generation": depth}, and id "<seed id>/v<n>" with n from the pool's counter.

As in the paper's task-generation appendix, generation is propose-then-select:
1. Propose: per seed, M_task is asked for `proposals` candidate variants (a system segment with the rules and the
   output format, then a task segment with the seed instruction, an example initial state and a successful action
   sequence when known: SeedExample). Output: one `<task>...</task>` per candidate. All seeds' prompts are one
   sampler call.
2. Filter: the rule checks below drop the infeasible candidates, each with its reason.
3. Select: for each seed with more surviving candidates than it may keep (k), M_task (greedy) sees the seed and the
   numbered survivors and is asked which one is still feasible in the seed's environment yet harder than the seed
   (SELECTION_PROMPT); it answers `<choice>N</choice>` (k of them, best first, when k > 1). All these prompts are a
   second sampler call. `parse_choices` is total; choices that are missing, out of range or repeated are filled by
   the fallback rule (the surviving candidates in the order they were proposed), and the seed counts as a fallback.
   A seed with at most k survivors keeps them all without asking.

Everything the model writes is an outcome: parsing never raises, and every candidate ends either accepted (selected)
or counted under one rejection reason (REJECTION_REASONS: a filter's, or "not_selected"), so the counts add up to the
candidates. The generation log (`GenerationResult.log`) has one record per seed: what was proposed, what was
selected, and each rejected candidate with its reason ("filter: <check>" or "not selected"), plus how the choice was
made and the raw selection answer.

Validation (`ValidationConfig`), deliberately simple:
- length: `min_words` to `max_words` words and at most `max_chars` characters (an empty block is "empty");
- novelty: its normalised text (lower-case alphanumeric words) differs from the seed, from `existing` instructions and
  from candidates that survived earlier in the same call (so two seeds never select the same text);
- vocabulary: a variant may only use words of its seed (instruction, example state, example actions; compared by a
  crude stem, so "doors" and "opening" match "door" and "open"), of `extra_vocabulary` (e.g. object names collected
  from the env's offline data) and of `COMMON_WORDS` (English function words, numbers and a few constraint words);
  `max_unknown_words` relaxes this. The aim is a variant that refers to
  things the environment has, so M_exp need not invent them; whether the action types are kept is left to M_exp and
  to the selection prompt.
Blocks beyond the `proposals` asked for count as "surplus".
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dreamjax.envs.base import Task
from dreamjax.parallel.distributed import to_host
from dreamjax.sampling import Sampler, left_pad, sampling_params
from dreamjax.text import Kind, SegmentBuilder, Tokenizer

SYSTEM_PROMPT = (
    "You design training tasks for an agent in a text environment. Given a seed task, write new task variants that "
    "change its constraints, goals or context but are solved with the same kinds of actions. Refer only to objects, "
    "places and actions that appear in the seed. Each variant must be a self-contained instruction, different from "
    "the seed and from each other. Answer with the variants only, one per line, each as <task>instruction</task>."
)
# The selection round's role (the paper's appendix: of the proposed variations, keep the one that is feasible in the
# environment and more challenging than the seed), in our words.
SELECTION_PROMPT = (
    "You review candidate training tasks for an agent in a text environment. Each candidate is a variant of the same "
    "seed task. A good candidate is feasible: it refers only to objects, places and actions the seed's environment "
    "has and can be completed with the same kinds of actions as the seed. Among the feasible candidates, prefer the "
    "one that is harder than the seed (more steps, tighter constraints or a less direct goal) without being "
    "impossible. Answer with the candidate's number only, as <choice>N</choice>."
)
COMMON_WORDS = frozenset("""
a an the this that these those it its them they their there here you your yours yourself i me my we our
and or but nor not no yes if then than else so as at by for from in into of off on onto out over to up down with
without within about after before until while when where which who whom whose what how why once again also only
just all any both each every few more most less least other another some such same own one two three four five six
seven eight nine ten first second third last next new other is are was were be been being do does did done have has
had can could should would must may might will shall make sure try find get go use put take place bring return keep
leave until least most many much several either neither instead still even please task goal need needs want
""".split())
FILTER_REASONS = ("unparsed", "empty", "too_short", "too_long", "duplicate", "vocabulary", "surplus")
REJECTION_REASONS = (*FILTER_REASONS, "not_selected")
# How a seed's variants were chosen (GenerationResult.log): no survivor; at most k survivors, all kept unasked; the
# model's choice; the model's choice filled (or replaced) by the fallback rule.
SELECTION_METHODS = ("none", "all", "model", "fallback")
_BLOCK = re.compile(r"<task>((?:(?!<task>).)*?)</task>", re.S | re.I)  # innermost: a stray opening stays unclosed
_OPEN = re.compile(r"<task>", re.I)
_CHOICE = re.compile(r"<choice>\s*(?:candidate\s*)?#?\s*(\d{1,6})\s*\.?\s*</choice>", re.I)
_WORD = re.compile(r"[a-z0-9]+")


@dataclasses.dataclass(frozen=True)
class SeedExample:
  """A seed task and, when known, what its episodes look like (grounds the variants in the env's vocabulary)."""

  task: Task
  initial_state: str = ""
  actions: tuple[str, ...] = ()  # a successful action sequence, e.g. the expert's


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
  min_words: int = 3
  max_words: int = 60
  max_chars: int = 400
  max_unknown_words: int = 0
  extra_vocabulary: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  temperature: float = 1.0  # the proposals' sampling; the selection is greedy
  top_p: float = 0.95
  top_k: int = 0
  max_state_chars: int = 1500  # the example state is cut here so prompts stay within a few length buckets
  max_actions: int = 30
  prompt_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)  # prompt lengths are padded up to one of these
  selection_max_tokens: int = 24  # the selection answer's budget (a few <choice> tags), within the sampler's buffer
  validation: ValidationConfig = ValidationConfig()

  def __post_init__(self):
    if self.selection_max_tokens < 1:
      raise ValueError(f"GenerationConfig.selection_max_tokens must be >= 1, got {self.selection_max_tokens}")


@dataclasses.dataclass(frozen=True)
class Proposals:
  """One seed's candidates after the rule filters: every parsed block with its filter reason (None: survived)."""

  seed: SeedExample
  texts: tuple[str, ...]  # the `<task>` blocks in the order M_task wrote them
  reasons: tuple[str | None, ...]  # per block: None, or one of FILTER_REASONS
  unparsed: int = 0  # malformed candidates (an unclosed tag, or an output with no block at all)

  @property
  def survivors(self) -> tuple[str, ...]:
    return tuple(t for t, r in zip(self.texts, self.reasons) if r is None)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  tasks: tuple[Task, ...]  # selected variants, in seed order
  seed_index: np.ndarray  # int32 [len(tasks)]: index into `seeds` of each variant's seed
  counts: dict[str, int]  # "accepted" and each of REJECTION_REASONS; sums to the number of candidates
  texts: tuple[str, ...]  # the decoded proposal output of every seed's row, for logs
  log: tuple[dict[str, Any], ...] = ()  # one JSON-ready record per seed (`log_record`)
  selection: dict[str, int] = dataclasses.field(default_factory=lambda: {"prompts": 0, "fallbacks": 0})


def normalize_instruction(text: str) -> str:
  """The text duplicates are compared on: lower-case alphanumeric words joined by single spaces."""
  return " ".join(_WORD.findall(text.lower()))


def parse_variants(text: str) -> tuple[list[str], int]:
  """(contents of the `<task>` blocks in order, number of malformed candidates). Total: never raises.

  Malformed: an opening tag that is never closed, or an output with no block at all (one candidate that failed).
  """
  if not isinstance(text, str):
    return [], 1
  blocks = [" ".join(m.split()) for m in _BLOCK.findall(text)]
  rest = _BLOCK.sub(" ", text)
  unclosed = len(_OPEN.findall(rest))
  return blocks, unclosed + (1 if not blocks and not unclosed else 0)


def stem(word: str) -> str:
  """A crude stem, so inflections of a seed's words pass the vocabulary check ("opening", "doors", "taking")."""
  for suffix in ("ing", "ed", "es", "s"):
    if word.endswith(suffix) and len(word) - len(suffix) >= 3:
      word = word[:-len(suffix)]
      break
  return word[:-1] if word.endswith("e") and len(word) > 3 else word


def seed_vocabulary(seed: SeedExample) -> frozenset[str]:
  """Stems of the words of the seed's instruction, example state and example actions."""
  text = " ".join((seed.task.instruction, seed.initial_state, *seed.actions)).lower()
  return frozenset(stem(w) for w in _WORD.findall(text))


def check_variant(text: str, seed: SeedExample, taken: set[str], cfg: ValidationConfig = ValidationConfig(),
                  vocabulary: frozenset[str] | None = None) -> str | None:
  """None when `text` is an acceptable variant of `seed`, else the rejection reason. `taken`: normalised texts
  already in use (seed instructions, existing tasks, surviving candidates)."""
  norm = normalize_instruction(text)
  words = norm.split()
  if not words:
    return "empty"
  if len(words) < cfg.min_words:
    return "too_short"
  if len(words) > cfg.max_words or len(text) > cfg.max_chars:
    return "too_long"
  if norm in taken or norm == normalize_instruction(seed.task.instruction):
    return "duplicate"
  allowed = vocabulary if vocabulary is not None else seed_vocabulary(seed)
  unknown = [w for w in words if w not in COMMON_WORDS and w not in cfg.extra_vocabulary and stem(w) not in allowed]
  if len(unknown) > cfg.max_unknown_words:
    return "vocabulary"
  return None


def variant_task(seed: Task, instruction: str, index: int) -> Task:
  """The seed with `instruction`, id "<seed id>/v<index>", params plus its lineage."""
  depth = int(seed.param.get("generation", 0)) + 1
  params = {**seed.param, "generated_from": seed.task_id, "generation": depth}
  return Task.make(seed.env, f"{seed.task_id}/v{index}", instruction, **params)


def filter_proposals(seeds: Sequence[SeedExample], outputs: Sequence[str], proposals: int, *,
                     existing: Iterable[str] = (), cfg: ValidationConfig = ValidationConfig()) -> list[Proposals]:
  """Parses one decoded proposal output per seed and runs the rule filters on its first `proposals` blocks (later
  ones are "surplus"). A survivor's text is taken for the rest of the call, so a repeat anywhere is a "duplicate"."""
  if len(outputs) != len(seeds):
    raise ValueError(f"filter_proposals: {len(outputs)} outputs for {len(seeds)} seeds")
  taken = {normalize_instruction(t) for t in existing} | {normalize_instruction(s.task.instruction) for s in seeds}
  out = []
  for seed, text in zip(seeds, outputs):
    blocks, malformed = parse_variants(text)
    vocabulary = seed_vocabulary(seed)
    reasons: list[str | None] = []
    for j, block in enumerate(blocks):
      reason = "surplus" if j >= proposals else check_variant(block, seed, taken, cfg, vocabulary)
      if reason is None:
        taken.add(normalize_instruction(block))
      reasons.append(reason)
    out.append(Proposals(seed, tuple(blocks), tuple(reasons), malformed))
  return out


def _seed_lines(seed: SeedExample, cfg: GenerationConfig) -> list[str]:
  """The seed as both prompts show it: instruction, example initial state, a successful action sequence."""
  lines = [f"Seed task: {seed.task.instruction.strip()}"]
  if seed.initial_state.strip():
    state = seed.initial_state.strip()
    if len(state) > cfg.max_state_chars:
      state = state[:cfg.max_state_chars] + " ..."
    lines.append(f"Initial state:\n{state}")
  if seed.actions:
    shown = seed.actions[:cfg.max_actions]
    more = " ..." if len(seed.actions) > len(shown) else ""
    lines.append("A successful action sequence: " + "; ".join(a.strip() for a in shown) + more)
  return lines


def task_prompt(tokenizer: Tokenizer, seed: SeedExample, k: int, cfg: GenerationConfig = GenerationConfig()
                ) -> np.ndarray:
  """int32 prompt ids asking for `k` variants of `seed`."""
  lines = _seed_lines(seed, cfg)
  lines.append(f"Write {k} variants of the seed task, each as <task>instruction</task> on its own line.")
  conv = SegmentBuilder(tokenizer).append(Kind.SYSTEM, SYSTEM_PROMPT).append(Kind.TASK, "\n".join(lines))
  return conv.prompt()


def selection_text(seed: SeedExample, candidates: Sequence[str], k: int = 1,
                   cfg: GenerationConfig = GenerationConfig()) -> str:
  """The selection prompt's task segment: the seed, the numbered candidates (from 1) and what to answer."""
  lines = _seed_lines(seed, cfg)
  lines.append("Candidates:")
  lines += [f"{i}. {c}" for i, c in enumerate(candidates, start=1)]
  if k == 1:
    lines.append("Which candidate is feasible and harder than the seed task? Answer as <choice>N</choice>.")
  else:
    lines.append(f"Which {k} candidates are feasible and harder than the seed task? Answer with their numbers, best "
                 "first, each as <choice>N</choice>.")
  return "\n".join(lines)


def selection_prompt(tokenizer: Tokenizer, seed: SeedExample, candidates: Sequence[str], k: int = 1,
                     cfg: GenerationConfig = GenerationConfig()) -> np.ndarray:
  """int32 prompt ids asking M_task to pick `k` of `candidates` (SELECTION_PROMPT, then `selection_text`)."""
  conv = SegmentBuilder(tokenizer).append(Kind.SYSTEM, SELECTION_PROMPT)
  return conv.append(Kind.TASK, selection_text(seed, candidates, k, cfg)).prompt()


def parse_choices(text: str, n: int) -> list[int]:
  """0-based indices of the candidates a selection answer names, in its order: every `<choice>N</choice>` with
  1 <= N <= n, repeats dropped. Total: anything else (no tag, a word, a number out of range) names nothing."""
  if not isinstance(text, str):
    return []
  out: list[int] = []
  for m in _CHOICE.finditer(text):
    i = int(m.group(1)) - 1
    if 0 <= i < n and i not in out:
      out.append(i)
  return out


def choose(choices: Sequence[int], n: int, k: int) -> tuple[list[int], bool]:
  """(the `min(k, n)` selected indices, whether the fallback rule filled any): the parsed choices first, then the
  candidates in proposal order (the fallback rule: the first surviving candidates)."""
  want = min(k, n)
  picked = [i for i in choices if 0 <= i < n][:want]
  fallback = len(picked) < want
  picked += [i for i in range(n) if i not in picked][:want - len(picked)]
  return picked, fallback


def log_record(p: Proposals, selected: Sequence[str], method: str, answer: str | None = None) -> dict[str, Any]:
  """The generation log's record of one seed: the seed's id and instruction, every proposed candidate, the selected
  ones, each rejected one with its reason ("filter: <check>" or "not selected"), the number of malformed
  candidates, how the choice was made (SELECTION_METHODS) and the raw selection answer (None when not asked)."""
  if method not in SELECTION_METHODS:
    raise ValueError(f"log_record: method must be one of {SELECTION_METHODS}, got {method!r}")
  chosen = set(selected)
  rejected = [{"text": t, "reason": f"filter: {r}"} if r is not None else {"text": t, "reason": "not selected"}
              for t, r in zip(p.texts, p.reasons) if r is not None or t not in chosen]
  return {"seed": p.seed.task.task_id, "seed_instruction": p.seed.task.instruction, "proposed": list(p.texts),
          "selected": list(selected), "rejected": rejected, "unparsed": p.unparsed, "selection": method,
          "selection_answer": answer}


def select_variants(props: Sequence[Proposals], answers: Sequence[str | None], k: int, *,
                    counters: Mapping[str, int] | None = None, texts: Sequence[str] = ()) -> GenerationResult:
  """Turns filtered proposals and the selection answers (None for a seed that was not asked) into at most `k`
  variant tasks per seed, with counts, the log records and the selection's numbers. `texts`: the proposal outputs,
  kept for logs."""
  if len(answers) != len(props):
    raise ValueError(f"select_variants: {len(answers)} selection answers for {len(props)} seeds")
  counters = dict(counters or {})
  counts = collections.Counter({reason: 0 for reason in ("accepted", *REJECTION_REASONS)})
  tasks, seed_index, log = [], [], []
  prompts = fallbacks = 0
  for i, (p, answer) in enumerate(zip(props, answers)):
    counts["unparsed"] += p.unparsed
    for r in p.reasons:
      if r is not None:
        counts[r] += 1
    survivors = p.survivors
    if not survivors:
      picked, method = [], "none"
    elif len(survivors) <= k:
      picked, method = list(range(len(survivors))), "all"
    else:
      prompts += answer is not None
      picked, fell_back = choose(parse_choices(answer or "", len(survivors)), len(survivors), k)
      method = "fallback" if fell_back else "model"
      fallbacks += fell_back
    selected = [survivors[j] for j in picked]
    counts["accepted"] += len(selected)
    counts["not_selected"] += len(survivors) - len(selected)
    for text in selected:
      n = counters.get(p.seed.task.task_id, 0)
      counters[p.seed.task.task_id] = n + 1
      tasks.append(variant_task(p.seed.task, text, n))
      seed_index.append(i)
    log.append(log_record(p, selected, method, answer))
  return GenerationResult(tuple(tasks), np.asarray(seed_index, np.int32), dict(counts), tuple(texts), tuple(log),
                          {"prompts": prompts, "fallbacks": fallbacks})


def variants_from_outputs(seeds: Sequence[SeedExample], outputs: Sequence[str], k: int, *, proposals: int = 4,
                          answers: Sequence[str | None] | None = None, existing: Iterable[str] = (),
                          counters: Mapping[str, int] | None = None,
                          cfg: ValidationConfig = ValidationConfig()) -> GenerationResult:
  """`filter_proposals` then `select_variants` on given texts (no model): the pure path `generate_variants` takes.
  Without `answers`, a seed with more than `k` survivors gets the fallback rule."""
  props = filter_proposals(seeds, outputs, proposals, existing=existing, cfg=cfg)
  if answers is None:
    answers = [None] * len(props)
  return select_variants(props, answers, k, counters=counters, texts=outputs)


def _bucket(n: int, sizes: Sequence[int]) -> int:
  fitting = [s for s in sizes if s >= n]
  return min(fitting) if fitting else int(2 ** np.ceil(np.log2(n)))


def _sample_rows(sampler: Sampler, params, tokenizer: Tokenizer, prompts: Mapping[int, np.ndarray], batch: int,
                 key: jax.Array, budget: int, temperature: float, cfg: GenerationConfig) -> dict[int, str]:
  """Decoded outputs of the given rows of a `batch`-row sampler call (other rows are dummies with no budget).

  Prompts are padded to a length bucket, so repeated calls compile once per (batch, length bucket). Row r samples
  with `fold_in(key, r)`: its text does not depend on the other rows. With several processes this is a collective
  (the output is gathered on every process)."""
  width = _bucket(max(len(p) for p in prompts.values()), cfg.prompt_buckets)
  tokens, mask = left_pad(prompts, batch, width, tokenizer.pad_id)
  budgets = [budget if r in prompts else 0 for r in range(batch)]
  sp = sampling_params(batch, budgets, temperature, cfg.top_p, cfg.top_k, stop=[[i] for i in tokenizer.eos_ids])
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(np.arange(batch))
  out = to_host(sampler(params, tokens, mask, keys, sp))  # rows sharded over every process: gathered whole
  stop = set(tokenizer.eos_ids)
  texts = {}
  for r in prompts:
    ids = [int(t) for t in out.tokens[r, :out.lengths[r]]]
    while ids and ids[-1] in stop:
      ids.pop()
    texts[r] = tokenizer.decode(ids, skip_special_tokens=True)
  return texts


def generate_variants(sampler: Sampler, params, tokenizer: Tokenizer, seeds: Sequence[SeedExample | Task],
                      key: jax.Array, k: int, *, proposals: int = 4, existing: Iterable[str] = (),
                      counters: Mapping[str, int] | None = None,
                      cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
  """Proposes `proposals` candidates per seed, filters them, and has M_task select `k` per seed (module docstring).

  Two sampler calls at most, each over a power-of-two batch of one row per seed (row i is seed i in both, so the
  selection reuses the proposals' batch size): the proposals sampled at `cfg.temperature` with `fold_in(key, i)`, the
  selection greedy and only for the seeds with more than `k` survivors. `counters` (e.g. `TaskPool.variant_counters`)
  numbers the new ids. With several processes this is a collective: all must call it with the same seeds.
  """
  seeds = [s if isinstance(s, SeedExample) else SeedExample(s) for s in seeds]
  if not seeds:
    return variants_from_outputs([], [], k, proposals=proposals, existing=existing, counters=counters,
                                 cfg=cfg.validation)
  batch = int(2 ** np.ceil(np.log2(len(seeds))))
  prompts = {i: task_prompt(tokenizer, s, proposals, cfg) for i, s in enumerate(seeds)}
  proposed = _sample_rows(sampler, params, tokenizer, prompts, batch, key, sampler.max_new_tokens, cfg.temperature,
                          cfg)
  texts = [proposed[i] for i in range(len(seeds))]
  props = filter_proposals(seeds, texts, proposals, existing=existing, cfg=cfg.validation)
  asked = {i: selection_prompt(tokenizer, p.seed, p.survivors, k, cfg) for i, p in enumerate(props)
           if len(p.survivors) > k}
  answers: list[str | None] = [None] * len(props)
  if asked:
    budget = min(cfg.selection_max_tokens, sampler.max_new_tokens)
    chosen = _sample_rows(sampler, params, tokenizer, asked, batch, jax.random.fold_in(key, batch), budget, 0.0, cfg)
    for i, text in chosen.items():
      answers[i] = text
  return select_variants(props, answers, k, counters=counters, texts=texts)
