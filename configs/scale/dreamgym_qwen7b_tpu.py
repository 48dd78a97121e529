"""DreamGym (GRPO) on TextWorld-Express at the paper's scale: a Qwen2.5-7B-Instruct policy and a Llama-3.1-8B-Instruct
experience model, on a TPU v5p-32 slice (16 chips, 4 hosts, 95 GiB HBM per chip).

The policy side is configs/grpo_real_twx.py's (verl-agent's defaults, docs/paper_map.md, "RL": B = 16 tasks x G = 8,
lr 1e-6, low-variance KL 0.02, invalid-action penalty 0.1); the rest is configs/dreamgym_twx.py's. Set here: the
checkpoints, the mesh and the micro-batches that make it fit, M_exp's prompt widths (fixed, so the plan below is
exact), and the paper's reasoning agent: <think>...</think><action>...</action> answers within 512 tokens per turn.
Policy and M_exp have different tokenizers; each formats its own prompts, only text passes between them.

Before: offline data, its teacher annotations, the M_exp SFT and the policy SFT warm start, each on the same slice
(every command runs on all workers at once through tpu/tpu_run.sh; tpu/README.md), from HF folders copied to every
worker (CKPT):
       dreamjax collect --config configs/collect_twx.py
       dreamjax annotate --config configs/annotate_twx.py --set annotator=teacher \
         --set teacher.base_url=http://localhost:8000/v1 --set teacher.model=meta-llama/Llama-3.3-70B-Instruct
       dreamjax train-exp --config configs/train_exp_twx.py --set model.checkpoint=$CKPT/Llama-3.1-8B-Instruct \
         --set out_dir=runs/exp_sft/twx_llama8b --set mesh.fsdp=4 --set mesh.tensor=4 \
         --set micro_batches=8 \
         --set annotations=runs/collect/twx/annotations.teacher.jsonl --set require_teacher_annotations=true
         Memory per device of this step (what tools/memory_plan.py prints; tests/test_memory.py recomputes
         it from this command):
           python tools/memory_plan.py --config configs/train_exp_twx.py --accelerator v5p --arch exp=llama-3.1-8b \
             --set mesh.fsdp=4 --set mesh.tensor=4 --set micro_batches=8

           configs/train_exp_twx.py (ExpSftConfig)
           mesh data=1 fsdp=4 tensor=4 (16 devices)
           M_exp: 8.030B params, float32 weights, float32 compute, remat none
           component                                           GiB/device  live in
           M_exp params (train layout)                               1.87  all
           AdamW moments (2 x params dtype)                          3.74  step,eval_score,eval_decode,export
           gradients (f32 accumulator + one in dtype)                3.74  step
           activations (1 rows/device x 3072, per micro-batch)      11.92  step
           M_exp params for decoding (float32, Predictor's)          7.48  eval_score,eval_decode
           held-out scoring forward (16 rows x 3072)                 1.27  eval_score
           M_exp KV cache (16 rows x 6144 slots)                     1.50  eval_decode
           M_exp prefill (16 rows x 3072)                            1.27  eval_decode
           export: one block of a leaf gathered whole                0.38  export
           peak load                                                 1.87
           peak step                                                21.27
           peak eval_score                                          14.36
           peak eval_decode                                         15.86
           peak export                                               5.99
           fits in 95 GiB per device (22% at the peak)

       dreamjax train-policy --config configs/train_policy_twx.py --set model.checkpoint=$CKPT/Qwen2.5-7B-Instruct \
         --set out_dir=runs/policy_sft/twx_qwen7b --set mesh.fsdp=4 --set mesh.tensor=4 --set optim.lr=1e-5 \
         --set micro_batches=8 --set agent.think=true \
         --set rollout.max_action_tokens=512
         Memory per device of this step (what tools/memory_plan.py prints; tests/test_memory.py recomputes
         it from this command):
           python tools/memory_plan.py --config configs/train_policy_twx.py --accelerator v5p --arch policy=qwen2.5-7b \
             --set mesh.fsdp=4 --set mesh.tensor=4 --set micro_batches=8 --set agent.think=true \
             --set rollout.max_action_tokens=512

           configs/train_policy_twx.py (PolicySftConfig)
           mesh data=1 fsdp=4 tensor=4 (16 devices)
           policy: 7.616B params, float32 weights, float32 compute, remat none
           component                                           GiB/device  live in
           policy params (train layout)                              1.77  all
           AdamW moments (2 x params dtype)                          3.55  step,eval,export
           gradients (f32 accumulator + one in dtype)                3.55  step
           activations (1 rows/device x 2560, per micro-batch)       9.13  step
           policy params for sampling (float32)                      7.09  eval
           policy KV cache (16 rows x 2560 slots)                    0.27  eval
           policy prefill (16 rows x 2048)                           0.84  eval
           export: one block of a leaf gathered whole                0.37  export
           peak load                                                 1.77
           peak step                                                18.00
           peak eval                                                13.52
           peak export                                               5.70
           fits in 95 GiB per device (19% at the peak)

Run:   dreamjax dreamgym --config configs/scale/dreamgym_qwen7b_tpu.py
       tpu/tpu_run.sh dreamgym configs/scale/dreamgym_qwen7b_tpu.py           (from your workstation: every worker)
Tiny (CPU; the same pipeline at test size, see configs/dreamgym_twx.py):
       dreamjax dreamgym --config configs/scale/dreamgym_qwen7b_tpu.py:tiny

Reasoning: M_exp learns a teacher LLM's reasoning traces, as in the paper: require_teacher_annotations refuses
rule-based annotations, teacher fallbacks included (--set require_teacher_annotations=false overrides it). The warm
start learns the think layout (RowConfig.think="auto" writes a template rationale) with room for 512-token answers.

Why this layout: Qwen2.5-7B has 28 query heads and 4 KV heads, so the tensor axis can be at most 4 (a larger one
would leave the KV heads, and the KV cache, whole on every device); fsdp = 4 takes the rest of the 16 chips. M_exp
sits in the sampling layout (whole along fsdp) for the whole run and splits 4 ways. Attention runs in blocks of 512
queries (ModelConfig.attention_chunk), so the prefills' float32 scores stay [rows, heads, 512, prompt] per layer;
95 GiB leave room for two rows per device per micro-batch in the update. The policy computes in bfloat16
(model.dtype) over float32 weights, which AdamW needs: its steps of lr ~1e-6 would round away in bfloat16 weights.
M_exp, frozen, holds bfloat16 weights (exp_dtype).

Memory per device (estimates; dreamjax/plan/memory.py says what each line counts), recomputed by
tests/test_memory.py from this command:
  python tools/memory_plan.py --config configs/scale/dreamgym_qwen7b_tpu.py --accelerator v5p \
    --arch policy=qwen2.5-7b --arch exp=llama-3.1-8b

  configs/scale/dreamgym_qwen7b_tpu.py (DreamGymConfig)
  mesh data=1 fsdp=4 tensor=4 (16 devices)
  policy: 7.616B params, float32 weights, bfloat16 compute, remat none
  M_exp: 8.030B params, bfloat16 weights, bfloat16 compute, remat none
  component                                           GiB/device  live in
  policy params (train layout)                              1.77  all
  AdamW moments (2 x params dtype)                          3.55  all
  reference params (train layout, bfloat16)                 0.89  all
  M_exp params (sampling layout)                            3.74  all
  policy params for sampling (bfloat16)                     3.55  rollout,exp_step
  policy KV cache (128 rows x 2560 slots)                   1.09  rollout,exp_step
  policy prefill (128 rows x 2048)                          4.66  rollout
  scoring forward (32 rows x 2560)                          1.89  score
  gradients (f32 accumulator + one in dtype)                3.55  update
  activations (2 rows/device x 2560, per micro-batch)       9.23  update
  export: one block of a leaf gathered whole                0.37  export
  M_exp KV cache (128 rows x 3584 slots)                    3.50  rollout,exp_step
  M_exp prefill (128 rows x 3072)                           7.31  exp_step
  M_task KV cache (8 rows x 4352 slots)                     0.27  task_gen
  M_task prefill (8 rows x 4096)                            0.61  task_gen
  peak rollout                                             22.75
  peak exp_step                                            25.40
  peak score                                               11.84
  peak update                                              22.73
  peak task_gen                                            10.82
  peak export                                              10.32
  fits in 95 GiB per device (27% at the peak)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.dreamgym import DreamGymConfig
from dreamjax.config import load_config
from dreamjax.loop.model import ModelSource
from dreamjax.parallel import MeshConfig

_BASE = str(Path(__file__).parent.parent / "dreamgym_twx.py")
# The paper's agents reason before they act, answering <think>...</think><action>...</action> within a 512-token
# response budget per turn (docs/paper_map.md, "Agent prompt" and "RL": verl-agent's response length).
RESPONSE_TOKENS = 512


def config() -> DreamGymConfig:
  base = load_config(_BASE)
  rl = dataclasses.replace(
      base.rl,
      model=ModelSource(checkpoint="runs/policy_sft/twx_qwen7b/checkpoint", dtype="bfloat16"),
      mesh=MeshConfig(data=1, fsdp=4, tensor=4),
      micro_batches=32,  # 256 rows per step over data x fsdp = 4: two rows per device per micro-batch
      score_batch=32,
      agent=dataclasses.replace(base.rl.agent, think=True),
      # An episode ends on the turn limit, as in verl-agent, not on a total of sampled tokens.
      rollout=dataclasses.replace(base.rl.rollout, max_action_tokens=RESPONSE_TOKENS,
                                  max_episode_tokens=base.rl.rollout.max_turns * RESPONSE_TOKENS),
  )
  return dataclasses.replace(
      base,
      rl=rl,
      exp_model="runs/exp_sft/twx_llama8b/checkpoint",
      exp_dtype="bfloat16",  # frozen: bfloat16 weights halve M_exp's share
      exp_prompt_buckets=(1024, 2048, 3072),  # up to configs/train_exp_twx.py's max_len
      exp_max_new_tokens=512,
      # M_exp must have learnt its reasoning from a teacher LLM's traces (the paper's), not from the rule-based
      # annotator: the train-exp command above sets ExpSftConfig.require_teacher_annotations.
      out_dir="runs/dreamgym/grpo_twx_qwen7b_tpu",
  )


def tiny() -> DreamGymConfig:
  """configs/dreamgym_twx.py:tiny (a tiny policy and M_exp, one CPU device) writing to its own folder."""
  return dataclasses.replace(load_config(f"{_BASE}:tiny"), out_dir="runs/dreamgym/scale_qwen7b_tpu_tiny")
