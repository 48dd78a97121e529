"""A Cloud Storage bucket in memory, reachable the three ways dreamjax's gs:// paths use: TensorStore's `gcs` driver
(orbax's array data), etils.epath through fsspec (orbax's metadata and commit markers, HF exports, staging), and
google-cloud-storage (orbax looks the bucket up before deleting an old step).

One object store serves all three: a small HTTP server speaking the part of the GCS JSON API those clients call (object
media and metadata reads with ranges and generation preconditions, media uploads, deletes, prefix listings, bucket
metadata), pointed to by TensorStore's and google-cloud-storage's test endpoints (TENSORSTORE_GCS_HTTP_URL,
STORAGE_EMULATOR_HOST), and an fsspec filesystem registered for `gs://` over the same objects. Like GCS it has no
directories (a folder exists while an object is under it), no appends and no rename (fsspec's move is a copy and a
delete), so code that needs POSIX semantics fails here as it would on the real service.

`fake_gcs()` starts it once per process (TensorStore reads its endpoint once) and returns the store; tests clear it.
"""

from __future__ import annotations

import io
import json
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
from fsspec.spec import AbstractFileSystem

BUCKET = "dreamjax-test"  # TensorStore checks bucket names as GCS does (3-63 characters)


class Store:
  """Objects by "bucket/name": (bytes, generation); one lock for the server's threads and the test's."""

  def __init__(self):
    self.objects: dict[str, tuple[bytes, int]] = {}
    self.generation = 0
    self.lock = threading.Lock()

  def put(self, key: str, data: bytes) -> int:
    with self.lock:
      self.generation += 1
      self.objects[key] = (bytes(data), self.generation)
      return self.generation

  def get(self, key: str) -> tuple[bytes, int] | None:
    with self.lock:
      return self.objects.get(key)

  def delete(self, key: str) -> None:
    with self.lock:
      self.objects.pop(key, None)

  def keys(self) -> list[str]:
    with self.lock:
      return sorted(self.objects)

  def clear(self) -> None:
    with self.lock:
      self.objects.clear()


STORE = Store()


def _meta(bucket: str, name: str, data: bytes, generation: int) -> dict:
  return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)),
          "generation": str(generation)}


