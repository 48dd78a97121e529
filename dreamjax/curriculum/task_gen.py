"""M_task: variants of seed tasks written by the experience model's weights under their own prompt.

docs/paper_map.md, "Curriculum": M_task shares M_exp's weights and writes variations of high-variance seed tasks that change
constraints, goals or context but keep the action types; generated tasks are rolled out against M_exp only (a real
env would ignore the new instruction), so a variant is the seed's `Task` with its instruction replaced, its params
copied plus {"generated_from": seed id, "generation": depth}, and id "<seed id>/v<n>" with n from the pool's counter.

Prompt: a system segment with the rules and the output format, then a task segment with the seed instruction, an
example initial state and a successful action sequence when known (SeedExample). Output: one `<task>...</task>` per
variant. Everything the model writes is an outcome: `parse_variants` is total (any string, never raises), and every
candidate ends either accepted or counted under one rejection reason, so the counts add up to the candidates.

Validation (`ValidationConfig`), deliberately simple:
- length: `min_words` to `max_words` words and at most `max_chars` characters (an empty block is "empty");
- novelty: its normalised text (lower-case alphanumeric words) differs from the seed, from `existing` instructions and
  from variants accepted earlier in the same call;
- vocabulary: a variant may only use words of its seed (instruction, example state, example actions; compared by a
  crude stem, so "doors" and "opening" match "door" and "open"), of `extra_vocabulary` (e.g. object names collected
  from the env's offline data) and of `COMMON_WORDS` (English function words, numbers and a few constraint words);
  `max_unknown_words` relaxes this. The aim is a variant that refers to
  things the environment has, so M_exp need not invent them; whether the action types are kept is left to M_exp.
At most k variants per seed are kept; any further valid ones count as "surplus".
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

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
COMMON_WORDS = frozenset("""
a an the this that these those it its them they their there here you your yours yourself i me my we our
and or but nor not no yes if then than else so as at by for from in into of off on onto out over to up down with
without within about after before until while when where which who whom whose what how why once again also only
just all any both each every few more most less least other another some such same own one two three four five six
seven eight nine ten first second third last next new other is are was were be been being do does did done have has
had can could should would must may might will shall make sure try find get go use put take place bring return keep
leave until least most many much several either neither instead still even please task goal need needs want
""".split())
REJECTION_REASONS = ("unparsed", "empty", "too_short", "too_long", "duplicate", "vocabulary", "surplus")
_BLOCK = re.compile(r"<task>((?:(?!<task>).)*?)</task>", re.S | re.I)  # innermost: a stray opening stays unclosed
_OPEN = re.compile(r"<task>", re.I)
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
  temperature: float = 1.0
  top_p: float = 0.95
  top_k: int = 0
  max_state_chars: int = 1500  # the example state is cut here so prompts stay within a few length buckets
  max_actions: int = 30
  prompt_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)  # prompt lengths are padded up to one of these
  validation: ValidationConfig = ValidationConfig()


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  tasks: tuple[Task, ...]  # accepted variants, in seed order
  seed_index: np.ndarray  # int32 [len(tasks)]: index into `seeds` of each variant's seed
  counts: dict[str, int]  # "accepted" and each of REJECTION_REASONS; sums to the number of candidates
  texts: tuple[str, ...]  # the decoded output of every seed's row, for logs


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
  already in use (seed instructions, existing tasks, accepted variants)."""
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


