"""The experience model M_exp: prompt and target format with a total parser (`format`), reasoning annotation by rules
or a teacher LLM (`annotate`, `annotate_rules`, `teacher`), SFT data for Eq. 5 (`sft_data`), a trained model on disk
(`exp_model`), M_exp behind the batched env protocol (`synthetic_env`) and fidelity metrics (`fidelity`). Nothing is
re-exported: import the modules."""
