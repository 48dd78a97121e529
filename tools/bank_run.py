"""Banks a run folder (its results, and the models its later stages start from) small enough to commit, and restores
it, so that a job longer than a machine's life goes on where it stopped on the next machine.

  python tools/bank_run.py save runs/reproduce/twc experiments/banks/twc [--unfinished]
  python tools/bank_run.py restore experiments/banks/twc runs/reproduce/twc
  dreamjax reproduce --config configs/reproduce_twc.py        # reuses every stage the bank finished

`dreamjax reproduce` reuses a stage whose summary.json (eval.json for an evaluation) exists, and of a finished stage it
reads nothing but its small files and the final model a later stage starts from. So a bank holds:
- every file of the run folder but the ones below, files over 256 KiB xz-compressed (the collected trajectories:
  8.7 MB, 0.2 MB compressed);
- the final model (summary.json's "checkpoint") of each finished stage a later stage starts from (KEEP_MODELS: the SFT
  policy, M_exp, the DreamGym policies S2R continues), not those of the rows whose evaluation is all that is left,
  nor a finished stage's initial model, but for M_exp's: the DreamGym rows embed its replay retrieval with that
  model's backbone (exp_model.json's "encoder_folder");
- with --unfinished, each unfinished stage's files, its newest committed checkpoint step and its initial model among
  them, so the stage resumes from there; without it an unfinished stage is left out whole and starts again.
Left out: compilation caches, run locks, W&B folders, the orbax checkpoints of finished stages.

MANIFEST.json lists every banked file with its size and sha256 (of the uncompressed bytes). `save` replaces the bank's
contents; `restore` checks every file against the manifest, refuses to overwrite a file of the run folder that differs
from the bank's (naming both), and writes nothing until every check passed.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import lzma
import shutil
import sys
from pathlib import Path

# Stage folders (relative to the run folder) whose final model a later stage reads (dreamjax/commands/reproduce.py):
# every policy starts from sft/, DreamGym rows train in exp_model*/, S2R continues dreamgym_<alg>/seed<s>/.
KEEP_MODELS = ("sft", "exp_model", "exp_model_*", "dreamgym_grpo/seed*", "dreamgym_ppo/seed*")
SKIP_NAMES = {"compile_cache", "wandb", ".lock"}
COMPRESS_ABOVE = 256 * 1024
MANIFEST = "MANIFEST.json"
EXP_MODEL_META = "exp_model.json"  # dreamjax.experience.exp_model.META_FILE, written beside an M_exp's weights
COMMITTED = "commit_success.txt"  # orbax's marker of a finished step (dreamjax.loop.checkpoint)


class BankError(ValueError):
  """A bank or run folder that cannot be saved or restored as asked (the message names the file)."""


def _digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _stages(run: Path) -> dict[Path, dict | None]:
  """Every stage folder (one holding config.json) -> its summary (None: unfinished). Evaluation folders are left
  out: they finish with eval.json and hold no model."""
  stages = {}
  for config in sorted(run.rglob("config.json")):
    folder = config.parent
    if (folder / "tokenizer_config.json").exists() or folder.name == "eval" or folder == run:
      continue  # a model folder's config, an evaluation, the table's own config
    summary = folder / "summary.json"
    stages[folder] = json.loads(summary.read_text()) if summary.is_file() else None
  return stages


def _newest_step(checkpoints: Path) -> Path | None:
  steps = [p for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit() and (p / COMMITTED).is_file()]
  return max(steps, key=lambda p: int(p.name)) if steps else None


def _models_read(final: Path) -> set[Path]:
  """The model folders a later stage reads when it starts from `final`: the model itself and, for an M_exp, the one
  whose backbone embeds its replay retrieval (exp_model.json's "encoder_folder": train-exp's initial model, init/)."""
  meta = final / EXP_MODEL_META
  encoder = json.loads(meta.read_text()).get("encoder_folder") if meta.is_file() else None
  return {final.resolve()} | ({Path(encoder).resolve()} if encoder else set())


def plan(run: Path, unfinished: bool) -> list[Path]:
  """The files of `run` a bank holds (see the module docstring)."""
  stages = _stages(run)
  dropped: list[Path] = []  # folders left out whole
  kept: list[Path] = []  # folders inside dropped ones that are kept (an unfinished stage's newest step)
  for folder, summary in stages.items():
    name = folder.relative_to(run).as_posix()
    if summary is not None:  # its orbax checkpoints, and every model folder but the final one a later stage reads
      final = Path(summary["checkpoint"]) if summary.get("checkpoint") else None
      keep = _models_read(final) if final and any(fnmatch.fnmatch(name, p) for p in KEEP_MODELS) else set()
      dropped.append(folder / "checkpoints")
      dropped += [m.parent for m in folder.rglob("tokenizer_config.json") if m.parent.resolve() not in keep]
    elif not unfinished:
      dropped.append(folder)  # its logs would start a rerun from scratch halfway through
    elif (folder / "checkpoints").is_dir():
      dropped.append(folder / "checkpoints")
      newest = _newest_step(folder / "checkpoints")
      kept += [newest] if newest else []
  dropped = [p.resolve() for p in dropped]
  kept = [p.resolve() for p in kept]

  def inside(path: Path, folders: list[Path]) -> bool:
    return any(path == f or f in path.parents for f in folders)

  files = []
  for path in sorted(run.rglob("*")):
    if not path.is_file() or any(part in SKIP_NAMES for part in path.relative_to(run).parts):
      continue
    resolved = path.resolve()
    if inside(resolved, dropped) and not inside(resolved, kept):
      continue
    files.append(path)
  return files


def save(run: Path, bank: Path, unfinished: bool = False) -> dict:
  if not run.is_dir():
    raise BankError(f"bank_run save: run folder {run} does not exist")
  entries = {}
  staged = bank.with_name(bank.name + ".saving")
  shutil.rmtree(staged, ignore_errors=True)
  for path in plan(run, unfinished):
    rel = path.relative_to(run).as_posix()
    data = path.read_bytes()
    packed = len(data) > COMPRESS_ABOVE
    target = staged / (rel + ".xz" if packed else rel)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(lzma.compress(data) if packed else data)
    entries[rel] = {"bytes": len(data), "sha256": _digest(data), "xz": packed}
  (staged / MANIFEST).write_text(json.dumps({"run": str(run), "files": entries}, indent=1, sort_keys=True) + "\n")
  shutil.rmtree(bank, ignore_errors=True)  # the new bank replaces the old one whole, once it is complete
  bank.parent.mkdir(parents=True, exist_ok=True)
  staged.rename(bank)
  return {"files": len(entries), "bytes": sum(e["bytes"] for e in entries.values()),
          "banked_bytes": sum(p.stat().st_size for p in bank.rglob("*") if p.is_file())}


def restore(bank: Path, run: Path) -> dict:
  manifest_path = bank / MANIFEST
  if not manifest_path.is_file():
    raise BankError(f"bank_run restore: {manifest_path} is missing (not a bank)")
  try:
    files = json.loads(manifest_path.read_text())["files"]
  except (ValueError, KeyError) as e:
    raise BankError(f"bank_run restore: {manifest_path} is not a bank manifest ({e})") from None
  contents, written = {}, 0
  for rel, entry in files.items():
    source = bank / (rel + ".xz" if entry["xz"] else rel)
    if not source.is_file():
      raise BankError(f"bank_run restore: {source} is listed in {manifest_path} but missing")
    data = source.read_bytes()
    try:
      data = lzma.decompress(data) if entry["xz"] else data
    except lzma.LZMAError as e:
      raise BankError(f"bank_run restore: {source} does not decompress ({e})") from None
    if _digest(data) != entry["sha256"]:
      raise BankError(f"bank_run restore: {source} does not match its sha256 in {manifest_path}")
    target = run / rel
    if target.exists() and target.read_bytes() != data:
      raise BankError(f"bank_run restore: {target} exists and differs from the bank's {source}; move the run "
                      "folder aside or restore into another")
    contents[target] = data
  for target, data in contents.items():
    if not target.exists():
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(data)
      written += 1
  return {"files": len(contents), "written": written}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  s = sub.add_parser("save", help="bank RUN into BANK (replacing BANK)")
  s.add_argument("run", type=Path)
  s.add_argument("bank", type=Path)
  s.add_argument("--unfinished", action="store_true",
                 help="also bank each unfinished stage's newest checkpoint step, so it resumes from there")
  r = sub.add_parser("restore", help="restore BANK into RUN")
  r.add_argument("bank", type=Path)
  r.add_argument("run", type=Path)
  args = parser.parse_args(argv)
  try:
    out = save(args.run, args.bank, args.unfinished) if args.command == "save" else restore(args.bank, args.run)
  except BankError as e:
    print(e, file=sys.stderr)
    return 2
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
