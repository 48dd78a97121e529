"""What every training loop shares (docs/architecture.md): the run config block (`config`), the RL loop with its
checkpoints, resume and hooks (`run`), the policy learner (`learner`), what DreamGym adds to it (`dreamgym`),
evaluation (`evaluate`), checkpoints (`checkpoint`), tracking and W&B (`track`), model load and save (`model`),
SFT/DPO rows (`policy_data`), figures (`plots`) and the run-folder lock (`lock`). Nothing is re-exported: import the
modules."""
