"""How often a policy's restricted greedy choice is the demonstrated action, teacher-forced on an SFT config's rows,
split by the action's verb and by turn.

A restricted policy (`RolloutConfig.constrain_actions`) decodes each answer token by token among the tokens some
admissible action allows there. With the demonstration's own earlier tokens fed in, the policy would decode the
demonstrated action greedily exactly when, at every token that had a choice, the allowed token it scores highest is
the demonstration's. That is what this counts, per row, on the rows `dreamjax train-policy` trains on (same config,
same filters). It tells a policy that cannot act on the task (a verb it never chooses where the expert does) from one
whose episodes fail for other reasons, without running an env: about a minute for 60 ALFWorld episodes on 2 cores.

Run: `python experiments/choice_accuracy.py configs/train_policy_alfworld.py runs/headroom/alfworld_sft/checkpoint`
(`--set KEY=VALUE` changes the config as on the command line, `--episodes N` the number of demonstrations scored,
`--out F.json` keeps the numbers).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from dreamjax.config import load_config  # noqa: E402
from dreamjax.data.records import read_trajectory_files  # noqa: E402
from dreamjax.loop.model import load_model  # noqa: E402
from dreamjax.loop.policy_data import TurnRow, sft_rows  # noqa: E402
from dreamjax.models.transformer import Transformer  # noqa: E402
from dreamjax.rollout.engine import allowed_tokens, answer_ids, pack_choices  # noqa: E402


def verb(action: str) -> str:
  """The action's kind: its first word, or its first two where the first is a preposition-taking verb ("go to")."""
  words = action.split()
  return " ".join(words[:2]) if len(words) > 1 and words[1] in ("to", "on", "in") else (words[0] if words else "")


def chosen_as_demonstrated(logits: np.ndarray, row: TurnRow, choices: np.ndarray) -> bool:
  """Whether restricted greedy decoding, fed the demonstration's tokens, picks the demonstration's token wherever the
  choices allowed more than one. `logits` [T, V] are the row's, position t predicting token t + 1."""
  answer = row.answer_ids
  for j, allowed in enumerate(allowed_tokens(choices, answer)):
    if len(allowed) > 1 and allowed[np.argmax(logits[row.prompt_len - 1 + j, allowed])] != answer[j]:
      return False
  return True


def _rate(ok: int, n: int) -> dict[str, Any]:
  return {"chosen": ok, "rows": n, "rate": round(ok / n, 4) if n else None}


def measure(cfg: Any, checkpoint: str, episodes: int, seed: int = 0, last_turn: int = 10) -> dict[str, Any]:
  if not cfg.rollout.constrain_actions:
    raise SystemExit("choice_accuracy: the config's rollout.constrain_actions is off, so the policy's answers are not "
                     "restricted to admissible actions and there is no choice to score")
  model_cfg, params, tokenizer = load_model(checkpoint)
  records = list(read_trajectory_files(cfg.data, "data"))
  random.Random(seed).shuffle(records)
  model = Transformer(model_cfg)
  width = cfg.rollout.prompt_buckets[-1] + cfg.rollout.max_action_tokens  # one compiled shape for every row
  forward = jax.jit(lambda p, t, pos, v: model.apply({"params": p}, t, pos, v).logits[0])
  by_verb, by_turn = collections.Counter(), collections.Counter()
  ok_verb, ok_turn = collections.Counter(), collections.Counter()
  used = 0
  for record in records:
    rows, _ = sft_rows([record], tokenizer, cfg.agent, cfg.rows, cfg.rollout)
    if not rows:
      continue
    used += 1
    for row in rows:
      step = record.steps[row.turn]
      if not step.admissible:
        continue
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(row.ids)] = row.ids
      valid = np.arange(width)[None] < len(row.ids)
      logits = np.asarray(forward(params, tokens, np.arange(width, dtype=np.int32)[None], valid))
      good = chosen_as_demonstrated(
          logits, row, pack_choices({0: [answer_ids(tokenizer, a) for a in step.admissible]}, 1,
                                    cfg.rollout.max_action_tokens)[0])
      kind, turn = verb(step.action), min(row.turn, last_turn)
      by_verb[kind] += 1
      ok_verb[kind] += good
      by_turn[turn] += 1
      ok_turn[turn] += good
    if used == episodes:
      break
  return {"checkpoint": checkpoint, "episodes": used,
          "all": _rate(sum(ok_verb.values()), sum(by_verb.values())),
          "by_verb": {k: _rate(ok_verb[k], by_verb[k]) for k in sorted(by_verb)},
          # the last bucket holds every turn from `last_turn` on
          "by_turn": {str(t): _rate(ok_turn[t], by_turn[t]) for t in sorted(by_turn)}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("config", help="an SFT config (dreamjax train-policy's), with :variant if any")
  p.add_argument("checkpoint", help="the policy's HF folder, e.g. <out_dir>/checkpoint")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  p.add_argument("--episodes", type=int, default=60, help="demonstrations scored (shuffled with --seed)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="write the numbers here as JSON")
  args = p.parse_args(argv)
  result = measure(load_config(args.config, args.set), args.checkpoint, args.episodes, args.seed)
  print(f"{result['episodes']} episodes: {result['all']['chosen']}/{result['all']['rows']} rows chosen as "
        f"demonstrated ({result['all']['rate']})")
  for name in ("by_verb", "by_turn"):
    for key, r in result[name].items():
      print(f"  {name[3:]} {key:10s} {r['chosen']:5d}/{r['rows']:<5d} {r['rate']}")
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
