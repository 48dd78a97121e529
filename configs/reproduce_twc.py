"""The twc testbed: TextWorld-Express Commonsense games (one room, two items to put away, 8 steps), a second family
beside coin11 where the agent's mistakes show in what it observes (docs/testbeds.md).

Why these games: every item and container is in the observation and an item's place follows from its name, so TWX's
gold-path expert acts on nothing the agent cannot see; its demonstrations can be learned from the prompt. Random play
over the admissible actions succeeds 0.035 [0.017, 0.070] and the gold path 1.00 on held-out games
(experiments/headroom_twx.py --maps twc).

Answers are restricted to the admissible actions (`RolloutConfig.constrain_actions`) in every stage: free answers
from the tiny policy were 44-66% inadmissible, which measured its spelling of item names more than its choices. With
restriction this config's SFT policy (400 steps) scores 0.530 greedy and 0.460 sampled on the held-out games, and
real-env GRPO from it with the settings below, run for 50 iterations, gained +0.285, +0.285 and +0.300 greedy on
seeds 0-2 in 51-57 minutes each (experiments/RESULTS.md, nineteenth stop). M_exp writes each next state as its
changed lines (configs/train_exp_twc.py).

Held out = unseen games of the train fold (tasks 600-799). TWX's dev games use item names no train game has (none of
89 dev items is among the 185 of the train games), which a policy trained from scratch cannot read: it scores 0.00
there. The collection and RL draw from tasks 0-599 only.

Run:  dreamjax reproduce --config configs/reproduce_twc.py        (CPU, hours; writes <out_dir>/results.md, .json, .svg,
      data_efficiency.svg)
Tiny: dreamjax reproduce --config configs/reproduce_twc.py:tiny   (every stage at test size; 47 min on one shared core)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import Budgets, ReproduceConfig, at_test_size, on_env
from dreamjax.config import load_config
from dreamjax.loop.learner import TaskSpec, as_ppo
from dreamjax.loop.policy_data import PairConfig, RowConfig
from dreamjax.rl.critic import CriticConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.sampling import SpeculativeConfig

HERE = Path(__file__).parent
TWC = "numLocations=1, numItemsToPutAway=2, includeDoors=0"
STEP_LIMIT = 8  # the gold path needs 5.7 steps on average
EXPERTS = ("expert",)
HELD_OUT_START = 600  # the first train-fold task no collector and no RL run draws


def config() -> ReproduceConfig:
  base = load_config(f"{HERE / 'reproduce_twx.py'}:tiny")
  cfg = on_env(dataclasses.replace(base, out_dir="runs/reproduce/twc"), env="textworld_express",
               env_kwargs=(f"step_limit={STEP_LIMIT}",),
               agent=AgentFormat(think=False, history_turns=2, history_token_budget=256),
               # The admissible list of a room with a dozen containers takes most of the 768 tokens.
               # 24 answer tokens: 5% of twc's actions take 17-19, and a restricted answer cut short always fails.
               rollout=dict(max_turns=STEP_LIMIT, max_action_tokens=24, max_episode_tokens=192, prompt_buckets=(768,),
                            constrain_actions=True),
               train=TaskSpec(games=("twc",), split="train", count=HELD_OUT_START, game_params=TWC),
               held_out=TaskSpec(games=("twc",), split="train", start=HELD_OUT_START, count=200, game_params=TWC))
  # configs/grpo_real_twc.py's settings: 16 tasks x 8 episodes (about 900 turn rows), one pass, the update in four
  # micro-batches of similar row length (rows cut to multiples of 128), lr 3e-4.
  real = dataclasses.replace(cfg.real, iterations=30, eval_every=5, eval_sampled=False, pad_to=128,
                             length_buckets=True, epochs=1,
                             tasks_per_iteration=16, micro_batches=4, episode_weights=True,
                             optim=OptimConfig(lr=3e-4, clip_norm=1.0),
                             eval_tasks=dataclasses.replace(cfg.real.eval_tasks, count=50))
  return dataclasses.replace(
      cfg,
      # The gold path first: SFT's budget reads the first 4000 transitions of the file, in this order, and so takes
      # all 600 of its episodes (3407 steps).
      # stale0.3: random play that now and then repeats an action an earlier state offered, which the game refuses.
      # The other collectors act from the current list only, so without it M_exp never sees a refused action and
      # accepts every one a policy takes in its episodes (15% of them, experiments/RESULTS.md, fourteenth stop).
      collect=dataclasses.replace(cfg.collect, policies=("expert:600", "eps0.3:300", "random:200", "stale0.3:300"),
                                  max_steps=STEP_LIMIT),
      # 400 steps: with restricted answers it scores 0.60 greedy, inside the 0.20-0.50 band sampled (0.38), and leaves
      # RL room; at 800 steps it scores 0.765 greedy and 0.675 sampled.
      sft=dataclasses.replace(
          cfg.sft, rows=RowConfig(experts=EXPERTS, step_sources=EXPERTS), max_steps=400,
          optim=dataclasses.replace(cfg.sft.optim, warmup_steps=20, total_steps=400),
          eval=dataclasses.replace(cfg.sft.eval, num_tasks=50, every_steps=400, train_tasks=0)),
      dpo=dataclasses.replace(cfg.dpo, pairs=PairConfig(chosen_policies=EXPERTS, rejected_policies=("random", "eps0.3"),
                                                        max_pairs_per_task=2)),
      # configs/train_exp_twc.py (reasoning on, next states as their changed lines), without its periodic checks.
      exp=dataclasses.replace(load_config(f"{HERE / 'train_exp_twc.py'}"), eval_every=0),
      real=real,
      # PPO rows: verl-agent's PPO (`as_ppo`) on the GRPO settings above, so the two rows differ only by the algorithm,
      # with the critic at 3e-3 as in the tiny PPO runs (configs/ppo_real_twx.py:tiny; verl's 1e-5 barely moves a
      # tiny critic). Until the forty-first stop this was left to the twx base's tiny coin PPO (policy lr 1e-3, two
      # epochs), which the thirty-sixth stop's PPO row ran.
      ppo=as_ppo(real, critic=CriticConfig(optim=OptimConfig(lr=3e-3, clip_norm=1.0, weight_decay=0.01),
                                           value_clip=0.5)),
      # DreamGym trains exactly as real-env RL does, in M_exp's episodes. twc is deterministic, so M_exp answers
      # greedy and only a malformed answer is drawn again, at temperature 1, up to 8 times: on the held-out
      # transitions 0.901 exact against 0.845 for sampled answers with 2 resamples (the default), at 0.94x its
      # transitions/s (experiments/RESULTS.md, twenty-second stop).
      # M_exp decodes plainly: its reasoning is not in the prompt, so copy-speculative drafts gave 1.36 tokens a
      # forward on the policy's episodes, and a 128-row rollout took 132 s with 4 draft tokens against 85 s without
      # (experiments/bench/multiturn_rollout.py, experiments/RESULTS.md, forty-fifth stop).
      # A DreamGym iteration takes several times real-env GRPO's, so its rows checkpoint every 2 iterations rather
      # than 10.
      dreamgym=dataclasses.replace(cfg.dreamgym, reasoning=True, exp_temperature=0.0, exp_retry_temperature=1.0,
                                   exp_retries=8, exp_speculative=SpeculativeConfig(draft_tokens=0),
                                   rl=dataclasses.replace(real, out_dir=cfg.dreamgym.rl.out_dir, checkpoint_every=2)),
      # w/o task generation last: on twc it can hardly differ from the full row. Every twc task has the same
      # instruction (the items to put away are in the state), and in the first four DreamGym rows M_task wrote
      # no parseable variant (0 of 94 candidates; experiments/RESULTS.md, forty-seventh stop).
      ablations=("no_replay", "no_reasoning", "no_curriculum", "no_task_generation"),
      # DreamGym spends as many synthetic transitions as real-env RL spends real ones (about 19 of the 30
      # iterations): the same experience in the same number of updates. Until the forty-second stop it ran all 30.
      budgets=Budgets(sft=4000, dpo=8000, real_rl=16000, s2r=1000, synthetic_rl=16000),
      eval=dataclasses.replace(cfg.eval, batch=40, sampled=True),
  )


def tiny() -> ReproduceConfig:
  """Every stage of `config()` at test size: it checks that the testbed's stages fit together, not what they
  measure."""
  return at_test_size(config(), policies=("expert:16", "eps0.3:8", "random:8", "stale0.3:8"),
                      out_dir="runs/reproduce/twc_tiny")
