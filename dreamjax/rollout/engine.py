"""The batched multi-turn rollout engine: B tasks x G rollouts against any BatchEnv, one sampler call per turn.

Shapes never change within a run, so nothing recompiles turn to turn: every turn samples all N = B*G rows in one
jitted call, finished rows included (their per-row budget is 0, so they emit nothing and cost only the prefill of a
one-token dummy prompt), and the prompt length is padded up to one of a few fixed buckets. The sampler therefore
compiles once per (N, bucket). Prompts longer than the largest bucket drop history, oldest first, and only a prompt
that cannot fit with no history at all is an error.

Randomness: row r at turn t samples with `fold_in(fold_in(key, t), r)`, so a run is reproducible from its key and a
row's tokens do not depend on the other rows (nor on how many of them are still live).

`RolloutConfig.max_rows` plays the B*G rows in chunks of whole groups, one chunk to its end after the other, against
env rows 0...max_rows-1: a run then needs only that many live envs. That matters where an env is a browser (two
Chromium processes per MiniWoB env: 16 tasks x 8 rollouts at once do not fit in 24 GB). Each row keeps its key, so the
trajectories are those of all rows at once; the sampler compiles for the chunk's size (and the last chunk's, where it
is smaller). An env-step budget (below) is then spent in play order, chunk after chunk.

Outcomes, not exceptions: an answer that does not parse is not sent to the env (the BatchEnv gets None for its row);
the turn is recorded as invalid, reward 0, with the state unchanged, and the episode goes on. An action the env
rejects comes back as the env's own invalid result. Episodes end when the env says done, after `max_turns` turns, or
when their sampled tokens reach `max_episode_tokens` (the last turn's budget is cut to what is left); the last two are
truncations (`Trajectories.ended` False).

An exact env-step budget (`run(max_env_steps=...)`, the last iteration of a run capped in real transitions): once the
answers of a turn would step more rows than the budget has left, the rows past it (in row order, so whole GRPO groups
are kept where possible) are cut before their action reaches the env, and every row still running when it reaches 0
stops. A cut episode (`Trajectories.budget_cut`) is neither a success nor a failure: its last answer was never
executed, so the update leaves it out, as it leaves out env failures (`Trajectories.left_out`).

What is recorded per turn is exactly what the policy saw and produced: prompt ids from `build_turn_prompt`, the
sampled ids including the stop token (without padding), and the sampler's log-probs. The engine never re-tokenises.
Each episode is also a `TrajectoryRecord` (policy "policy", step source "policy") for the replay buffer and logs: a
parsed turn records the parsed action, an unparseable one the decoded answer itself (invalid, reward 0, next state =
state), so nothing the policy said is lost. The history shown in later prompts has the parsed action, or
`INVALID_ANSWER` for an unparseable turn (raw junk would only crowd the prompt).
Host work (prompt building, decoding, parsing, env stepping) runs outside jit; `stats` splits the wall time of the
last run into sampling, env and host seconds.

`RolloutConfig.speculative` turns on the sampler's copy-speculative decoding (an answer mostly copies an admissible
action listed in its prompt): the same tokens under greedy decoding, the same distribution when sampling
(dreamjax/sampling/sampler.py). `stats` counts the sampler's forward passes and accepted draft tokens, from which
`speculation_rates` gives the acceptance length that rollouts log.

`RolloutConfig.group_prefill` prefills a GRPO group's prompt once when its G rows all have the same prompt (always at
turn 0, where every row of a group starts from the same observation; later only where the rows' histories agree):
the engine checks this on the host every turn and asks the sampler for its grouped prefill (`Sampler.__call__`'s
`group`), which yields the same tokens and log-probs (to float32 rounding) as the plain call. It compiles the
sampler once more per prompt bucket, hence off by default; `stats["grouped_turns"]` counts the turns that used it.

`RolloutConfig.kv_reuse` keeps each row's KV cache on device for the whole run (`dreamjax.sampling.KVReuse`): each
turn prefills only the part of a row's prompt after its longest common prefix with the last prompt and answer, with
the same tokens and log-probs to float32 rounding. What that saves depends on the prompt layout: the agent prompt
(dreamjax/rollout/agent.py) is rebuilt every turn with the step count and a sliding history near its start, so only
the system message and the task line carry over; `stats["prefilled_tokens"]` against `stats["prompt_tokens"]` says
how much was prefilled.

`RolloutConfig.constrain_actions` makes every answer one of the row's admissible actions: the sampler gets each
action's answer ids (`format_answer` plus the closing, what SFT trained the policy to emit) as the row's choices and
draws only tokens that continue one of them (dreamjax/sampling/sampler.py), so a misspelt copy of an action cannot
happen and a group's rollouts differ only in which actions they chose. The recorded log-probs are those of the
restricted distribution, and `Trajectories.allowed` carries each sampled token's allowed set, so that the update
scores the same distribution (docs/paper_map.md, "Admissible-action decoding"). It needs answers without a think
block and plain decoding; rows whose env lists no admissible actions are not limited.

The engine sees the env only through the BatchEnv protocol, so real envs, env pools and the experience model's
SyntheticEnv are driven the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import BatchEnv, Observation, StepResult, Task, env_failed
from dreamjax.models.config import ModelConfig
from dreamjax.parallel.distributed import to_host
from dreamjax.rollout.agent import (
    INVALID_ANSWER,
    AgentFormat,
    build_turn_prompt,
    fit_turn_prompt,
    format_answer,
    parse_answer,
)
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.sampling import KVReuse, Sampler, SpeculativeConfig, count_speculation, left_pad, sampling_params
from dreamjax.text import Kind, SegmentBuilder, Tokenizer


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  group_size: int = 1  # G rollouts per task (the GRPO group)
  max_turns: int = 10  # turns per episode; an episode still running after them is truncated
  max_action_tokens: int = 128  # sampled tokens per turn (the sampler's static buffer)
  max_episode_tokens: int = 2048  # sampled tokens per episode
  prompt_buckets: tuple[int, ...] = (512, 1024, 2048)  # prompt lengths the sampler compiles for
  temperature: float = 1.0  # <= 0: greedy
  top_p: float = 1.0
  top_k: int = 0
  speculative: SpeculativeConfig = SpeculativeConfig()  # copy-speculative decoding (draft_tokens 0: off)
  group_prefill: bool = False  # prefill a group's prompt once when its G rows' prompts are equal (module docstring)
  kv_reuse: bool = False  # keep each row's KV cache between turns and prefill only what it lacks (module docstring)
  constrain_actions: bool = False  # answer with one of the admissible actions, always (module docstring)
  # Episodes played at once, in whole groups (0: all B*G): bounds the live envs, e.g. browsers (module docstring)
  max_rows: int = 0

  def __post_init__(self):
    for name in ("group_size", "max_turns", "max_action_tokens", "max_episode_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.max_rows < 0 or 0 < self.max_rows < self.group_size:
      raise ValueError(f"RolloutConfig.max_rows must be 0 (all rows at once) or at least group_size "
                       f"({self.group_size}), got {self.max_rows}")
    buckets = tuple(self.prompt_buckets)
    if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
      raise ValueError(f"RolloutConfig.prompt_buckets must be positive and strictly increasing, got {buckets}")

  def rows_at_once(self, rows: int) -> int:
    """How many of a run's `rows` episodes are played together: all, or whole groups up to `max_rows`."""
    return rows if self.max_rows <= 0 else min(rows, self.max_rows // self.group_size * self.group_size)


@dataclasses.dataclass
class _Turn:
  prompt: np.ndarray  # int32 ids, generation prompt included
  prompt_kinds: np.ndarray  # int32
  sampled: np.ndarray  # int32 ids, stop token included
  logps: np.ndarray  # float32
  allowed: list[np.ndarray]  # per sampled id, the tokens its choices allowed there (empty: any; constrain_actions)
  reward: float
  done: bool
  invalid: bool
  truncated: bool


@dataclasses.dataclass
class _Episode:
  """Host-side state of one row."""

  task: Task
  instruction: str
  state: str
  admissible: tuple[str, ...]
  history: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  turns: list[_Turn] = dataclasses.field(default_factory=list)
  steps: list[StepRecord] = dataclasses.field(default_factory=list)
  used: int = 0  # sampled tokens so far
  live: bool = True
  ended: bool = False  # the env ended the episode
  success: bool = False
  score: float | None = None
  env_error: bool = False  # the env failed (dreamjax.envs.base.ENV_ERROR) on the last turn
  budget_cut: bool = False  # the run's env-step budget ran out before the episode ended


def allowed_tokens(choices: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
  """Per sampled id, the sorted tokens `choices` [C, L] (one row of the sampler's, -1 padded) allowed there given the
  ids before it, exactly as the sampler limits them; an empty set where nothing limited the draw (a row without
  choices, the ids past L, or past the end of every choice the row still matched)."""
  matching = choices[:, 0] >= 0
  out = []
  for j, token in enumerate(ids):
    column = choices[:, j] if j < choices.shape[1] else np.full(len(choices), -1, choices.dtype)
    out.append(np.unique(column[matching & (column >= 0)]).astype(np.int32))
    matching &= column == token
  return out


def answer_ids(tokenizer: Tokenizer, action: str) -> tuple[int, ...]:
  """The answer ids a policy emits for `action` (`format_answer` and the closing); () for an action holding an answer
  tag: no answer parses back to it, so it is no choice."""
  try:
    return SegmentBuilder(tokenizer).answer_ids(format_answer(action))
  except ValueError:
    return ()


def pack_choices(answers: Mapping[int, Sequence[tuple[int, ...]]], rows: int, width: int) -> np.ndarray:
  """The sampler's choices [rows, C, width]: row r's admissible actions as their `answer_ids` (`answers[r]`), -1
  elsewhere; rows not in `answers` are not limited. C is a power of two (at least 8), so the sampler compiles for a
  few widths only. An answer longer than `width` (the action budget) is cut, and running out of budget is then a
  truncated, unparsed answer, as it is without choices."""
  most = max([len(c) for c in answers.values()] + [1])
  out = np.full((rows, max(8, 1 << (most - 1).bit_length()), width), -1, np.int32)
  for r, row in answers.items():
    for i, ids in enumerate(row):
      out[r, i, :min(len(ids), width)] = ids[:width]
  return out


def _row_keys(key: jax.Array, turn: jax.Array, first: jax.Array, rows: int) -> jax.Array:
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, turn), r))(first + jnp.arange(rows))


