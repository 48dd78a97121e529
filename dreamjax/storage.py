"""Where a run's files may live: run folders on POSIX storage, checkpoints and exported models also in object stores.

A run folder (`out_dir`) needs three things object stores lack: appends (metrics.jsonl, trajectories.jsonl and the
replay buffer's records grow line by line), an atomic exclusive create and a lock (`dreamjax.loop.lock`), and renames
(the replay buffer commits a segment by renaming its folder; checkpoints set an unreadable step aside). So `out_dir`
must be a local disk or a POSIX share every process sees (NFS, Filestore); `lock_run_folder` refuses a URI and
probes the folder once (`check_posix_folder`), naming the operation that failed, so a FUSE mount that lacks one (e.g.
gcsfuse without directory renames) is refused at start instead of losing the replay buffer's first commit.

Checkpoints (`RunConfig.checkpoint_dir`) and exported models (`RunConfig.export_dir`) may be URIs such as
`gs://bucket/run/checkpoints`: orbax writes checkpoints through etils.epath and TensorStore, each process its own
shards, and commits a step with a marker file, no rename needed; exports are plain files written once. Reading a
model folder from a URI (`load_model`, an M_exp checkpoint) copies it first into a local staging folder
(`local_copy`), since safetensors maps its files from a local disk. gs:// needs the `gcs` extra (gcsfs for etils.epath,
google-cloud-storage for orbax's deletes) and credentials (`gcloud auth application-default login`, or the VM's
service account). docs/storage.md has the layout for a pod run.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import fsspec
from etils import epath

# The environment variable naming where `local_copy` stages remote model folders (default ~/.cache/dreamjax/staged).
STAGING_ENV = "DREAMJAX_STAGING_DIR"
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str | os.PathLike) -> bool:
  """True for an object-store or other URI (`gs://...`), False for a local path."""
  return bool(_URI.match(os.fspath(path)))


def storage_path(path: str | os.PathLike) -> Path | epath.Path:
  """A local path (pathlib), or an etils.epath path for a URI; both have the pathlib operations the checkpointer and
  the exporter use (`/`, mkdir, glob, read_text, write_bytes, rename). Never `.absolute()` the result: epath would make
  a URI a local path."""
  return epath.Path(os.fspath(path)) if is_uri(path) else Path(path)


def require_local(path: str | os.PathLike, field: str) -> Path:
  """`path` as a local Path, or a ValueError naming `field` when it is a URI (a run folder: module docstring)."""
  if is_uri(path):
    raise ValueError(f"{field} {os.fspath(path)!r} is a URI, but a run folder must be POSIX storage (a local disk or an "
                     f"NFS/Filestore share every process mounts): it appends metrics.jsonl, locks the folder and "
                     f"commits the replay buffer by renames. Put checkpoints and the exported model in the bucket with "
                     f"checkpoint_dir and export_dir instead (docs/storage.md)")
  return Path(path)


def check_remote(path: str, field: str) -> None:
  """Refuses a URI setting dreamjax cannot serve, naming `field`: a scheme other than gs://, or gs:// without the
  client libraries (the `gcs` extra). Local paths pass."""
  if not is_uri(path):
    return
  if not path.startswith("gs://"):
    raise ValueError(f"{field}: {path!r}: only gs:// URIs or local paths are supported")
  missing = []
  try:
    fsspec.get_filesystem_class("gs")
  except (ImportError, ValueError):
    missing.append("gcsfs")
  try:
    import google.cloud.storage  # noqa: F401  (orbax deletes old checkpoint steps through it)
  except ImportError:
    missing.append("google-cloud-storage")
  if missing:
    raise ValueError(f"{field}: {path!r} needs {' and '.join(missing)}: pip install 'dreamjax[gcs]'")


def check_posix_folder(folder: Path, field: str = "run folder") -> None:
  """Probes `folder` (it exists) for what a run folder needs: an exclusive create that refuses a second creator, appends
  that land after what is there, and a directory rename. A ValueError names the folder and the operation that failed;
  the probe's files are removed either way."""
  probe = folder / f".posix-probe-{socket.gethostname()}-{os.getpid()}"
  made: list[Path] = []

  def fail(op: str, why: str) -> ValueError:
    return ValueError(f"{field} {folder} is on storage without POSIX {op} ({why}); dreamjax needs it "
                      f"for metrics.jsonl, the run lock and the replay buffer's commits. Use a local disk or an "
                      f"NFS/Filestore share for out_dir (docs/storage.md)")

  try:
    try:
      fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      made.append(probe)
      os.write(fd, b"a")
      os.close(fd)
    except OSError as e:
      raise fail("file creation", f"{type(e).__name__}: {e}") from None
    try:
      os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
      raise fail("exclusive create", "creating an existing file with O_EXCL succeeded")
    except FileExistsError:
      pass
    except OSError as e:
      raise fail("exclusive create", f"{type(e).__name__}: {e}") from None
    try:
      with open(probe, "ab") as f:
        f.write(b"b")
      content = probe.read_bytes()
    except OSError as e:
      raise fail("appends", f"{type(e).__name__}: {e}") from None
    if content != b"ab":
      raise fail("appends", f"appending b'b' to b'a' read back {content!r}")
    src, dst = probe.with_name(probe.name + ".dir"), probe.with_name(probe.name + ".renamed")
    try:
      src.mkdir()
      made.append(src)
      (src / "x").write_bytes(b"x")
      src.rename(dst)
      made.append(dst)
      moved = (dst / "x").read_bytes() == b"x" and not src.exists()
    except OSError as e:
      raise fail("directory renames", f"{type(e).__name__}: {e}") from None
    if not moved:
      raise fail("directory renames", "the renamed folder's content was not where the rename put it")
  finally:
    for p in made:
      if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
      else:
        p.unlink(missing_ok=True)


def local_copy(folder: str | os.PathLike, what: str = "model folder") -> Path:
  """A local folder holding `folder`'s files: `folder` itself when it is local; for a URI, a copy of its top-level
  files under $DREAMJAX_STAGING_DIR (default ~/.cache/dreamjax/staged)/<scheme>/<bucket>/<path>, each file copied
  unless a file of the same size is already there, through a temporary name and a rename, so processes on one host
  staging the same model never read a partial file."""
  if not is_uri(folder):
    return Path(folder)
  remote = epath.Path(os.fspath(folder))
  if not remote.is_dir():
    raise FileNotFoundError(f"{what}: {os.fspath(folder)!r} does not exist or is not a folder")
  scheme, rest = os.fspath(folder).split("://", 1)
  root = Path(os.environ.get(STAGING_ENV) or Path.home() / ".cache" / "dreamjax" / "staged")
  local = root / scheme / rest.strip("/")
  local.mkdir(parents=True, exist_ok=True)
  for src in remote.iterdir():
    if src.is_dir():
      continue
    dst = local / src.name
    if dst.is_file() and dst.stat().st_size == src.stat().length:
      continue
    tmp = dst.with_name(f".{dst.name}.{socket.gethostname()}-{os.getpid()}.part")
    with src.open("rb") as r, open(tmp, "wb") as w:
      while chunk := r.read(1 << 24):
        w.write(chunk)
    os.replace(tmp, dst)
  return local
