"""DreamGym (GRPO) on TextWorld-Express at the paper's scale: a Llama-3.1-8B-Instruct policy and a Llama-3.1-8B-Instruct
experience model, on two 8xH100 hosts (16 GPUs, 80 GB each), one JAX process per host.

The policy side is configs/grpo_real_twx.py's (verl-agent's defaults, docs/paper_map.md, "RL": B = 16 tasks x G = 8,
lr 1e-6, low-variance KL 0.02, invalid-action penalty 0.1); the rest is configs/dreamgym_twx.py's. Set here: the
checkpoints, the mesh and the micro-batches that make it fit, M_exp's prompt widths (fixed, so the plan below is
exact), and the paper's reasoning agent: <think>...</think><action>...</action> answers within 512 tokens per turn.

Before: offline data, its teacher annotations, the M_exp SFT and the policy SFT warm start, each on the same hosts
(every command runs as one process per host through tpu/gpu_slurm.sbatch or tpu/gpu_ssh_run.sh; tpu/README.md), from
HF folders on every host:
       dreamjax collect --config configs/collect_twx.py
       dreamjax annotate --config configs/annotate_twx.py --set annotator=teacher \
         --set teacher.base_url=http://localhost:8000/v1 --set teacher.model=meta-llama/Llama-3.3-70B-Instruct
       dreamjax train-exp --config configs/train_exp_twx.py --set model.checkpoint=$CKPT/Llama-3.1-8B-Instruct \
         --set out_dir=runs/exp_sft/twx_llama8b --set mesh.fsdp=2 --set mesh.tensor=8 \
         --set micro_batches=16 \
         --set annotations=runs/collect/twx/annotations.teacher.jsonl --set require_teacher_annotations=true
         Memory per device of this step (what tools/memory_plan.py prints; tests/test_memory.py recomputes
         it from this command):
           python tools/memory_plan.py --config configs/train_exp_twx.py --accelerator h100 --arch exp=llama-3.1-8b \
             --set mesh.fsdp=2 --set mesh.tensor=8 --set micro_batches=16

           configs/train_exp_twx.py (ExpSftConfig)
           mesh data=1 fsdp=2 tensor=8 (16 devices)
           M_exp: 8.030B params, float32 weights, float32 compute, remat none
           component                                           GiB/device  live in
           M_exp params (train layout)                               1.87  all
           AdamW moments (2 x params dtype)                          3.74  step,eval_score,eval_decode,export
           gradients (f32 accumulator + one in dtype)                3.74  step
           activations (1 rows/device x 3072, per micro-batch)       9.15  step
           M_exp params for decoding (float32, Predictor's)          3.74  eval_score,eval_decode
           held-out scoring forward (16 rows x 3072)                 1.83  eval_score
           M_exp KV cache (16 rows x 6144 slots)                     1.50  eval_decode
           M_exp prefill (16 rows x 3072)                            1.83  eval_decode
           export: one block of a leaf gathered whole                0.38  export
           peak load                                                 1.87
           peak step                                                18.51
           peak eval_score                                          11.18
           peak eval_decode                                         12.68
           peak export                                               5.99
           fits in 72 GiB per device (26% at the peak)

       dreamjax train-policy --config configs/train_policy_twx.py --set model.checkpoint=$CKPT/Llama-3.1-8B-Instruct \
         --set out_dir=runs/policy_sft/twx_llama8b --set mesh.fsdp=2 --set mesh.tensor=8 --set optim.lr=1e-5 \
         --set micro_batches=16 --set agent.think=true \
         --set rollout.max_action_tokens=512
         Memory per device of this step (what tools/memory_plan.py prints; tests/test_memory.py recomputes
         it from this command):
           python tools/memory_plan.py --config configs/train_policy_twx.py --accelerator h100 \
             --arch policy=llama-3.1-8b --set mesh.fsdp=2 --set mesh.tensor=8 --set micro_batches=16 \
             --set agent.think=true --set rollout.max_action_tokens=512

           configs/train_policy_twx.py (PolicySftConfig)
           mesh data=1 fsdp=2 tensor=8 (16 devices)
           policy: 8.030B params, float32 weights, float32 compute, remat none
           component                                           GiB/device  live in
           policy params (train layout)                              1.87  all
           AdamW moments (2 x params dtype)                          3.74  step,eval,export
           gradients (f32 accumulator + one in dtype)                3.74  step
           activations (1 rows/device x 2560, per micro-batch)       7.67  step
           policy params for sampling (float32)                      3.74  eval
           policy KV cache (16 rows x 2560 slots)                    0.62  eval
           policy prefill (16 rows x 2048)                           1.22  eval
           export: one block of a leaf gathered whole                0.38  export
           peak load                                                 1.87
           peak step                                                17.03
           peak eval                                                11.20
           peak export                                               5.99
           fits in 72 GiB per device (24% at the peak)

Run:   dreamjax dreamgym --config configs/scale/dreamgym_llama8b_gpu.py
       sbatch tpu/gpu_slurm.sbatch dreamgym configs/scale/dreamgym_llama8b_gpu.py       (SLURM: 2 nodes, a task each)
Tiny (CPU; the same pipeline at test size, see configs/dreamgym_twx.py):
       dreamjax dreamgym --config configs/scale/dreamgym_llama8b_gpu.py:tiny

Reasoning: M_exp learns a teacher LLM's reasoning traces, as in the paper: require_teacher_annotations refuses
rule-based annotations, teacher fallbacks included (--set require_teacher_annotations=false overrides it). The warm
start learns the think layout (RowConfig.think="auto" writes a template rationale) with room for 512-token answers.

Why this layout: the mesh is laid over the processes in order, so tensor = 8 is one host's 8 GPUs on NVLink and
fsdp = 2 spans the two hosts (weights are all-gathered across hosts once per layer and step, not per token). 8
divides every head count (32 query heads, 8 KV heads), and M_exp, which sits in the sampling layout (whole along
fsdp) for the whole run, splits 8 ways. Attention runs in blocks of 512 queries (ModelConfig.attention_chunk), so
the prefills' float32 scores stay [rows, heads, 512, prompt] per layer; with the update at two rows per device per
micro-batch the peak is M_exp's turn. The policy computes in bfloat16 (model.dtype) over float32 weights, which
AdamW needs: its steps of lr ~1e-6 would round away in bfloat16 weights. M_exp, frozen, holds bfloat16 weights
(exp_dtype). "h100" below is 90% of 80 GB, the share tpu/gpu_*.sh give XLA (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9).

Memory per device (estimates; dreamjax/plan/memory.py says what each line counts), recomputed by
tests/test_memory.py from this command:
  python tools/memory_plan.py --config configs/scale/dreamgym_llama8b_gpu.py --accelerator h100 \
    --arch policy=llama-3.1-8b --arch exp=llama-3.1-8b

  configs/scale/dreamgym_llama8b_gpu.py (DreamGymConfig)
  mesh data=1 fsdp=2 tensor=8 (16 devices)
  policy: 8.030B params, float32 weights, bfloat16 compute, remat none
  M_exp: 8.030B params, bfloat16 weights, bfloat16 compute, remat none
  component                                           GiB/device  live in
  policy params (train layout)                              1.87  all
  AdamW moments (2 x params dtype)                          3.74  all
  reference params (train layout, bfloat16)                 0.94  all
  M_exp params (sampling layout)                            1.87  all
  policy params for sampling (bfloat16)                     1.87  rollout,exp_step
  policy KV cache (128 rows x 2560 slots)                   2.50  rollout,exp_step
  policy prefill (128 rows x 2048)                          6.38  rollout
  scoring forward (32 rows x 2560)                          2.20  score
  gradients (f32 accumulator + one in dtype)                3.74  update
  activations (2 rows/device x 2560, per micro-batch)       7.73  update
  export: one block of a leaf gathered whole                0.38  export
  M_exp KV cache (128 rows x 3584 slots)                    3.50  rollout,exp_step
  M_exp prefill (128 rows x 3072)                           9.56  exp_step
  M_task KV cache (8 rows x 4352 slots)                     0.27  task_gen
  M_task prefill (8 rows x 4096)                            0.80  task_gen
  peak rollout                                             22.66
  peak exp_step                                            25.85
  peak score                                               10.61
  peak update                                              19.89
  peak task_gen                                             9.48
  peak export                                               8.79
  fits in 72 GiB per device (36% at the peak)
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
      model=ModelSource(checkpoint="runs/policy_sft/twx_llama8b/checkpoint", dtype="bfloat16"),
      mesh=MeshConfig(data=1, fsdp=2, tensor=8),
      micro_batches=64,  # 256 rows per step over data x fsdp = 2: two rows per device per micro-batch
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
      out_dir="runs/dreamgym/grpo_twx_llama8b_gpu",
  )


def tiny() -> DreamGymConfig:
  """configs/dreamgym_twx.py:tiny (a tiny policy and M_exp, one CPU device) writing to its own folder."""
  return dataclasses.replace(load_config(f"{_BASE}:tiny"), out_dir="runs/dreamgym/scale_llama8b_gpu_tiny")