def variants_from_outputs(seeds: Sequence[SeedExample], outputs: Sequence[str], k: int, *,
                          existing: Iterable[str] = (), counters: Mapping[str, int] | None = None,
                          cfg: ValidationConfig = ValidationConfig()) -> GenerationResult:
  """Parses and validates one decoded output per seed into at most `k` variant tasks per seed."""
  if len(outputs) != len(seeds):
    raise ValueError(f"variants_from_outputs: {len(outputs)} outputs for {len(seeds)} seeds")
  counters = dict(counters or {})
  taken = {normalize_instruction(t) for t in existing} | {normalize_instruction(s.task.instruction) for s in seeds}
  counts = collections.Counter({reason: 0 for reason in ("accepted", *REJECTION_REASONS)})
  tasks, seed_index = [], []
  for i, (seed, text) in enumerate(zip(seeds, outputs)):
    blocks, malformed = parse_variants(text)
    counts["unparsed"] += malformed
    vocabulary = seed_vocabulary(seed)
    kept = 0
    for block in blocks:
      reason = check_variant(block, seed, taken, cfg, vocabulary)
      if reason is None and kept >= k:
        reason = "surplus"
      counts[reason or "accepted"] += 1
      if reason is None:
        taken.add(normalize_instruction(block))
        n = counters.get(seed.task.task_id, 0)
        counters[seed.task.task_id] = n + 1
        tasks.append(variant_task(seed.task, block, n))
        seed_index.append(i)
        kept += 1
  return GenerationResult(tuple(tasks), np.asarray(seed_index, np.int32), dict(counts), tuple(outputs))


def task_prompt(tokenizer: Tokenizer, seed: SeedExample, k: int, cfg: GenerationConfig = GenerationConfig()
                ) -> np.ndarray:
  """int32 prompt ids asking for `k` variants of `seed`."""
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
  lines.append(f"Write {k} variants of the seed task, each as <task>instruction</task> on its own line.")
  conv = SegmentBuilder(tokenizer).append(Kind.SYSTEM, SYSTEM_PROMPT).append(Kind.TASK, "\n".join(lines))
  return conv.prompt()


def _bucket(n: int, sizes: Sequence[int]) -> int:
  fitting = [s for s in sizes if s >= n]
  return min(fitting) if fitting else int(2 ** np.ceil(np.log2(n)))


def generate_variants(sampler: Sampler, params, tokenizer: Tokenizer, seeds: Sequence[SeedExample | Task],
                      key: jax.Array, k: int, *, existing: Iterable[str] = (),
                      counters: Mapping[str, int] | None = None,
                      cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
  """Samples one output per seed with the jitted sampler and turns it into validated variant tasks.

  Rows are padded to a power-of-two batch (dead rows generate nothing) and prompts to a length bucket, so repeated
  calls compile once per (batch bucket, length bucket). Row i samples with `fold_in(key, i)`: its text does not depend
  on the batch it was padded into. `counters` (e.g. `TaskPool.variant_counters`) numbers the new ids. With several
  processes this is a collective (the output is gathered on every process): all must call it with the same seeds.
  """
  seeds = [s if isinstance(s, SeedExample) else SeedExample(s) for s in seeds]
  if not seeds:
    return variants_from_outputs([], [], k, existing=existing, counters=counters, cfg=cfg.validation)
  prompts = [task_prompt(tokenizer, s, k, cfg) for s in seeds]
  batch = int(2 ** np.ceil(np.log2(len(prompts))))
  width = _bucket(max(len(p) for p in prompts), cfg.prompt_buckets)
  tokens, mask = left_pad(prompts, batch, width, tokenizer.pad_id)  # rows past the prompts: dummies, no budget
  budget = [sampler.max_new_tokens] * len(prompts) + [0] * (batch - len(prompts))
  sp = sampling_params(batch, budget, cfg.temperature, cfg.top_p, cfg.top_k, stop=[[i] for i in tokenizer.eos_ids])
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(np.arange(batch))
  out = to_host(sampler(params, tokens, mask, keys, sp))  # rows sharded over every process: gathered whole
  stop = set(tokenizer.eos_ids)
  texts = []
  for i in range(len(prompts)):
    ids = [int(t) for t in out.tokens[i, :out.lengths[i]]]
    while ids and ids[-1] in stop:
      ids.pop()
    texts.append(tokenizer.decode(ids, skip_special_tokens=True))
  return variants_from_outputs(seeds, texts, k, existing=existing, counters=counters, cfg=cfg.validation)
