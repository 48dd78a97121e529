"""GRPO against the real TextWorld-Express games (the paper's "GRPO, real env" baseline) with a Llama-3.1-8B-Instruct
policy, on one 8xH100 host (8 GPUs, 80 GB each): configs/grpo_real_twx.py with a checkpoint, a mesh and the paper's
reasoning agent (<think>...</think><action>...</action> answers within 512 tokens per turn), as the DreamGym scale
configs use.

Before: offline data and the policy SFT warm start on the same host (tpu/README.md, "multi-GPU"):
       dreamjax collect --config configs/collect_twx.py
       dreamjax train-policy --config configs/train_policy_twx.py --set model.checkpoint=$CKPT/Llama-3.1-8B-Instruct \
         --set out_dir=runs/policy_sft/twx_llama8b --set mesh.fsdp=1 --set mesh.tensor=8 --set optim.lr=1e-5 \
         --set micro_batches=32 --set agent.think=true \
         --set rollout.max_action_tokens=512
         Memory per device of this step (what tools/memory_plan.py prints; tests/test_memory.py recomputes
         it from this command):
           python tools/memory_plan.py --config configs/train_policy_twx.py --accelerator h100 \
             --arch policy=llama-3.1-8b --set mesh.fsdp=1 --set mesh.tensor=8 --set micro_batches=32 \
             --set agent.think=true --set rollout.max_action_tokens=512

           configs/train_policy_twx.py (PolicySftConfig)
           mesh data=1 fsdp=1 tensor=8 (8 devices)
           policy: 8.030B params, float32 weights, float32 compute, remat none
           component                                           GiB/device  live in
           policy params (train layout)                              3.74  all
           AdamW moments (2 x params dtype)                          7.48  step,eval,export
           gradients (f32 accumulator + one in dtype)                7.48  step
           activations (1 rows/device x 2560, per micro-batch)       7.53  step
           policy params for sampling (float32)                      0.00  eval
           policy KV cache (16 rows x 2560 slots)                    1.25  eval
           policy prefill (16 rows x 2048)                           2.44  eval
           export: one block of a leaf gathered whole                0.38  export
           peak load                                                 3.74
           peak step                                                26.23
           peak eval                                                14.91
           peak export                                              11.60
           fits in 72 GiB per device (36% at the peak)

Run:   dreamjax rl --config configs/scale/grpo_real_llama8b_gpu.py
S2R (DreamGym-S2R, docs/paper_map.md): the same from DreamGym's final policy with a 5K real-transition budget,
       --set model.checkpoint=runs/dreamgym/grpo_twx_llama8b_gpu/final --set max_real_transitions=5000
Tiny (CPU; see configs/grpo_real_twx.py):
       dreamjax rl --config configs/scale/grpo_real_llama8b_gpu.py:tiny

Why this layout: one process drives all 8 GPUs; tensor = 8 (NVLink) divides the 32 query and 8 KV heads, and with
fsdp = 1 the training and sampling layouts coincide, so the sampler's copy of the weights is only their bfloat16
cast (half the bytes per decoded token; the frozen reference is kept in bfloat16 too). Every device then holds all
128 rollout rows, whose prefill (float32 scores in blocks of 512 queries) is the rollout's largest temporary; the
update runs two rows per micro-batch. The policy computes in bfloat16 (model.dtype) over float32 weights, which AdamW
needs: its steps of lr ~1e-6 would round away in bfloat16 weights. "h100" below is 90% of 80 GB, the share
tpu/gpu_*.sh give XLA.

Memory per device (estimates; dreamjax/plan/memory.py says what each line counts), recomputed by
tests/test_memory.py from this command:
  python tools/memory_plan.py --config configs/scale/grpo_real_llama8b_gpu.py --accelerator h100 \
    --arch policy=llama-3.1-8b

  configs/scale/grpo_real_llama8b_gpu.py (RLConfig)
  mesh data=1 fsdp=1 tensor=8 (8 devices)
  policy: 8.030B params, float32 weights, bfloat16 compute, remat none
  component                                           GiB/device  live in
  policy params (train layout)                              3.74  all
  AdamW moments (2 x params dtype)                          7.48  all
  reference params (train layout, bfloat16)                 1.87  all
  policy params for sampling (bfloat16)                     1.87  rollout
  policy KV cache (128 rows x 2560 slots)                   5.00  rollout
  policy prefill (128 rows x 2048)                         12.75  rollout
  scoring forward (32 rows x 2560)                          3.98  score
  gradients (f32 accumulator + one in dtype)                7.48  update
  activations (2 rows/device x 2560, per micro-batch)       7.59  update
  export: one block of a leaf gathered whole                0.38  export
  peak rollout                                             32.71
  peak score                                               17.08
  peak update                                              28.16
  peak export                                              13.47
  fits in 72 GiB per device (45% at the peak)
"""

import dataclasses
from pathlib import Path

from dreamjax.config import load_config
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.model import ModelSource
from dreamjax.parallel import MeshConfig

_BASE = str(Path(__file__).parent.parent / "grpo_real_twx.py")
# The paper's agents reason before they act, answering <think>...</think><action>...</action> within a 512-token
# response budget per turn (docs/paper_map.md, "Agent prompt" and "RL": verl-agent's response length).
RESPONSE_TOKENS = 512


def config() -> RLConfig:
  base = load_config(_BASE)
  return dataclasses.replace(
      base,
      model=ModelSource(checkpoint="runs/policy_sft/twx_llama8b/checkpoint", dtype="bfloat16"),
      mesh=MeshConfig(data=1, fsdp=1, tensor=8),
      micro_batches=128,  # 256 rows per step, not split over devices (data x fsdp = 1): two rows per micro-batch
      score_batch=32,
      agent=dataclasses.replace(base.agent, think=True),  # the same agent as the DreamGym scale configs
      # An episode ends on the turn limit, as in verl-agent, not on a total of sampled tokens.
      rollout=dataclasses.replace(base.rollout, max_action_tokens=RESPONSE_TOKENS,
                                  max_episode_tokens=base.rollout.max_turns * RESPONSE_TOKENS),
      out_dir="runs/rl_real/grpo_twx_llama8b_gpu",
  )


def tiny() -> RLConfig:
  """configs/grpo_real_twx.py:tiny (a tiny policy, one CPU device) writing to its own folder."""
  return dataclasses.replace(load_config(f"{_BASE}:tiny"), out_dir="runs/rl_real/scale_llama8b_gpu_tiny")
