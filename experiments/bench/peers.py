"""Peers run in their own interpreters: the dreamjax-side helper that runs google-tunix's measurements.

tunix lives in `.venv-tunix` (made by `experiments/bench/tunix_venv.sh`) because it cannot share dreamjax's venv, so
the benchmarks run `experiments/bench/tunix_peer.py` with that venv's Python in a subprocess, one measurement at a time
and side by side with dreamjax's (never concurrently: both would fight for the same cores), and read back the one JSON
object it prints. The subprocess gets a clean environment: no PYTHONPATH or VIRTUAL_ENV from this venv, and no
fake-device XLA flags (the test suite's 8 fake CPU devices would split tunix's threads); its CPU affinity is this
process's (a benchmark that pinned itself pins its peer too) and `--threads` makes it pin itself the same way.

When the venv is missing, or `DREAMJAX_SKIP_PEERS=1` (the tests set it: a tunix run costs compile minutes), `status`
says why in a short phrase the tables print in the tunix column, and the benchmark reports its other contenders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUNIX_VENV = ROOT / ".venv-tunix"
TUNIX_PEER = Path(__file__).resolve().parent / "tunix_peer.py"
SKIP_ENV = "DREAMJAX_SKIP_PEERS"


class PeerError(RuntimeError):
  """The peer's subprocess failed; the message carries the end of its stderr."""


def tunix_python(venv: Path = TUNIX_VENV) -> Path:
  return venv / "bin" / "python"


def status(skip: bool = False, venv: Path = TUNIX_VENV) -> str | None:
  """None when tunix can run; otherwise why not, short enough for a table cell."""
  if skip or os.environ.get(SKIP_ENV, "") not in ("", "0"):
    return "skipped"
  if not tunix_python(venv).is_file():
    print(f"tunix peer: {tunix_python(venv)} is missing; run `bash experiments/bench/tunix_venv.sh` to measure "
          f"tunix side by side (its column reads 'not installed')", file=sys.stderr, flush=True)
    return "not installed"
  return None


def _peer_env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env.pop("PJRT_NPROC", None)
  env["JAX_PLATFORMS"] = "cpu"
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def run_tunix(args: Sequence[str], *, threads: int, timeout_s: float = 1800, venv: Path = TUNIX_VENV) -> dict:
  """Runs tunix_peer.py with `args` and returns the JSON object it printed. Its stderr (progress) is passed through
  line by line, without pip's or absl's noise."""
  cmd = [str(tunix_python(venv)), str(TUNIX_PEER), *map(str, args), "--threads", str(threads)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_peer_env(), cwd=ROOT)
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise PeerError(f"tunix_peer.py ran past {timeout_s:.0f} s: {' '.join(cmd)}\n{err[-3000:]}") from None
  for line in err.splitlines():
    if line.startswith("[tunix]"):
      print(line, file=sys.stderr, flush=True)
  lines = [ln for ln in out.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    raise PeerError(f"tunix_peer.py failed (exit {proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
  return json.loads(lines[-1])