class _Handler(BaseHTTPRequestHandler):
  def log_message(self, *args) -> None:
    pass

  def _send(self, code: int, body: bytes = b"", headers: dict | None = None, ctype: str = "application/json"):
    self.send_response(code)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  def _parse(self) -> tuple[list[str], dict[str, str]]:
    url = urllib.parse.urlsplit(self.path)
    return url.path.split("/"), dict(urllib.parse.parse_qsl(url.query))

  def do_GET(self):  # noqa: N802
    parts, query = self._parse()  # "", "storage", "v1", "b", bucket[, "o"[, name]]
    bucket = parts[4]
    if len(parts) == 5:
      return self._send(200, json.dumps({"kind": "storage#bucket", "name": bucket, "id": bucket}).encode())
    if len(parts) == 6 or parts[6] == "":
      prefix, items = query.get("prefix", ""), []
      for key in STORE.keys():
        b, name = key.split("/", 1)
        if b == bucket and name.startswith(prefix) and name >= query.get("startOffset", "") and (
            not query.get("endOffset") or name < query["endOffset"]):
          data, generation = STORE.get(key) or (b"", 0)
          items.append(_meta(b, name, data, generation))
      return self._send(200, json.dumps({"kind": "storage#objects", "items": items}).encode())
    name = urllib.parse.unquote("/".join(parts[6:]))
    got = STORE.get(f"{bucket}/{name}")
    if got is None:
      return self._send(404, b'{"error": {"code": 404, "message": "No such object"}}')
    data, generation = got
    if query.get("ifGenerationNotMatch") == str(generation):
      return self._send(304)
    if "ifGenerationMatch" in query and query["ifGenerationMatch"] != str(generation):
      return self._send(412, b'{"error": {"code": 412}}')
    if query.get("alt") != "media":
      return self._send(200, json.dumps(_meta(bucket, name, data, generation)).encode())
    headers, code = {"x-goog-generation": str(generation)}, 200
    byte_range = self.headers.get("Range")
    if byte_range:  # "bytes=a-b", "bytes=a-" or "bytes=-n"
      first, last = byte_range.split("=", 1)[1].split("-")
      start = len(data) - int(last) if not first else int(first)
      end = len(data) - 1 if (not first or not last) else int(last)
      data, code = data[start:end + 1], 206
      headers["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{len(got[0])}"
    return self._send(code, data, headers, "application/octet-stream")

  def do_POST(self):  # noqa: N802
    parts, query = self._parse()  # "", "upload", "storage", "v1", "b", bucket, "o"
    bucket, name = parts[5], query["name"]
    data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
    key = f"{bucket}/{name}"
    with STORE.lock:
      current = STORE.objects.get(key)
      if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != (current[1] if current else 0):
        return self._send(412, b'{"error": {"code": 412}}')
    generation = STORE.put(key, data)
    return self._send(200, json.dumps(_meta(bucket, name, data, generation)).encode())

  def do_DELETE(self):  # noqa: N802
    parts, query = self._parse()
    key = parts[4] + "/" + urllib.parse.unquote("/".join(parts[6:]))
    current = STORE.get(key)
    if current is None:
      return self._send(404, b'{"error": {"code": 404}}')
    if "ifGenerationMatch" in query and query["ifGenerationMatch"] != str(current[1]):
      return self._send(412, b'{"error": {"code": 412}}')
    STORE.delete(key)
    return self._send(204)


class _Upload(io.BytesIO):
  """A write handle: the object appears whole when it is closed, as a GCS upload does."""

  def __init__(self, key: str):
    super().__init__()
    self.key = key

  def close(self) -> None:
    if not self.closed:
      STORE.put(self.key, self.getvalue())
    super().close()


class FakeGCSFileSystem(AbstractFileSystem):
  """fsspec's view of the store, as gcsfs gives it: paths "bucket/name", folders implied by the objects under them."""

  protocol = ("gs", "gcs")
  root_marker = ""
  cachable = False

  @classmethod
  def _strip_protocol(cls, path):
    path = os.fspath(path)
    for prefix in ("gs://", "gcs://"):
      if path.startswith(prefix):
        path = path[len(prefix):]
    return path.rstrip("/")

  def info(self, path, **kwargs):
    path = self._strip_protocol(path)
    got = STORE.get(path)
    if got is not None:
      return {"name": path, "size": len(got[0]), "type": "file"}
    if "/" not in path or any(k.startswith(path + "/") for k in STORE.keys()):
      return {"name": path, "size": 0, "type": "directory"}
    raise FileNotFoundError(path)

  def ls(self, path, detail=True, **kwargs):
    path = self._strip_protocol(path)
    entries = {}
    for key in STORE.keys():
      if key.startswith(path + "/"):
        rest = key[len(path) + 1:]
        if "/" in rest:
          sub = f"{path}/{rest.split('/')[0]}"
          entries[sub] = {"name": sub, "size": 0, "type": "directory"}
        else:
          entries[key] = {"name": key, "size": len((STORE.get(key) or (b"",))[0]), "type": "file"}
    if not entries:
      info = self.info(path)  # FileNotFoundError when nothing is there
      entries = {path: info} if info["type"] == "file" else {}
    found = sorted(entries.values(), key=lambda e: e["name"])
    return found if detail else [e["name"] for e in found]

  def _open(self, path, mode="rb", **kwargs):
    key = self._strip_protocol(path)
    if mode == "rb":
      got = STORE.get(key)
      if got is None:
        raise FileNotFoundError(path)
      return io.BytesIO(got[0])
    if mode == "wb":
      return _Upload(key)
    raise NotImplementedError(f"GCS objects cannot be opened with mode {mode!r}")

  def mkdir(self, path, create_parents=True, **kwargs):
    pass  # no folders in GCS

  def makedirs(self, path, exist_ok=False):
    pass

  def rmdir(self, path):
    pass

  def _rm(self, path):
    STORE.delete(self._strip_protocol(path))

  def rm_file(self, path):
    self._rm(path)

  def cp_file(self, path1, path2, **kwargs):
    got = STORE.get(self._strip_protocol(path1))
    if got is None:
      if self.info(path1)["type"] == "directory":
        return  # a recursive copy lists the folders too; GCS has none to copy
      raise FileNotFoundError(path1)
    STORE.put(self._strip_protocol(path2), got[0])


_SERVER: ThreadingHTTPServer | None = None


def fake_gcs() -> Store:
  """Starts the fake service for this process (once) and routes every gs:// client to it; returns its store."""
  global _SERVER
  if _SERVER is None:
    _SERVER = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=_SERVER.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{_SERVER.server_port}"
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", STORAGE_EMULATOR_HOST=url)
    for protocol in FakeGCSFileSystem.protocol:
      fsspec.register_implementation(protocol, FakeGCSFileSystem, clobber=True)
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()  # epath caches the filesystem it found for "gcs"
  return STORE
