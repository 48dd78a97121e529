"""Advantages and losses against plain NumPy references written the obvious way (loops, float64), plus edge cases:
degenerate GRPO groups, empty masks, truncated vs terminal GAE, each clipping branch, finite gradients, jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.rl import advantages as A
from dreamjax.rl import losses as L

RTOL, ATOL = 1e-5, 1e-6

# The functions under test, jitted as the update step uses them; strings and structural switches are static, the
# numeric hyperparameters (clip ranges, gamma, lam, beta, eps) are traced. One compile per shape keeps the file fast.
grpo = jax.jit(A.grpo_advantages, static_argnames=("num_groups", "normalize_std", "ddof"))
gae = jax.jit(A.gae_advantages)
whiten = jax.jit(A.whiten, static_argnames=("shift_mean",))
aggregate = jax.jit(L.aggregate, static_argnames=("mode", "horizon"))
ppo = jax.jit(L.ppo_clip_loss, static_argnames=("dual_clip", "agg"))
kl_penalty = jax.jit(L.kl_penalty, static_argnames=("kind",))
kl_loss = jax.jit(L.kl_loss, static_argnames=("kind", "agg"))
entropy = jax.jit(L.entropy_from_logits)
entropy_loss = jax.jit(L.entropy_loss, static_argnames=("agg",))
value_loss = jax.jit(L.value_loss, static_argnames=("clip", "agg"))
sft = jax.jit(L.sft_loss, static_argnames=("agg",))
dpo = jax.jit(L.dpo_loss)


def close(got, want, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- NumPy references


def ref_grpo(rewards, group, valid, normalize_std=True, ddof=1, eps=1e-6):
  out = np.zeros(len(rewards))
  members = {}
  for i in range(len(rewards)):
    if valid[i]:
      members.setdefault(int(group[i]), []).append(i)
  for rows in members.values():
    r = np.array([float(rewards[i]) for i in rows])
    if len(rows) < 2 or r.max() == r.min():
      continue
    mean = r.mean()
    std = np.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - ddof))
    for i, x in zip(rows, r):
      out[i] = (x - mean) / (std + eps) if normalize_std else x - mean
  return out


def ref_gae(rewards, values, mask, gamma, lam, bootstrap=None):
  n, length = rewards.shape
  adv, ret = np.zeros((n, length)), np.zeros((n, length))
  for i in range(n):
    steps = int(mask[i].sum())
    last_gae = 0.0
    for t in reversed(range(steps)):
      next_value = values[i, t + 1] if t + 1 < steps else (0.0 if bootstrap is None else bootstrap[i])
      delta = rewards[i, t] + gamma * next_value - values[i, t]
      last_gae = delta + gamma * lam * last_gae
      adv[i, t] = last_gae
      ret[i, t] = last_gae + values[i, t]
  return adv, ret


def ref_agg(x, mask, mode):
  x, m = np.asarray(x, np.float64), np.asarray(mask, np.float64)
  if mode == "token_mean":
    return (x * m).sum() / m.sum() if m.sum() > 0 else 0.0
  per_row = []
  for i in range(x.shape[0]):
    if m[i].sum() == 0:
      continue
    s = (x[i] * m[i]).sum()
    per_row.append(s / m[i].sum() if mode == "seq_mean_token_mean" else s)
  loss = float(np.mean(per_row)) if per_row else 0.0
  return loss / x.shape[-1] if mode == "seq_mean_token_sum_norm" else loss


def ref_ppo(logp, old, adv, mask, clip_low, clip_high, dual_clip, mode):
  ratio = np.exp(np.float64(logp) - old)
  per_token, clipped, dual = np.zeros_like(ratio), np.zeros_like(ratio), np.zeros_like(ratio)
  for idx in np.ndindex(ratio.shape):
    a, r = float(adv[idx]), ratio[idx]
    surr = -a * r
    surr_clip = -a * min(max(r, 1 - clip_low), 1 + clip_high)
    per_token[idx] = max(surr, surr_clip)
    clipped[idx] = surr_clip > surr
    if dual_clip is not None and a < 0 and per_token[idx] > -a * dual_clip:
      per_token[idx], dual[idx] = -a * dual_clip, 1.0
  m = np.asarray(mask, np.float64)
  metrics = {
      "clip_frac": (clipped * m).sum() / m.sum(),
      "approx_kl": ((ratio - 1 - np.log(ratio)) * m).sum() / m.sum(),
      "ratio_mean": (ratio * m).sum() / m.sum(),
      "ratio_max": ratio[m > 0].max(),
  }
  if dual_clip is not None:
    metrics["dual_clip_frac"] = (dual * m).sum() / m.sum()
  return ref_agg(per_token, m, mode), metrics


def ref_kl(logp, ref, kind):
  d = np.float64(logp) - ref
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d**2
  k3 = lambda u: np.exp(-u) + u - 1  # noqa: E731
  return k3(d) if kind == "k3" else np.clip(k3(np.clip(d, -20, 20)), -10, 10)


def ref_entropy(logits):
  z = np.float64(logits)
  out = np.zeros(z.shape[:-1])
  for idx in np.ndindex(out.shape):
    row = z[idx]
    p = np.exp(row - row.max())
    p /= p.sum()
    out[idx] = -sum(pi * np.log(pi) for pi in p if pi > 0)
  return out


def ref_value(values, old, ret, mask, clip, mode):
  v, old, ret, m = np.float64(values), np.float64(old), np.float64(ret), np.float64(mask)
  err = (v - ret) ** 2
  if clip is None:
    per_token, frac = err, 0.0
  else:
    err_c = (old + np.clip(v - old, -clip, clip) - ret) ** 2
    per_token, frac = np.maximum(err, err_c), ((err_c > err) * m).sum() / m.sum()
  sel = m > 0
  ev = 1 - np.var(ret[sel] - v[sel]) / np.var(ret[sel])
  return 0.5 * ref_agg(per_token, m, mode), {"vf_clip_frac": frac, "explained_variance": ev}


def ref_dpo(c, r, rc, rr, beta, ls):
  z = beta * ((np.float64(c) - rc) - (np.float64(r) - rr))
  log_sig = lambda u: -np.logaddexp(0.0, -u)  # noqa: E731
  loss = np.mean(-(1 - ls) * log_sig(z) - ls * log_sig(-z))
  cr, rj = beta * (np.float64(c) - rc), beta * (np.float64(r) - rr)
  return loss, {"reward_accuracy": np.mean(cr > rj), "margin": np.mean(cr - rj), "chosen_reward": cr.mean(),
                "rejected_reward": rj.mean()}


def prefix_mask(rng, n, length, min_len=0):
  lengths = rng.integers(min_len, length + 1, size=n)
  return np.arange(length)[None, :] < lengths[:, None]


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("n,groups,seed", [(8, 2, 0), (37, 5, 1), (64, 16, 2)])
@pytest.mark.parametrize("normalize_std,ddof", [(True, 1), (True, 0), (False, 1)])
def test_grpo_matches_reference(n, groups, seed, normalize_std, ddof):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=n).astype(np.float32)
  rewards[: n // 3] = rng.integers(0, 2, size=n // 3)  # binary outcome rewards too
  group = rng.integers(0, groups, size=n).astype(np.int32)
  valid = rng.random(n) > 0.2
  got = grpo(rewards, group, valid, num_groups=groups, normalize_std=normalize_std, ddof=ddof)
  close(got, ref_grpo(rewards, group, valid, normalize_std, ddof))


def test_grpo_degenerate_groups_are_exactly_zero():
  # group 0: all 0.1 (float32 mean of equal values is not exact); group 1: one valid row (its partner is invalid);
  # group 2: binary rewards; group 3: rewards that differ by one ulp-ish step; -1 ids on invalid rows.
  rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.3, 1, 0, 0, 0, 0.1, np.float32(0.1) + 1e-8, 5.0], np.float32)
  group = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, -1], np.int32)
  valid = np.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0], bool)
  for normalize_std in (True, False):
    got = np.asarray(grpo(rewards, group, valid, num_groups=4, normalize_std=normalize_std))
    assert np.all(np.isfinite(got))
    assert np.all(got[[0, 1, 2, 3, 4, 11]] == 0.0)
    assert np.all(np.abs(got) <= 2.0)  # |r - mean| / std is at most sqrt(n - 1) for ddof=1; eps keeps it below
    close(got, ref_grpo(rewards, group, valid, normalize_std))
  # Binary group [1, 0, 0, 0]: mean 1/4, unbiased std sqrt(1/4): A = (1.5, -0.5, -0.5, -0.5).
  got = np.asarray(grpo(rewards, group, valid, num_groups=4, eps=0.0))
  close(got[5:9], [1.5, -0.5, -0.5, -0.5])
  none_valid = grpo(rewards, group, np.zeros(12, bool), num_groups=4)
  assert np.all(np.asarray(none_valid) == 0.0)


@pytest.mark.parametrize("n,length,seed", [(3, 1, 0), (5, 7, 1), (16, 12, 2)])
@pytest.mark.parametrize("truncated", [False, True])
def test_gae_matches_reference(n, length, seed, truncated):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=(n, length)).astype(np.float32)
  values = rng.normal(size=(n, length)).astype(np.float32)
  mask = prefix_mask(rng, n, length)
  boot = rng.normal(size=n).astype(np.float32) if truncated else None
  adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9, bootstrap=boot)
  want_adv, want_ret = ref_gae(rewards, values, mask, 0.97, 0.9, boot)
  close(adv, want_adv)
  close(ret, want_ret)


def test_gae_truncated_vs_terminal_and_reward_to_go():
  rng = np.random.default_rng(3)
  n, length = 6, 9
  rewards = rng.normal(size=(n, length)).astype(np.float32)
  values = rng.normal(size=(n, length)).astype(np.float32)
  mask = prefix_mask(rng, n, length, min_len=1)
  boot = rng.normal(size=n).astype(np.float32)
  terminal, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
  zero_boot, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap=np.zeros(n, np.float32))
  truncated, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap=boot)
  np.testing.assert_array_equal(np.asarray(terminal), np.asarray(zero_boot))
  # The bootstrap enters the last valid step as gamma * V and earlier steps discounted by (gamma * lam) per step.
  steps = mask.sum(1)
  k = np.arange(length)[None, :]
  expected_shift = np.where(mask, 0.9 * boot[:, None] * (0.9 * 0.8) ** (steps[:, None] - 1 - k), 0.0)
  close(np.asarray(truncated) - np.asarray(terminal), expected_shift)
  # gamma = lam = 1: returns are the undiscounted reward-to-go whatever the critic says (plus the bootstrap).
  _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
  rtg = np.where(mask, np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1], 0.0)
  close(ret, rtg, rtol=1e-5, atol=1e-5)
  _, ret_b = gae(rewards, values, mask, gamma=1.0, lam=1.0, bootstrap=boot)
  close(ret_b, np.where(mask, rtg + boot[:, None], 0.0), rtol=1e-5, atol=1e-5)
  # lam = 0: one-step TD errors.
  adv0, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
  next_v = np.where(np.roll(mask, -1, axis=1) & (k < length - 1), np.roll(values, -1, axis=1), 0.0)
  close(adv0, np.where(mask, rewards + 0.9 * next_v - values, 0.0))
  # All-invalid rows give zeros.
  adv_empty, ret_empty = gae(rewards, values, np.zeros_like(mask), gamma=0.9, lam=0.8, bootstrap=boot)
  assert not np.any(np.asarray(adv_empty)) and not np.any(np.asarray(ret_empty))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shift_mean):
  rng = np.random.default_rng(4)
  x = (3.0 + 2.0 * rng.normal(size=(7, 11))).astype(np.float32)
  mask = prefix_mask(rng, 7, 11)
  sel = x[mask].astype(np.float64)
  mean, var = sel.mean(), sel.var(ddof=1)
  want = (x - mean) / np.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
  close(whiten(x, mask, shift_mean=shift_mean), np.where(mask, want, 0.0))
  assert not np.any(np.asarray(whiten(x, np.zeros_like(mask))))


def test_advantage_registry():
  assert A.get_advantage("grpo") is A.grpo_advantages and A.get_advantage("gae") is A.gae_advantages
  with pytest.raises(ValueError, match="'gae', 'grpo'"):
    A.get_advantage("reinforce")


# ---------------------------------------------------------------- losses


def random_batch(seed, b, t, empty_row=True):
  rng = np.random.default_rng(seed)
  logp = (-rng.gamma(2.0, 1.0, size=(b, t))).astype(np.float32)
  old = (logp + 0.3 * rng.normal(size=(b, t))).astype(np.float32)
  mask = prefix_mask(rng, b, t, min_len=1)
  if empty_row:
    mask[-1] = False  # a padding row of a fixed-shape batch
  return rng, logp, old, mask


@pytest.mark.parametrize("mode", L.AGG_MODES)
@pytest.mark.parametrize("b,t,seed", [(4, 6, 0), (9, 13, 1)])
def test_aggregate_matches_reference(mode, b, t, seed):
  rng, x, _, mask = random_batch(seed, b, t)
  close(aggregate(x, mask, mode), ref_agg(x, mask, mode))
  weights = (mask * rng.random((b, t))).astype(np.float32)  # float masks weigh tokens
  close(aggregate(x, weights, mode), ref_agg(x, weights, mode))
  assert float(aggregate(x, np.zeros_like(mask), mode)) == 0.0
  assert float(aggregate(x, mask, mode.replace("_", "-"))) == float(aggregate(x, mask, mode))


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregate_denom_splits_into_micro_batches(mode):
  _, x, _, mask = random_batch(5, 8, 10)
  full = float(aggregate(x, mask, mode))
  denom = mask.sum() if mode == "token_mean" else (mask.sum(1) > 0).sum()
  halves = sum(float(aggregate(x[s], mask[s], mode, denom=denom, horizon=10)) for s in (slice(0, 4), slice(4, 8)))
  close(halves, full)


@pytest.mark.parametrize("b,t,seed", [(4, 5, 0), (8, 16, 1)])
@pytest.mark.parametrize("clip_low,clip_high,dual_clip,mode", [
    (0.2, 0.2, None, "token_mean"), (0.2, 0.28, None, "seq_mean_token_mean"), (0.2, 0.28, 3.0, "seq_mean_token_sum")])
def test_ppo_clip_matches_reference(b, t, seed, clip_low, clip_high, dual_clip, mode):
  rng, logp, old, mask = random_batch(seed, b, t)
  adv = rng.normal(size=(b, t)).astype(np.float32)
  loss, metrics = ppo(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                                  agg=mode)
  want, want_metrics = ref_ppo(logp, old, adv, mask, clip_low, clip_high, dual_clip, mode)
  close(loss, want)
  assert set(metrics) == set(want_metrics)
  for k in want_metrics:
    close(metrics[k], want_metrics[k])
  # Per-row advantages broadcast over the row's tokens.
  row_adv = adv[:, 0]
  loss_row, _ = ppo(logp, old, row_adv, mask, clip_low=clip_low, clip_high=clip_high, agg=mode)
  close(loss_row, ref_ppo(logp, old, np.repeat(row_adv[:, None], t, 1), mask, clip_low, clip_high, None, mode)[0])


def test_ppo_clip_branches_fire():
  old = np.zeros((1, 5), np.float32)
  # ratios: 1.25 (A>0: inside clip-higher 0.28, outside 0.2), 1.5 (A>0: clipped both ways), 0.5 (A<0: clipped at 0.8),
  # 5.0 (A<0: unclipped, -A r = 5 exceeds the dual bound 3), 1.0 (untouched)
  logp = np.log(np.array([[1.25, 1.5, 0.5, 5.0, 1.0]], np.float32))
  adv = np.array([[1.0, 1.0, -1.0, -1.0, 1.0]], np.float32)
  mask = np.ones((1, 5), bool)

  def per_token_loss(**kw):
    out = []
    for j in range(5):
      m = np.zeros((1, 5), bool)
      m[0, j] = True
      out.append(float(ppo(logp, old, adv, m, **kw)[0]))
    return np.array(out)

  close(per_token_loss(clip_low=0.2, clip_high=0.2), [-1.2, -1.2, 0.8, 5.0, -1.0])
  close(per_token_loss(clip_low=0.2, clip_high=0.28), [-1.25, -1.28, 0.8, 5.0, -1.0])
  close(per_token_loss(clip_low=0.2, clip_high=0.28, dual_clip=3.0), [-1.25, -1.28, 0.8, 3.0, -1.0])
  _, sym = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
  _, asym = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
  close(sym["clip_frac"], 3 / 5)  # 1.25, 1.5 and 0.5
  close(asym["clip_frac"], 2 / 5)  # 1.25 now inside the clip-higher range
  close(asym["dual_clip_frac"], 1 / 5)
  close(asym["ratio_max"], 5.0)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    L.ppo_clip_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_empty_mask_is_zero_with_finite_grad():
  _, logp, old, mask = random_batch(6, 3, 4)
  adv = np.ones_like(logp)
  empty = np.zeros_like(mask)
  loss, metrics = ppo(logp, old, adv, empty, dual_clip=3.0)
  assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
  grad = jax.grad(lambda lp: ppo(lp, old, adv, empty)[0])(jnp.asarray(logp))
  assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("kind", list(L.KL_KINDS))
def test_kl_matches_reference(kind):
  rng, logp, ref, mask = random_batch(7, 6, 9)
  ref = ref.copy()
  ref[0, :3] = logp[0, :3] + np.array([30.0, -30.0, 15.0])  # exercise the low_var_kl clamps
  mask[0, :3] = True
  close(kl_penalty(logp, ref, kind), ref_kl(logp, ref, kind), rtol=2e-5)
  close(kl_loss(logp, ref, mask, kind=kind), ref_agg(ref_kl(logp, ref, kind), mask, "token_mean"), rtol=2e-5)
  if kind == "low_var_kl":
    pen = np.asarray(kl_penalty(logp, ref, kind))
    assert pen[0, 0] == 10.0 and pen[0, 1] == 10.0 and np.all(pen <= 10.0)
  with pytest.raises(ValueError, match="low_var_kl"):
    L.kl_penalty(logp, ref, "k4")


def test_entropy_matches_reference():
  rng = np.random.default_rng(8)
  logits = (3.0 * rng.normal(size=(3, 4, 17))).astype(np.float32)
  close(entropy(logits), ref_entropy(logits))
  shifted = logits + 1e4  # logsumexp form is shift invariant and does not overflow
  close(entropy(shifted), ref_entropy(logits), rtol=1e-3, atol=1e-3)
  close(entropy(np.zeros((2, 2, 10), np.float32)), np.full((2, 2), np.log(10.0)))
  masked_vocab = logits.copy()
  masked_vocab[..., 5:] = -np.inf
  ent = entropy(masked_vocab)
  close(ent, ref_entropy(logits[..., :5]))
  mask = prefix_mask(rng, 3, 4, min_len=1)
  close(entropy_loss(ent, mask), ref_agg(ref_entropy(logits[..., :5]), mask, "token_mean"))


@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum"])
def test_value_loss_matches_reference(clip, mode):
  rng, _, _, mask = random_batch(9, 7, 8)
  old = rng.normal(size=(7, 8)).astype(np.float32)
  values = (old + 0.4 * rng.normal(size=(7, 8))).astype(np.float32)
  returns = rng.normal(size=(7, 8)).astype(np.float32)
  loss, metrics = value_loss(values, old, returns, mask, clip=clip, agg=mode)
  want, want_metrics = ref_value(values, old, returns, mask, clip, mode)
  close(loss, want)
  for k in want_metrics:
    close(metrics[k], want_metrics[k])
  if clip is not None:
    assert 0.0 < float(metrics["vf_clip_frac"]) < 1.0  # both branches of the max occur
  _, const = value_loss(values, old, np.ones_like(returns), mask, clip=clip)
  assert float(const["explained_variance"]) == 0.0
  loss_empty, metrics_empty = value_loss(values, old, returns, np.zeros_like(mask), clip=clip, agg=mode)
  assert float(loss_empty) == 0.0 and all(np.isfinite(float(v)) for v in metrics_empty.values())


def test_sft_loss_matches_reference():
  _, logp, _, mask = random_batch(10, 5, 7)
  for mode in L.AGG_MODES:
    close(sft(logp, mask, mode), -ref_agg(logp, mask, mode))


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.1)])
def test_dpo_matches_reference(beta, ls):
  rng = np.random.default_rng(11)
  c, r, rc, rr = (rng.normal(-40.0, 5.0, size=13).astype(np.float32) for _ in range(4))
  loss, metrics = dpo(c, r, rc, rr, beta=beta, label_smoothing=ls)
  want, want_metrics = ref_dpo(c, r, rc, rr, beta, ls)
  close(loss, want)
  for k in want_metrics:
    close(metrics[k], want_metrics[k], atol=1e-5)
  assert 0.0 < float(metrics["reward_accuracy"]) < 1.0
  pair_mask = np.arange(13) < 9  # padding pairs are left out
  loss_m, _ = dpo(c, r, rc, rr, beta=beta, label_smoothing=ls, mask=pair_mask)
  close(loss_m, ref_dpo(c[:9], r[:9], rc[:9], rr[:9], beta, ls)[0])


def test_gradients_finite_and_jit_compatible():
  rng, logp, old, mask = random_batch(12, 4, 6)
  logp = logp.copy()
  logp[0, 0] = -80.0  # a collapsed token: ratio and k3 far out of range
  adv = rng.normal(size=(4, 6)).astype(np.float32)
  logits = rng.normal(size=(4, 6, 11)).astype(np.float32)
  old_v, returns = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(4, 6)).astype(np.float32)
  empty = np.zeros_like(mask)
  objectives = {
      "ppo_clip": lambda x, m: L.ppo_clip_loss(x, old, adv, m, clip_high=0.28, dual_clip=3.0)[0],
      "kl": lambda x, m: sum(L.kl_loss(x, old, m, kind=k) for k in L.KL_KINDS),
      "entropy": lambda x, m: L.entropy_loss(L.entropy_from_logits(logits * x[..., None]), m),
      "value": lambda x, m: L.value_loss(x, old_v, returns, m)[0],
      "sft": lambda x, m: L.sft_loss(x, m, "seq_mean_token_mean"),
      "dpo": lambda x, m: L.dpo_loss(x.sum(1), 0.5 * x.sum(1), old.sum(1), old.sum(1))[0],
  }
  assert set(objectives) == set(L.LOSSES)
  # One jitted program for all of them (one compile, reused for the empty mask).
  all_grads = jax.jit(lambda x, m: {name: jax.value_and_grad(fn)(x, m) for name, fn in objectives.items()})
  for m in (mask, empty):
    for name, (value, grad) in all_grads(jnp.asarray(logp), jnp.asarray(m)).items():
      assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad))), name
      assert np.any(np.asarray(grad) != 0.0) == (name == "dpo" or m is mask), name  # dpo pairs ignore the token mask
  close(all_grads(logp, mask)["ppo_clip"][0],
        ref_ppo(logp, old, adv, mask, 0.2, 0.28, 3.0, "token_mean")[0])
  # Advantages jit with traced hyperparameters; only group counts and switches are static.
  r, g, v = rng.random(9).astype(np.float32), np.arange(9) % 3, np.ones(9, bool)
  close(jax.jit(functools.partial(A.grpo_advantages, num_groups=3))(r, g, v), ref_grpo(r, g, v))
  gae_traced = jax.jit(lambda r, v, m, gamma, lam: gae(r, v, m, gamma=gamma, lam=lam))
  close(gae_traced(adv, old_v, mask, 0.95, 0.9)[0], ref_gae(adv, old_v, mask, 0.95, 0.9)[0])
  with pytest.raises(ValueError, match="seq_mean_token_mean"):
    L.aggregate(adv, mask, "sum")
  with pytest.raises(ValueError, match="'dpo'"):
    L.get_loss("ppo")
