"""The scale configs (configs/scale/) run the paper's reasoning agent and train M_exp on a teacher's reasoning only.

- Every scale config asks its policy for `<think>...</think><action>...</action>` answers within the paper's 512-token
  response budget per turn, and ends episodes on the turn limit alone.
- Each DreamGym scale config's M_exp SFT command trains on teacher annotations with `require_teacher_annotations` on,
  and its policy SFT command learns the same answer layout.
- At tiny size, the rollout engine with the scale configs' agent format: a tiny policy tuned to answer in the think
  layout parses and acts within a roomy budget, and with a budget too small for the layout every row is a counted
  parse failure (recorded, never sent to the env), not a crash.
"""

import re
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dreamjax.config import load_config
from dreamjax.envs.base import Observation, SerialBatchEnv, StepResult, Task
from dreamjax.models import Transformer, init_params, tiny
from dreamjax.rollout.agent import INVALID_ANSWER, build_turn_prompt, format_answer, parse_answer, user_text
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.text import Kind, train_bpe_tokenizer

ROOT = Path(__file__).parent.parent
SCALE = sorted((ROOT / "configs" / "scale").glob("*.py"))
DREAMGYM = [p for p in SCALE if p.name.startswith("dreamgym_")]


def _rl(path: Path):
  cfg = load_config(path)
  return getattr(cfg, "rl", cfg)


def _commands(path: Path) -> dict[str, list[str]]:
  """The `dreamjax <command> ...` lines of a docstring (continuations joined), as argument lists by command."""
  doc = path.read_text().split('"""')[1]
  out = {}
  for line in re.findall(r"^       (dreamjax (?:.*\\\n)*.*)$", doc, re.M):
    words = shlex.split(line.replace("\\\n", " "))
    out[words[1]] = words[2:]
  return out


def test_scale_configs_found():
  assert {p.name for p in DREAMGYM} == {"dreamgym_llama3b_tpu.py", "dreamgym_llama8b_gpu.py", "dreamgym_qwen7b_tpu.py"}
  assert len(SCALE) >= 4


@pytest.mark.parametrize("path", SCALE, ids=lambda p: p.name)
def test_scale_agents_reason_within_the_papers_response_budget(path):
  rl = _rl(path)
  assert rl.agent.think and "<think>" in rl.agent.system_text()
  assert rl.rollout.max_action_tokens == 512
  assert rl.rollout.max_episode_tokens == rl.rollout.max_turns * 512  # only the turn limit ends an episode
  # The tiny variants keep their own (bare-action) warm start's format.
  assert not _rl(f"{path}:tiny").agent.think


@pytest.mark.parametrize("path", DREAMGYM, ids=lambda p: p.name)
def test_scale_commands_train_m_exp_on_teacher_reasoning_only(path):
  commands = _commands(path)
  assert commands["annotate"][:2] == ["--config", "configs/annotate_twx.py"]
  assert "annotator=teacher" in commands["annotate"]
  sets = [w for w in commands["train-exp"] if w != "--set"]
  exp = load_config(ROOT / commands["train-exp"][1], sets[2:])
  assert exp.require_teacher_annotations and exp.annotations == ("runs/collect/twx/annotations.teacher.jsonl",)
  assert load_config(ROOT / commands["train-exp"][1], [*sets[2:], "require_teacher_annotations=false"]) \
      .require_teacher_annotations is False  # the override the docstring names
  sets = [w for w in commands["train-policy"] if w != "--set"]
  sft = load_config(ROOT / commands["train-policy"][1], sets[2:])
  assert sft.agent == _rl(path).agent and sft.rollout.max_action_tokens == 512


# --- the think format at tiny size ----------------------------------------------------------------------------------

STATE, ADMISSIBLE, THINK = "You are in the kitchen. You see a coin.", ("take coin", "look around"), "The coin is here."


class CoinEnv:
  """One room with a coin: "take coin" wins, any other action changes nothing."""

  name = "coin"

  def reset(self, task: Task) -> Observation:
    return Observation(STATE, task.instruction, ADMISSIBLE)

  def step(self, action: str) -> StepResult:
    won = action == "take coin"
    return StepResult(Observation("You took the coin." if won else STATE, "", ADMISSIBLE), float(won), won, won)

  def close(self) -> None:
    pass


@pytest.fixture(scope="module")
def think_policy(tmp_path_factory):
  """(agent format of the scale configs, tokenizer, model config, params tuned on think-layout answers)."""
  fmt = _rl(DREAMGYM[0]).agent
  task = Task.make("coin", "coin/0", "Take the coin.")
  answer = format_answer("take coin", THINK)
  texts = [fmt.system_text(), user_text(fmt, task.instruction, 0, (), STATE, ADMISSIBLE), answer, INVALID_ANSWER]
  tok = train_bpe_tokenizer(texts * 8, tmp_path_factory.mktemp("tok"), vocab_size=300)
  cfg = tiny("qwen2", vocab_size=tok.vocab_size, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
             num_kv_heads=1, head_dim=16, max_position_embeddings=1024)
  ids, kinds = build_turn_prompt(tok, fmt, task.instruction, 0, (), STATE, ADMISSIBLE).append(Kind.ACTION,
                                                                                             answer).arrays()
  ids, target = np.asarray(ids)[None], (np.asarray(kinds) == Kind.ACTION)[None, 1:].astype(np.float32)
  positions = np.arange(ids.shape[1] - 1)[None]
  opt = optax.adam(1e-2)

  def loss_fn(params):
    logits = Transformer(cfg).apply({"params": params}, ids[:, :-1], positions, np.ones_like(positions, bool)).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * target) / jnp.sum(target)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = init_params(cfg, jax.random.key(0))
  state = opt.init(params)
  for _ in range(60):
    params, state, loss = step(params, state)
  assert float(loss) < 0.05
  return fmt, tok, cfg, params, task


@pytest.mark.parametrize("budget", [48, 6])
def test_think_answers_parse_or_count_as_parse_failures(think_policy, budget):
  fmt, tok, cfg, params, task = think_policy
  rollout = RolloutConfig(group_size=2, max_turns=2, max_action_tokens=budget, max_episode_tokens=2 * budget,
                          prompt_buckets=(512,), temperature=0.0)
  env = SerialBatchEnv([CoinEnv(), CoinEnv()])
  traj = RolloutEngine(cfg, tok, fmt, rollout).run(params, env, [task], jax.random.key(0))
  sampled = traj.lengths - traj.prompt_lengths
  assert (sampled <= budget).all()
  parsed = []
  for m in range(traj.num_rows):
    ids = traj.tokens[m, traj.prompt_lengths[m]:traj.lengths[m]]
    parsed.append(parse_answer(tok.decode(ids if traj.truncated[m] else ids[:-1])))
  failures = [p.action is None for p in parsed]
  assert traj.stats["parse_failures"] == sum(failures)
  assert all(traj.invalid[m] for m in range(traj.num_rows) if failures[m])  # a failure is an invalid turn, reward 0
  if budget == 48:  # room for the whole layout: the tuned answer parses, thinks and wins on the first turn
    assert not any(failures) and all(p.think == THINK and p.action == "take coin" for p in parsed)
    assert traj.success.all() and (traj.num_turns == 1).all() and not traj.truncated.any()
  else:  # cut inside the think block: no turn parses, and the episodes run out of turns
    assert all(failures) and (traj.num_turns == 2).all() and not traj.success.any()
    first = traj.turn_rows[:, 0]
    assert traj.truncated[first].all() and all(r.steps[0].action.startswith("<think>") for r in traj.records)
