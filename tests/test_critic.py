"""PPO's separate critic (`dreamjax.rl.critic`) in the policy learner: it learns on a fixed batch, its explained
variance is exact, it is laid out like the policy on the 8-device mesh, it is checkpointed and resumed bit for bit;
the shared-head option keeps the earlier path, GRPO builds no critic and takes the unchanged step, and the PPO config
states verl-agent's settings.

One tiny one-layer model with a BPE trained on a few texts (the tiny-run path, as tests/test_nonfinite.py); learners
are updated on hand-built batches of one shape, so no env runs and each step compiles once per learner.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.config import load_config
from dreamjax.loop.checkpoint import RunCheckpointer
from dreamjax.loop.learner import PolicyLearner, RLConfig, as_ppo, value_metrics
from dreamjax.loop.model import ModelSource, prepare_model
from dreamjax.models import tiny
from dreamjax.parallel import MeshConfig, make_mesh
from dreamjax.parallel.sharding import TRAIN_RULES, tree_shardings
from dreamjax.rl.batch import TokenBatch
from dreamjax.rl.critic import CriticConfig, critic_abstract_params, explained_variance
from dreamjax.rl.logprobs import LogpScorer, row_positions, token_logps, token_values
from dreamjax.rl.losses import value_loss
from dreamjax.rl.objectives import Objective, PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.rollout.engine import RolloutConfig
from tests.jax_settings import jax_config, persistent_cache

B, T = 8, 16
ROOT = Path(__file__).resolve().parents[1]
BASE = dict(rollout=RolloutConfig(group_size=2, max_turns=1, prompt_buckets=(64,)), tasks_per_iteration=4,
            rows_per_step=B, pad_to=T, optim=OptimConfig(lr=1e-3))
PPO = dict(BASE, algorithm="ppo", advantage="gae_turn", objective=PolicyGradientConfig(kl_coef=0.01),
           critic=CriticConfig(optim=OptimConfig(lr=3e-3, clip_norm=1.0, weight_decay=0.01)))


def host(tree):
  """`tree` on the host as NumPy arrays (PRNG keys as their data)."""
  def one(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)

  return jax.tree.map(one, jax.device_get(tree))


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def max_rel_diff(a, b) -> float:
  return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30))
             for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True))


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache for this module (as tests/test_rl_real.py): learners built alike (the resumed
  one, the single-device twin of the mesh one) load the executables an earlier one compiled."""
  with jax_config(**persistent_cache(str(tmp_path_factory.mktemp("xla_cache")))):
    yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """(source, model config, host params, tokenizer) of a tiny policy without a value head."""
  texts = [f"You are in room {i}. Take the coin, go north, open the door {i}." for i in range(40)]
  source = ModelSource(tiny=tiny("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=256))
  _, model_cfg, params, tok = prepare_model(source, tmp_path_factory.mktemp("init"), lambda: texts, seed=0)
  assert not model_cfg.value_head and "lm_head" in params
  return source, model_cfg, host(params), tok


def make_learner(model, mesh=None, **kw) -> PolicyLearner:
  source, model_cfg, params, tok = model
  # Fresh device copies: the policy's step donates its state, which must not be the fixture's arrays.
  return PolicyLearner(RLConfig(model=source, **kw), model_cfg, jax.tree.map(jnp.asarray, params), tok, mesh)


def batch(seed: int, vocab: int) -> TokenBatch:
  """Full rows whose action suffix (13 to 15 tokens, one score-length bucket) carries one return per row, as GAE over
  turns gives every action token of a turn its turn's return; old values are left for the caller."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (B, T)).astype(np.int32)
  valid = np.ones((B, T), bool)
  mask = (np.arange(T)[None] >= rng.integers(1, 4, B)[:, None]).astype(np.float32)
  returns = (rng.choice([-1.0, 0.5, 1.0], B)[:, None] * mask).astype(np.float32)
  adv = (rng.normal(size=(B, T)) * mask).astype(np.float32)
  zeros = np.zeros((B, T), np.float32)
  return TokenBatch(tokens=tokens, positions=row_positions(valid), valid=valid, loss_mask=mask,
                    old_logp=zeros - 4.0 * mask, ref_logp=zeros - 4.0 * mask, advantages=adv, returns=returns,
                    old_values=zeros, pair=np.zeros(B, np.int32), chosen=np.zeros(B, bool))


def scored(learner: PolicyLearner, b: TokenBatch) -> TokenBatch:
  """`b` with the critic's current values as old values, as `build_batch` scores them for GAE."""
  return b.replace(old_values=learner.critic.values(b.tokens, b.valid) * b.loss_mask)


@pytest.fixture(scope="module")
def ppo(model):
  return make_learner(model, **PPO)


def test_the_critic_learns_on_a_fixed_batch(ppo):
  """Iterations of critic steps on one batch (values rescored before each, as each PPO iteration does) bring its
  value loss down at every iteration, to under a fifth, and its explained variance from 0 to over 0.8; the policy's
  state is not touched."""
  learner, fixed = ppo, batch(0, ppo.model_cfg.vocab_size)
  policy_before = host(learner.state)
  before = host(learner.critic.state.params)
  losses, explained, rows = [], [], []
  for it in range(5):
    b = scored(learner, fixed)
    explained.append(value_metrics(b)["value_explained_variance"])
    rows.append(learner.update_critic(b, np.arange(B), it))
    losses.append(rows[-1]["vf_loss_first"])  # the loss before the iteration's step: old values = current values
  print(f"critic value loss per iteration {np.round(losses, 4).tolist()}, explained variance "
        f"{np.round(explained, 3).tolist()}")
  assert losses[0] > 0.3  # values start at 0 (zero head) against returns of +-1 and 0.5: 0.5 * mean(R^2)
  assert losses[-1] < 0.2 * losses[0] and all(np.diff(losses) < 0)
  assert explained[0] == 0.0 and explained[-1] > 0.8
  m = rows[-1]
  assert m["critic_update_steps"] == 1 and m["critic_skipped_updates"] == 0 and m["critic_nonfinite_streak"] == 0
  assert m["critic_lr"] == pytest.approx(3e-3) and m["critic_grad_norm"] > 0 and 0 <= m["vf_clip_frac"] <= 1
  assert_same(host(learner.state), policy_before)
  assert max_rel_diff(learner.critic.state.params["layers_0"], before["layers_0"]) > 1e-3  # the backbone trains too


def test_critic_skips_a_nonfinite_step(ppo):
  learner = ppo
  b = scored(learner, batch(1, learner.model_cfg.vocab_size))
  before = host(learner.critic.state)
  returns = np.array(b.returns)
  returns[2, T - 1] = np.nan
  m = learner.update_critic(b.replace(returns=returns), np.arange(B), 10)
  assert (m["critic_skipped_updates"], m["critic_nonfinite_streak"]) == (1, 1) and np.isnan(m["vf_loss"])
  assert_same(host(learner.critic.state), before)
  m = learner.update_critic(b, np.arange(B), 11)
  assert (m["critic_skipped_updates"], m["critic_nonfinite_streak"]) == (0, 0) and np.isfinite(m["vf_loss"])


def test_explained_variance_matches_numpy():
  rng = np.random.default_rng(3)
  returns, values = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
  values[:, :3] = returns[:, :3] + 0.1 * rng.normal(size=(5, 3))
  mask = rng.random((5, 7)) < 0.6
  r, v = returns[mask], values[mask]
  want = 1 - np.mean((r - v - np.mean(r - v)) ** 2) / np.mean((r - np.mean(r)) ** 2)
  assert explained_variance(returns, values, mask.astype(np.float32)) == pytest.approx(want, rel=1e-12)
  assert explained_variance(returns, returns, mask) == 1.0
  assert explained_variance(np.ones((2, 3)), values[:2, :3], np.ones((2, 3))) == 0.0  # returns do not vary
  assert explained_variance(returns, values, np.zeros_like(mask)) == 0.0
  # The step's float32 metric (`value_loss`, exact on one micro-batch) agrees.
  _, metrics = value_loss(values, values, returns, mask.astype(np.float32), clip=None)
  assert float(metrics["explained_variance"]) == pytest.approx(want, rel=1e-5)


def test_critic_values_need_no_lm_head(model):
  """The critic's forward skips the LM head: its values are the full model's value head, and a tree without
  `lm_head` (the critic's) scores them, also through the host scorer."""
  _, model_cfg, params, _ = model
  cfg = model_cfg.replace(value_head=True)
  full = {**params, "value_head": np.random.default_rng(0).normal(0, 0.1, (cfg.hidden_size,)).astype(np.float32)}
  critic = {k: v for k, v in full.items() if k != "lm_head"}
  assert set(critic) == set(critic_abstract_params(cfg))
  b = batch(2, cfg.vocab_size)
  want = jax.jit(lambda p: token_logps(cfg, p, b.tokens, b.positions, b.valid, with_values=True).values)(full)
  got = jax.jit(lambda p: token_values(cfg, p, b.tokens, b.positions, b.valid))(critic)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  _, scorer_values = LogpScorer(cfg, 3, values_only=True, pad_to=T)(critic, b.tokens, None, b.valid)
  np.testing.assert_allclose(scorer_values, want, rtol=1e-5, atol=1e-6)  # other batch shapes: other rounding


def test_the_critic_is_laid_out_like_the_policy_on_the_mesh(model):
  """On data=2, fsdp=2, tensor=2: every critic weight and Adam moment has the policy's sharding (the value head the
  rules'), the critic has no LM head, and its step and values equal one device's."""
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  sharded, single = make_learner(model, mesh, **PPO), make_learner(model, **PPO)
  critic, policy = sharded.critic.state, sharded.state
  assert "lm_head" in policy.params and "lm_head" not in critic.params
  spec = lambda tree: jax.tree.map(lambda x: x.sharding.spec, tree)  # noqa: E731
  for name, leaf in critic.params.items():
    if name != "value_head":
      assert spec(leaf) == spec(policy.params[name]), name
  heads = tree_shardings(critic_abstract_params(sharded.model_cfg), mesh, TRAIN_RULES)
  assert critic.params["value_head"].sharding == heads["value_head"]
  assert critic.params["layers_0"]["mlp"]["gate"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  mu = critic.opt_state[1].mu  # (clip, adam, decay, lr): Adam's moments take the weights' shardings
  assert spec(mu["layers_0"]) == spec(policy.opt_state[1].mu["layers_0"])
  layout = jax.tree.map(lambda x: x.sharding, critic)
  b = batch(4, sharded.model_cfg.vocab_size)
  np.testing.assert_allclose(sharded.critic.values(b.tokens, b.valid), single.critic.values(b.tokens, b.valid),
                             rtol=1e-5, atol=1e-6)
  b = scored(single, b)
  m_sharded = sharded.update_critic(b, np.arange(B), 0)
  m_single = single.update_critic(b, np.arange(B), 0)
  for key in ("vf_loss", "critic_grad_norm", "vf_clip_frac"):
    assert m_sharded[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key
  assert max_rel_diff(sharded.critic.state.params, single.critic.state.params) < 1e-5
  assert jax.tree.map(lambda x: x.sharding, sharded.critic.state) == layout  # donated and updated in place


def test_critic_steps_take_the_policys_length_buckets(model):
  """With `length_buckets` the critic's step is bucketed as the policy's (micro-batches of similar row length, each
  cut to its own longest row): on rows of varied length its update and metrics are the unbucketed critic's, to
  float32 rounding, with one compilation per micro-batch length."""
  settings = dict(PPO, micro_batches=4, pad_to=4)
  plain, bucketed = make_learner(model, **settings), make_learner(model, **settings, length_buckets=True)
  b = batch(5, plain.model_cfg.vocab_size)
  lengths = np.array([3, 16, 5, 14, 4, 16, 6, 12])  # in pairs by length: 3 4 | 5 6 | 12 14 | 16 16
  valid = np.arange(T)[None] < lengths[:, None]
  mask = b.loss_mask * valid
  b = scored(plain, b.replace(valid=valid, positions=row_positions(valid), loss_mask=mask,
                              advantages=b.advantages * mask, returns=b.returns * mask))
  before = host(plain.critic.state.params)
  m_plain, m_bucketed = plain.update_critic(b, np.arange(B), 0), bucketed.update_critic(b, np.arange(B), 0)
  for key in ("vf_loss", "critic_grad_norm", "vf_clip_frac"):
    assert m_bucketed[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
  assert max_rel_diff(bucketed.critic.state.params, plain.critic.state.params) < 1e-5
  assert max_rel_diff(plain.critic.state.params, before) > 1e-4  # the step moved the critic
  assert bucketed.critic.step.compilations() == 3  # micro-batch lengths 4, 8, 16 and 16 (pad_to 4)


def test_checkpoint_holds_the_critic_and_a_resume_continues_equal(model, tmp_path):
  """A PPO learner's checkpoint arrays hold the critic's train state; restored into a fresh learner they are equal,
  and the next iteration's policy and critic updates give the same states, bit for bit."""
  first = make_learner(model, **PPO)
  vocab = first.model_cfg.vocab_size

  def iteration(learner, it):
    b = scored(learner, batch(10 + it, vocab))
    learner.update(b, np.arange(B), it)
    learner.update_critic(b, np.arange(B), it)

  iteration(first, 0)
  arrays = first.checkpoint_arrays()
  assert set(arrays) == {"state", "root", "ref_params", "critic"}
  with RunCheckpointer(tmp_path / "ckpt", keep=1) as ckpt:
    ckpt.save(1, arrays, {"iteration": 1})
    ckpt.wait()
    saved = host(arrays)
    iteration(first, 1)
    second = make_learner(model, **PPO)
    restored, _ = ckpt.restore(1, like=second.checkpoint_arrays())
  second.load_checkpoint_arrays(restored)
  assert_same(host(second.critic.state), saved["critic"])
  assert int(second.critic.state.step) == 1 and int(second.state.step) == 1
  iteration(second, 1)
  assert_same(host(second.critic.state), host(first.critic.state))
  assert_same(host(second.state), host(first.state))


def test_shared_head_option_keeps_the_value_head_on_the_policy(model):
  """critic.mode "shared_head": no critic model; values come from the policy's head and its loss carries vf_coef."""
  source, model_cfg, params, tok = model
  cfg = RLConfig(model=source, **{**PPO, "objective": PolicyGradientConfig(vf_coef=0.5),
                                  "critic": CriticConfig(mode="shared_head")})
  assert cfg.shared_head and not cfg.separate_critic
  with_head = {**params, "value_head": np.zeros((model_cfg.hidden_size,), np.float32)}
  learner = PolicyLearner(cfg, model_cfg.replace(value_head=True), jax.tree.map(jnp.asarray, with_head), tok)
  assert learner.critic is None and learner.value_scorer is not None and learner.objective.config.vf_coef == 0.5
  assert set(learner.checkpoint_arrays()) == {"state", "root"}
  b = batch(5, model_cfg.vocab_size)
  m = learner.update(b, np.arange(B), 0)
  assert m["vf_loss"] > 0 and "explained_variance" in m
  assert float(jnp.max(jnp.abs(learner.state.params["value_head"]))) > 0  # the head moved with the policy's step
  with pytest.raises(ValueError, match="shared-head critic .* set objective.vf_coef > 0"):
    RLConfig(algorithm="ppo", advantage="gae_turn", critic=CriticConfig(mode="shared_head"))
  # The separate critic (the default) drops the policy's value term, whatever vf_coef says.
  separate = make_learner(model, **{**PPO, "objective": PolicyGradientConfig(vf_coef=0.5)})
  assert separate.value_scorer is None and separate.objective.config.vf_coef == 0.0


def test_grpo_builds_no_critic_and_takes_the_unchanged_step(model):
  """A GRPO learner has no critic, no value scorer and the earlier checkpoint arrays, and its step is the one the
  GRPO objective and optimizer give on their own, bit for bit."""
  source, model_cfg, params, _ = model
  learner = make_learner(model, **BASE, objective=PolicyGradientConfig(kl_coef=0.05))
  cfg = learner.cfg
  assert not cfg.separate_critic and not cfg.shared_head
  assert learner.critic is None and learner.value_scorer is None
  assert set(learner.checkpoint_arrays()) == {"state", "root", "ref_params"}
  assert learner.objective == Objective("grpo", cfg.objective)
  b = batch(6, model_cfg.vocab_size)
  direct = make_train_step(model_cfg, Objective("grpo", cfg.objective), make_optimizer(cfg.optim))
  state, m = direct(create_train_state(model_cfg, jax.tree.map(jnp.asarray, params), make_optimizer(cfg.optim)), b,
                    jax.random.key(0))
  got, m2 = learner.step(learner.state, b, jax.random.key(0))
  assert_same(host(got), host(state))
  assert host(m2) == host(m)


def test_ppo_config_states_verl_agents_settings():
  grpo = load_config(ROOT / "configs" / "grpo_real_twx.py")
  cfg = load_config(ROOT / "configs" / "ppo_real_twx.py")
  assert (cfg.algorithm, cfg.advantage, cfg.gamma, cfg.lam, cfg.epochs, cfg.whiten_advantages) == \
      ("ppo", "gae_turn", 1.0, 1.0, 1, True)
  o = cfg.objective
  assert (o.clip_low, o.clip_high, o.kl_coef, o.kl_kind, o.entropy_coef, o.vf_coef) == (0.2, 0.2, 0.01, "low_var_kl",
                                                                                       0.0, 0.0)
  c = cfg.critic
  assert (c.mode, c.optim.lr, c.optim.weight_decay, c.optim.clip_norm, c.optim.warmup_steps, c.value_clip) == \
      ("separate", 1e-5, 0.01, 1.0, 0, 0.5)
  assert c.epochs == c.rows_per_step == c.micro_batches == 0  # the policy's
  # Everything else is the GRPO config's: the rows differ only by the algorithm.
  same = ("model", "env", "env_kwargs", "train_tasks", "eval_tasks", "agent", "rollout", "tasks_per_iteration", "optim",
          "rows_per_step", "micro_batches", "pad_to", "iterations", "invalid_penalty")
  assert all(getattr(cfg, f) == getattr(grpo, f) for f in same)
  assert as_ppo(grpo, out_dir=cfg.out_dir) == cfg
  tiny_cfg = load_config(ROOT / "configs" / "ppo_real_twx.py:tiny")
  assert tiny_cfg.separate_critic and tiny_cfg.critic.optim.lr == 3e-3
  with pytest.raises(ValueError, match="CriticConfig.mode must be one of"):
    CriticConfig(mode="twin")
  with pytest.raises(ValueError, match=r"critic: rows_per_step \(6\) must be a multiple of micro_batches \(4\)"):
    as_ppo(grpo, critic=CriticConfig(rows_per_step=6, micro_batches=4))
