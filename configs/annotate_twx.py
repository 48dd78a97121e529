"""Reasoning annotation (the R*_t of Eq. 5) of the TextWorld-Express offline trajectories, into an annotations JSONL
beside them (annotations.<annotator>.jsonl), which the experience model trains on.

Data:  dreamjax collect --config configs/collect_twx.py                      (runs/collect/twx)
Run:   dreamjax annotate --config configs/annotate_twx.py                    (rule-based; seconds)
Teacher (any OpenAI-compatible endpoint, e.g. a local vLLM server; key from $OPENAI_API_KEY when set, answers cached
under teacher_cache/ beside the output):
       dreamjax annotate --config configs/annotate_twx.py --set annotator=teacher \
         --set teacher.base_url=http://localhost:8000/v1 --set teacher.model=meta-llama/Llama-3.3-70B-Instruct \
         --set workers=8
Tiny (CPU, seconds): the tiny coin collection (dreamjax collect --config configs/collect_twx.py:tiny), then
       dreamjax annotate --config configs/annotate_twx.py:tiny
Resume: rerun the same command; episodes already in the output are skipped.
Use:   dreamjax train-exp --config configs/train_exp_twx.py --set annotations=runs/collect/twx/annotations.rules.jsonl
       (without annotations, train-exp runs the rule-based annotator on the fly).
"""

import dataclasses

from dreamjax.commands.annotate import AnnotateConfig


def config() -> AnnotateConfig:
  return AnnotateConfig(
      trajectories="runs/collect/twx/trajectories.jsonl",
      annotator="rules",
      step_limit=0,  # from the collector's collect_config.json beside the trajectories
  )


def tiny() -> AnnotateConfig:
  return dataclasses.replace(config(), trajectories="runs/collect/twx_coin_tiny/trajectories.jsonl")
