"""A weak behaviour-cloned policy for tests of the RL loops: a one-layer Qwen2 with a BPE trained on the records'
policy text, a few SFT steps on their rows through the shared objective and jitted step, saved as an HF folder."""

from pathlib import Path

import jax

from dreamjax.envs.textworld_express import INVALID_FEEDBACK
from dreamjax.loop.policy_data import RowConfig, policy_texts, sft_rows
from dreamjax.models import init_params, save_hf_checkpoint, tiny
from dreamjax.rl.batch import sft_batch
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.text import train_bpe_tokenizer


def behaviour_clone(records, fmt, rollout, root: Path, steps: int = 25) -> tuple[Path, float]:
  """(the policy folder root/policy, the last SFT loss)."""
  tok = train_bpe_tokenizer(policy_texts(records, fmt) * 2 + [INVALID_FEEDBACK], root / "tok", vocab_size=500)
  model_cfg = tiny("qwen2", vocab_size=tok.vocab_size, num_layers=1, max_position_embeddings=512,
                   eos_token_id=tok.eos_ids[0])
  rows, _ = sft_rows(records, tok, fmt, RowConfig(), rollout)
  batch = sft_batch([r.ids for r in rows], [r.loss_mask for r in rows], pad_to=64)
  optimizer = make_optimizer(OptimConfig(lr=3e-3))
  step = make_train_step(model_cfg, make_objective("sft"), optimizer)
  state = create_train_state(model_cfg, init_params(model_cfg, jax.random.key(0)), optimizer)
  for i in range(steps):
    state, metrics = step(state, batch, jax.random.key(i))
  save_hf_checkpoint(jax.device_get(state.params), model_cfg, root / "policy", tokenizer_folder=root / "tok")
  return root / "policy", float(metrics["loss"])

