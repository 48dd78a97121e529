"""The ALFWorld testbed: pick_and_place_simple games (20 steps, answers restricted to the admissible commands), the
second family of issue 18's tables beside twc (configs/reproduce_twc.py; docs/testbeds.md).

Every stage is the testbed's standalone config, so the table's rows are the runs measured one by one:
- data: configs/collect_alfworld.py:headroom (600 hand-coded-expert episodes first, then 200 eps0.3 and 100 random,
  on the train floor plans; the hand-coded expert searches and acts on what it sees, 0.86 success);
- SFT: configs/train_policy_alfworld.py (3,000 steps; 0.220 greedy on the 200 held-out games);
- real-env GRPO: configs/grpo_real_alfworld.py (lr 1e-4; 40 iterations in 57 minutes gained +0.180 held out);
- M_exp: configs/train_exp_alfworld.py (twc's model and format on this collection);
- DreamGym: trains exactly as real-env GRPO does, in M_exp's episodes, with M_exp served as twc serves it (greedy,
  a malformed answer drawn again at temperature 1 up to 8 times);
- the common final evaluation: configs/eval_alfworld.py (the 200 held-out games of ALFRED's held-out floor plans,
  greedy and sampled).
Budgets keep the paper's ratios (SFT 1 : DPO 2 : real-env RL 4, S2R 1/16 of real-env RL), with SFT's cap at the
expert's 6,074 steps, which lead the file: real-env RL may spend 24,400 real transitions (about 24 of the GRPO
config's iterations), S2R 1,525. PPO rows take verl-agent's PPO (`as_ppo`) on the GRPO config's env, batches and
policy optimizer, with twc's critic (3e-3: verl's 1e-5 barely moves a tiny critic).

Run:  dreamjax reproduce --config configs/reproduce_alfworld_pp.py        (CPU, hours; resumes stage by stage)
Tiny: dreamjax reproduce --config configs/reproduce_alfworld_pp.py:tiny   (every stage at test size)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import Budgets, ReproduceConfig, at_test_size, on_env
from dreamjax.config import load_config
from dreamjax.loop.learner import as_ppo

HERE = Path(__file__).parent
SFT_CAP = 6100  # the expert's 600 episodes (6,074 steps) lead the collection; the next episode would cross it


def config() -> ReproduceConfig:
  twc = load_config(str(HERE / "reproduce_twc.py"))
  sft = load_config(str(HERE / "train_policy_alfworld.py"))
  real = load_config(str(HERE / "grpo_real_alfworld.py"))
  evaluation = load_config(str(HERE / "eval_alfworld.py"))
  r = sft.rollout
  cfg = on_env(dataclasses.replace(twc, out_dir="runs/reproduce/alfworld_pp"), env="alfworld",
               env_kwargs=sft.env_kwargs, agent=sft.agent,
               rollout=dict(max_turns=r.max_turns, max_action_tokens=r.max_action_tokens,
                            max_episode_tokens=r.max_episode_tokens, prompt_buckets=r.prompt_buckets,
                            constrain_actions=r.constrain_actions),
               train=real.train_tasks, held_out=evaluation.tasks)
  return dataclasses.replace(
      cfg,
      collect=load_config(f"{HERE / 'collect_alfworld.py'}:headroom"),
      sft=sft,
      real=real,
      ppo=as_ppo(real, critic=twc.ppo.critic),
      exp=dataclasses.replace(load_config(str(HERE / "train_exp_alfworld.py")), eval_every=0),
      dreamgym=dataclasses.replace(cfg.dreamgym, rl=dataclasses.replace(real, out_dir=cfg.dreamgym.rl.out_dir)),
      budgets=Budgets(sft=SFT_CAP, dpo=2 * SFT_CAP, real_rl=4 * SFT_CAP, s2r=4 * SFT_CAP // 16,
                      synthetic_rl=4 * SFT_CAP),
      eval=dataclasses.replace(evaluation, out_dir=cfg.eval.out_dir),
  )


def tiny() -> ReproduceConfig:
  """Every stage of `config()` at test size: it checks that the stages fit together, not what they measure."""
  cfg = at_test_size(config(), policies=("expert:8", "eps0.3:4", "random:4"), out_dir="runs/reproduce/alfworld_pp_tiny")
  # The envs in this process, as configs/grpo_real_alfworld.py:tiny: two tasks do not pay for starting a worker pool.
  return dataclasses.replace(cfg, real=dataclasses.replace(cfg.real, num_workers=0),
                             dreamgym=dataclasses.replace(cfg.dreamgym, rl=dataclasses.replace(cfg.dreamgym.rl,
                                                                                               num_workers=0)))