_ROW_KEYS = jax.jit(_row_keys, static_argnums=3)


class RolloutEngine:
  """Runs G rollouts of each task with one policy; `run` returns token-in/token-out `Trajectories`."""

  def __init__(self, policy_cfg: ModelConfig, tokenizer: Tokenizer, agent_format: AgentFormat,
               rollout_cfg: RolloutConfig, mesh: jax.sharding.Mesh | None = None, sampler: Sampler | None = None):
    if tokenizer.chat_format is None:
      raise ValueError("RolloutEngine: the tokenizer has no chat template, so turns cannot be built")
    if policy_cfg.vocab_size < tokenizer.vocab_size:
      raise ValueError(f"RolloutEngine: policy vocab_size {policy_cfg.vocab_size} is below the tokenizer's "
                       f"{tokenizer.vocab_size}")
    longest = rollout_cfg.prompt_buckets[-1] + rollout_cfg.max_action_tokens
    if longest > policy_cfg.max_position_embeddings:
      raise ValueError(f"RolloutEngine: the largest prompt bucket plus max_action_tokens is {longest} tokens, beyond "
                       f"the policy's max_position_embeddings {policy_cfg.max_position_embeddings}")
    self.policy_cfg, self.tokenizer, self.format, self.cfg = policy_cfg, tokenizer, agent_format, rollout_cfg
    # Engines of one model with the same action budget may share a sampler (temperature and the other settings are
    # runtime arguments), so evaluation reuses the rollout's compilations.
    if sampler is not None and (sampler.max_new_tokens, sampler.pad_id, sampler.speculative) != (
        rollout_cfg.max_action_tokens, tokenizer.pad_id, rollout_cfg.speculative):
      raise ValueError("RolloutEngine: a shared sampler must have this engine's max_action_tokens, pad id and "
                       "speculative settings")
    self.sampler = sampler or Sampler(policy_cfg, rollout_cfg.max_action_tokens, pad_id=tokenizer.pad_id, mesh=mesh,
                                      speculative=rollout_cfg.speculative)
    if rollout_cfg.constrain_actions and (agent_format.think or rollout_cfg.speculative.draft_tokens):
      raise ValueError("RolloutEngine: constrain_actions limits the whole answer to an admissible action, so it needs "
                       "AgentFormat.think=False and plain decoding (RolloutConfig.speculative.draft_tokens=0)")
    self.stop_ids = tuple(dict.fromkeys((tokenizer.chat_format.end_of_turn, *tokenizer.eos_ids)))
    self._answers: dict[str, tuple[int, ...]] = {}  # admissible action -> its answer ids (constrain_actions)
    self._frame = np.full(len(tokenizer.chat_format.generation_prompt), Kind.ACTION_FRAME, np.int32)

  def turn_prompt(self, instruction: str, step: int, history: Sequence[tuple[str, str]], state: str,
                  admissible: Sequence[str], where: str = "") -> SegmentBuilder:
    """`build_turn_prompt`, dropping the oldest history until `.prompt()` fits the largest bucket."""
    limit = self.cfg.prompt_buckets[-1]
    builder, _ = fit_turn_prompt(self.tokenizer, self.format, instruction, step, history, state, admissible, limit)
    if builder is None:
      length = len(build_turn_prompt(self.tokenizer, self.format, instruction, step, (), state, admissible))
      raise ValueError(f"{where or 'turn prompt'}: the prompt is {length + len(self._frame)} tokens without any "
                       f"history, beyond the largest prompt bucket {limit}; raise RolloutConfig.prompt_buckets or "
                       f"lower AgentFormat.max_admissible")
    return builder

  def run(self, params, env: BatchEnv, tasks: Sequence[Task], key: jax.Array, policy_version: int = 0,
          max_env_steps: int = 0) -> Trajectories:
    """Rollouts of every task `group_size` times: row r runs task r // G. `key` is a PRNG key (typed or raw).
    `max_env_steps` (0: no cap) caps the env steps of the whole call exactly (see the module docstring)."""
    cfg = self.cfg
    if not tasks:
      raise ValueError("RolloutEngine.run: no tasks")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)
    stats = dict(sample_s=0.0, env_s=0.0, turns=0, sampled_tokens=0, forced_tokens=0, parse_failures=0, env_invalid=0,
                 env_errors=0,
                 budget_cut=0, grouped_turns=0, prompt_tokens=0, prefilled_tokens=0, buckets=set())
    steps_left = max_env_steps if max_env_steps > 0 else None
    start = time.perf_counter()
    total = len(tasks) * cfg.group_size
    row_tasks = [tasks[r // cfg.group_size] for r in range(total)]
    at_once = cfg.rows_at_once(total)
    eps: list[_Episode] = []
    for first in range(0, total, at_once):
      played, steps_left = self._play(params, env, row_tasks[first:first + at_once], first, key, stats, steps_left)
      eps += played

    stats["budget_cut"] = sum(ep.budget_cut for ep in eps)
    t0 = time.perf_counter()
    traj = self._assemble(eps, key, policy_version)
    stats["total_s"] = time.perf_counter() - start
    stats["host_s"] = stats["total_s"] - stats["sample_s"] - stats["env_s"]
    stats.update(episodes=total, rows=traj.num_rows, buckets=sorted(stats["buckets"]),
                 compilations=self.sampler.compilations(), assemble_s=time.perf_counter() - t0)
    return dataclasses.replace(traj, stats=stats)

  def _play(self, params, env: BatchEnv, row_tasks: list[Task], first: int, key: jax.Array, stats: dict,
            steps_left: int | None) -> tuple[list[_Episode], int | None]:
    """Plays the rows `row_tasks` (rows `first`... of the run) to their end against env rows 0...; (their episodes,
    the env-step budget left)."""
    cfg, tok = self.cfg, self.tokenizer
    reuse = KVReuse() if cfg.kv_reuse else None  # one per call: draws never depend on earlier rows
    n = len(row_tasks)
    t0 = time.perf_counter()
    observations = env.reset_batch(row_tasks)
    stats["env_s"] += time.perf_counter() - t0
    if len(observations) != n:
      raise RuntimeError(f"RolloutEngine.run: env.reset_batch returned {len(observations)} observations for {n} rows")
    eps = [self._episode(task, obs, r) for r, (task, obs) in enumerate(zip(row_tasks, observations))]
    sp = sampling_params(n, cfg.max_action_tokens, cfg.temperature, cfg.top_p, cfg.top_k,
                         stop=[[i] for i in self.stop_ids])

    for turn in range(cfg.max_turns):
      if steps_left == 0:  # the budget is spent: what is still running stops here
        for r in range(n):
          if eps[r].live:
            eps[r].live, eps[r].budget_cut = False, True
      live = [r for r in range(n) if eps[r].live]
      if not live:
        break
      builders = {r: self.turn_prompt(eps[r].instruction, turn, eps[r].history, eps[r].state, eps[r].admissible,
                                      where=f"task {eps[r].task.task_id!r} turn {turn}") for r in live}
      prompts = {r: b.prompt() for r, b in builders.items()}
      width = next(b for b in cfg.prompt_buckets if b >= max(len(p) for p in prompts.values()))
      stats["buckets"].add(width)
      tokens, mask = left_pad(prompts, n, width, tok.pad_id)  # finished rows get dummy prompts
      budget = np.zeros(n, np.int32)
      for r in prompts:
        budget[r] = min(cfg.max_action_tokens, cfg.max_episode_tokens - eps[r].used)

      group = self._prefill_group(tokens, mask)
      stats["grouped_turns"] += group > 1

      t0 = time.perf_counter()
      keys = _ROW_KEYS(key, turn, first, n)
      # to_host: with several processes the rows are sharded over all of them, and every process needs every row
      # (`group` and `reuse` only when used: stand-in samplers of tests and tools take the plain call's arguments)
      extra = ({"group": group} if group > 1 else {}) | ({"reuse": reuse} if reuse is not None else {})
      choices = self._choices(eps, prompts) if cfg.constrain_actions else None
      if choices is not None:
        extra["choices"] = choices
      before = reuse.prefilled if reuse is not None else 0
      out = to_host(self.sampler(params, tokens, mask, keys, sp.replace(max_new_tokens=jnp.asarray(budget)),
                                 **extra))
      prompt_tokens = sum(len(p) for p in prompts.values())
      stats["prompt_tokens"] += prompt_tokens
      stats["prefilled_tokens"] += reuse.prefilled - before if reuse is not None else prompt_tokens
      stats["sample_s"] += time.perf_counter() - t0
      stats["turns"] += 1
      count_speculation(stats, out, live)

      actions: list[str | None] = [None] * n
      answers = {}
      for r in live:
        ids = np.asarray(out.tokens[r, :out.lengths[r]], np.int32)
        stopped = bool(out.stopped[r])
        text = tok.decode(ids[:-1] if stopped else ids)
        allowed = allowed_tokens(choices[r], ids) if choices is not None else [np.zeros(0, np.int32)] * len(ids)
        stats["forced_tokens"] += sum(len(a) == 1 for a in allowed)
        answers[r] = (ids, np.asarray(out.logps[r, :len(ids)], np.float32), allowed, stopped, text, parse_answer(text))
        actions[r] = answers[r][5].action
      if steps_left is not None:  # rows past the budget, in row order, are cut before their action reaches the env
        stepping = [r for r in live if actions[r] is not None]
        for r in stepping[steps_left:]:
          actions[r] = None
          eps[r].live, eps[r].budget_cut = False, True
        steps_left -= min(steps_left, len(stepping))
        live = [r for r in live if eps[r].live]
      results: list[StepResult | None] = [None] * n
      if any(a is not None for a in actions):
        t0 = time.perf_counter()
        results = list(env.step_batch(actions))
        stats["env_s"] += time.perf_counter() - t0
        if len(results) != n:
          raise RuntimeError(f"RolloutEngine.run: env.step_batch returned {len(results)} results for {n} rows")

      for r in live:
        ids, logps, allowed, stopped, text, parsed = answers[r]
        ep = eps[r]
        builder = builders[r]
        prompt_kinds = np.concatenate([np.asarray(builder.kinds, np.int32), self._frame])
        if parsed.action is None:
          stats["parse_failures"] += 1
          reward, done, success, invalid, next_obs = 0.0, False, False, True, None
          action, next_state = text, ep.state
        else:
          res = results[r]
          if res is None:
            raise RuntimeError(f"RolloutEngine.run: env.step_batch gave no result for stepped row {r} "
                               f"(task {ep.task.task_id!r})")
          reward, done, success, invalid = float(res.reward), bool(res.done), bool(res.success), bool(res.invalid)
          ep.env_error = env_failed(res)
          stats["env_invalid"] += invalid
          stats["env_errors"] += ep.env_error
          action, next_obs, next_state = parsed.action, res.observation, res.observation.state
          score = res.info.get("score") if res.info else None
          ep.score = float(score) if isinstance(score, int | float) and not isinstance(score, bool) else ep.score
        ep.turns.append(_Turn(prompts[r], prompt_kinds, ids, logps, allowed, reward, done, invalid,
                              truncated=not stopped))
        ep.steps.append(StepRecord(ep.state, action, next_state, reward, done, success, invalid, ep.admissible,
                                   "policy"))
        ep.history.append((ep.state, parsed.action if parsed.action is not None else INVALID_ANSWER))
        ep.used += len(ids)
        stats["sampled_tokens"] += len(ids)
        if next_obs is not None:
          ep.state, ep.admissible = next_obs.state, tuple(next_obs.admissible)
        if done:
          ep.live, ep.ended, ep.success = False, True, success
        elif turn + 1 >= cfg.max_turns or ep.used >= cfg.max_episode_tokens:
          ep.live = False

    return eps, steps_left

  def _choices(self, eps: list[_Episode], rows) -> np.ndarray:
    """The sampler's choices for `rows` (`pack_choices`); the other rows are not limited."""
    return pack_choices({r: [self._answer_ids(a) for a in eps[r].admissible] for r in rows}, len(eps),
                        self.cfg.max_action_tokens)

  def _answer_ids(self, action: str) -> tuple[int, ...]:
    if action not in self._answers:
      self._answers[action] = answer_ids(self.tokenizer, action)
    return self._answers[action]

  def _prefill_group(self, tokens: np.ndarray, mask: np.ndarray) -> int:
    """G when `group_prefill` is on and every group's G rows have one prompt (finished rows' dummy prompts are
    equal too), else 1; and 1 where the sampler would turn G down (`Sampler.group_for`)."""
    g, n = self.cfg.group_size, tokens.shape[0]
    if not self.cfg.group_prefill or g == 1 or self.sampler.group_for(n, g) == 1:
      return 1
    same = all((x.reshape(n // g, g, -1) == x[::g, None]).all() for x in (tokens, mask))
    return g if same else 1

  def _episode(self, task: Task, obs: Observation, row: int) -> _Episode:
    if not isinstance(obs, Observation):
      raise RuntimeError(f"RolloutEngine.run: env.reset_batch gave {type(obs).__name__} for row {row}")
    return _Episode(task, obs.instruction or task.instruction, obs.state, tuple(obs.admissible))

  def _assemble(self, eps: list[_Episode], key: jax.Array, policy_version: int) -> Trajectories:
    g = self.cfg.group_size
    turns = [(e, t, turn) for e, ep in enumerate(eps) for t, turn in enumerate(ep.turns)]
    m = len(turns)
    width = max([len(t.prompt) + len(t.sampled) for _, _, t in turns] + [1])
    tokens = np.full((m, width), self.tokenizer.pad_id, np.int32)
    kinds = np.full((m, width), Kind.PAD, np.int32)
    most = max([len(a) for _, _, t in turns for a in t.allowed] + [0])
    allowed = np.full((m, width, most), -1, np.int32)
    logp = np.zeros((m, width), np.float32)
    turn_rows = np.full((len(eps), self.cfg.max_turns), -1, np.int32)
    for row, (e, t, turn) in enumerate(turns):
      p, s = len(turn.prompt), len(turn.sampled)
      tokens[row, :p], tokens[row, p:p + s] = turn.prompt, turn.sampled
      kinds[row, :p], kinds[row, p:p + s] = turn.prompt_kinds, Kind.ACTION
      for j, a in enumerate(turn.allowed):
        allowed[row, p + j, :len(a)] = a
      logp[row, p:p + s] = turn.logps
      turn_rows[e, t] = row
    prompt_lengths = np.asarray([len(t.prompt) for _, _, t in turns], np.int32).reshape(m)
    forced = (allowed >= 0).sum(-1) == 1  # no choice there: out of the loss (see dreamjax.rollout.trajectory)
    col = lambda f, dtype: np.asarray([f(t) for _, _, t in turns], dtype).reshape(m)  # noqa: E731
    run_id = hashlib.blake2b(np.asarray(jax.random.key_data(key)).tobytes(), digest_size=6).hexdigest()
    records = tuple(self._record(ep, r, run_id, policy_version) for r, ep in enumerate(eps))
    return Trajectories(
        tokens=tokens, kinds=kinds, loss_mask=((kinds == Kind.ACTION) & ~forced).astype(np.int32), rollout_logp=logp,
        allowed=allowed if self.cfg.constrain_actions else None,
        lengths=prompt_lengths + col(lambda t: len(t.sampled), np.int32), prompt_lengths=prompt_lengths,
        episode=np.asarray([e for e, _, _ in turns], np.int32).reshape(m),
        turn=np.asarray([t for _, t, _ in turns], np.int32).reshape(m),
        reward=col(lambda t: t.reward, np.float32), done=col(lambda t: t.done, bool),
        invalid=col(lambda t: t.invalid, bool), truncated=col(lambda t: t.truncated, bool),
        group=np.arange(len(eps), dtype=np.int32) // g, task_index=np.arange(len(eps), dtype=np.int32) // g,
        num_turns=np.asarray([len(ep.turns) for ep in eps], np.int32), turn_rows=turn_rows,
        episode_reward=np.asarray([sum(t.reward for t in ep.turns) for ep in eps], np.float32),
        success=np.asarray([ep.success for ep in eps], bool), ended=np.asarray([ep.ended for ep in eps], bool),
        env_error=np.asarray([ep.env_error for ep in eps], bool),
        budget_cut=np.asarray([ep.budget_cut for ep in eps], bool), records=records,
    )

  @staticmethod
  def _record(ep: _Episode, row: int, run_id: str, policy_version: int) -> TrajectoryRecord:
    # Unique across runs (the key) and rows (a task may repeat in one batch); the seed names the row's randomness.
    episode_id = f"policy:{ep.task.task_id}:v{policy_version}:{run_id}:{row}"
    seed = int.from_bytes(hashlib.blake2b(f"{run_id}:{row}".encode(), digest_size=8).digest(), "little") >> 1
    return TrajectoryRecord(episode_id, ep.task.env, ep.task, ep.instruction, "policy", seed, tuple(ep.steps),
                            ep.success, len(ep.steps), ep.score)
