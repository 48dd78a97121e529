"""Trains a byte-level BPE tokenizer (ChatML template) from text files into an HF tokenizer folder.

Tiny models in tests and CPU configs need a vocabulary matched to their env text; this writes one that
`dreamjax.text.load_tokenizer` (and `transformers.AutoTokenizer`) load like any checkpoint's.

    python tools/train_tokenizer.py data/*.txt --out /tmp/tok --vocab-size 1024
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Iterator, Sequence

from dreamjax.text import train_bpe_tokenizer
from dreamjax.text.tokenizer import CHATML_SPECIAL_TOKENS


def read_lines(paths: Sequence[pathlib.Path]) -> Iterator[str]:
  """Streams lines, so corpora larger than memory can be used."""
  for path in paths:
    with path.open(encoding="utf-8") as f:
      yield from f


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("files", nargs="+", type=pathlib.Path, help="UTF-8 text files to train on")
  parser.add_argument("--out", required=True, type=pathlib.Path, help="folder to write the tokenizer into")
  parser.add_argument("--vocab-size", type=int, default=1024)
  parser.add_argument(
      "--special-token", action="append", default=[], help="extra special token (repeatable), after the ChatML ones"
  )
  args = parser.parse_args(argv)
  missing = [str(p) for p in args.files if not p.is_file()]
  if missing:
    parser.error(f"text files not found: {missing}")
  if args.out.exists() and any(args.out.iterdir()):
    parser.error(f"--out {str(args.out)!r} is not empty; refusing to overwrite a tokenizer")
  specials = (*CHATML_SPECIAL_TOKENS, *(t for t in args.special_token if t not in CHATML_SPECIAL_TOKENS))
  tok = train_bpe_tokenizer(read_lines(args.files), args.out, vocab_size=args.vocab_size, special_tokens=specials)
  print(f"wrote {args.out}: vocab_size={tok.vocab_size} bos={tok.bos_id} eos={tok.eos_ids} pad={tok.pad_id}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
