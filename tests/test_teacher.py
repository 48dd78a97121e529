"""The teacher annotator against a real local HTTP server implementing POST /v1/chat/completions.

The server answers deterministically from the request content (one reason per "### Step" block, built from that
step's action and validity), and follows a script of failures: HTTP 500/429/401, a malformed body, content that is not
JSON, JSON nested too deeply to parse, a wrong number of reasons, a forbidden tag, and a slow answer past the client's
timeout. A redirecting server on 127.0.0.1 and a recording one on 127.0.0.2 (also loopback on Linux) check that the API
key never follows a redirect to another host. Every server binds a loopback address and stops when its test ends.
"""

import contextlib
import dataclasses
import http.server
import json
import re
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest

from dreamjax.cli import main
from dreamjax.data.jsonl import JsonlWriter
from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.experience.annotate import annotate_file, read_annotations, rule_annotator
from dreamjax.experience.teacher import SYSTEM_PROMPT, TeacherAnnotator, TeacherError, parse_answer, render_episode

CONFIG = str(Path(__file__).parent.parent / "configs" / "annotate_twx.py")


def expected_answer(user: str) -> dict:
  steps = re.findall(r"^### Step (\d+)\nAction: (.*)\nValid: (\w+)", user, re.M)
  reasons = [f"Step {n}: {action!r} is {'accepted' if valid == 'yes' else 'rejected'}." for n, action, valid in steps]
  return {"tutorial": "Plan: " + "; ".join(a for _, a, _ in steps), "reasons": reasons}


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):  # keep test output clean
    pass

  def _send(self, code: int, body: bytes, headers=()):
    try:
      self.send_response(code)
      for k, v in headers:
        self.send_header(k, v)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
      pass

  def do_POST(self):
    server = self.server
    request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with server.lock:
      server.calls.append({"path": self.path, "body": request, "auth": self.headers.get("Authorization")})
      mode = server.script.pop(0) if server.script else "ok"
    if self.path != "/v1/chat/completions":
      return self._send(404, b'{"error": "no such route"}')
    answer = expected_answer(request["messages"][1]["content"])
    if mode == "500":
      return self._send(500, b'{"error": "overloaded"}')
    if mode == "429":
      return self._send(429, b'{"error": "rate limited"}', [("Retry-After", "0.25")])
    if mode == "401":
      return self._send(401, b'{"error": "bad key"}')
    if mode == "slow":
      time.sleep(1.0)
    content = json.dumps(answer)
    if mode == "malformed_body":
      return self._send(200, b"<html>gateway error</html>")
    if mode == "deep_body":  # a response body json.loads cannot parse without exceeding the recursion limit
      return self._send(200, b"[" * 100_000, [("Content-Type", "application/json")])
    if mode == "deep":  # the same inside the message content
      content = '{"tutorial": ' + "[" * 100_000
    if mode == "not_json":
      content = "Here are my thoughts: the agent did well."
    if mode == "wrong_count":
      content = json.dumps(answer | {"reasons": answer["reasons"][:-1]})
    if mode == "tagged":
      content = json.dumps(answer | {"reasons": ["<think>x</think>"] + answer["reasons"][1:]})
    if mode == "fenced":
      content = "```json\n" + content + "\n```"
    body = {"id": "x", "object": "chat.completion", "model": request["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}
    self._send(200, json.dumps(body).encode(), [("Content-Type", "application/json")])


@contextlib.contextmanager
def _serve(host: str, handler: type, seconds: float = 60.0):
  """A threaded HTTP server on a loopback address; stopped on exit, or by a watchdog after `seconds` at the latest."""
  assert host.startswith("127."), "test servers listen on loopback only"
  srv = http.server.ThreadingHTTPServer((host, 0), handler)
  srv.calls, srv.script, srv.lock = [], [], threading.Lock()
  srv.daemon_threads = True
  srv.base_url = f"http://{host}:{srv.server_address[1]}/v1"
  thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
  thread.start()
  watchdog = threading.Timer(seconds, srv.shutdown)
  watchdog.daemon = True
  watchdog.start()
  try:
    yield srv
  finally:
    watchdog.cancel()
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture()
def server():
  with _serve("127.0.0.1", Handler) as srv:
    yield srv


def _record(i: int = 0, n: int = 3) -> TrajectoryRecord:
  instruction = f"Find the coin in house {i}."  # distinct episodes make distinct requests
  steps = []
  for j in range(n):
    last = j == n - 1
    invalid = j == 1
    steps.append(StepRecord(f"Location: room {j}\nInventory: nothing", "dance" if invalid else f"move {j} ✓",
                            f"Location: room {j + 1}\nInventory: {'coin' if last else 'nothing'}", float(last), last,
                            last, invalid, (f"move {j} ✓",), "expert"))
  task = Task.make("textworld_express", f"coin/train/{i}", instruction, game="coin", seed=i)
  return TrajectoryRecord(f"expert:coin/train/{i}", "textworld_express", task, instruction, "expert", i,
                          tuple(steps), True, n, 1.0)


def _teacher(server, tmp_path, **kw) -> TeacherAnnotator:
  sleeps = []
  kw = {"cache_dir": tmp_path / "cache", "backoff_s": 0.01, "sleep": sleeps.append} | kw
  t = TeacherAnnotator(server.base_url, "teacher-model", **kw)
  t.sleeps = sleeps
  return t


def test_answers_are_requested_validated_and_cached(server, tmp_path, monkeypatch):
  monkeypatch.setenv("DREAMJAX_TEST_KEY", "sk-local-test")
  record = _record()
  teacher = _teacher(server, tmp_path, api_key_env="DREAMJAX_TEST_KEY")
  a = teacher.annotate(record)
  want = expected_answer(render_episode(record))
  assert a.reasons == tuple(want["reasons"]) and a.tutorial == want["tutorial"]
  assert a.annotator == "teacher:teacher-model"
  assert a.reasons == ("Step 1: 'move 0 ✓' is accepted.", "Step 2: 'dance' is rejected.",
                       "Step 3: 'move 2 ✓' is accepted.")
  (call,) = server.calls
  assert call["path"] == "/v1/chat/completions" and call["auth"] == "Bearer sk-local-test"
  body = call["body"]
  assert (body["model"], body["temperature"]) == ("teacher-model", 0.0)
  assert body["response_format"] == {"type": "json_object"}
  assert body["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
  user = body["messages"][1]["content"]
  assert "Outcome: success after 3 steps" in user and "Number of steps (reasons to write): 3" in user
  assert "Initial state:\nLocation: room 0" in user and "Reward: 1, done: true, success: true" in user
  # A new annotator over the same cache makes no HTTP call; nor does the same one.
  again = _teacher(server, tmp_path, api_key_env="DREAMJAX_TEST_KEY")
  assert again.annotate(record) == a and teacher.annotate(record) == a
  assert len(server.calls) == 1 and again.stats.cache_hits == 1 and again.stats.requests == 0
  # Another episode (or model, or prompt) is another request.
  other = _teacher(server, tmp_path).annotate(_record(1, 2))
  assert len(other.reasons) == 2 and len(server.calls) == 2
  monkeypatch.delenv("DREAMJAX_TEST_KEY")
  _teacher(server, tmp_path, cache_dir=None, api_key_env="DREAMJAX_TEST_KEY").annotate(record)
  assert server.calls[-1]["auth"] is None  # no key set: no Authorization header


def test_retries_every_transient_failure_with_backoff(server, tmp_path):
  server.script[:] = ["500", "429", "malformed_body", "not_json", "wrong_count", "tagged", "fenced"]
  teacher = _teacher(server, tmp_path, max_retries=6, max_backoff_s=0.1)
  a = teacher.annotate(_record())
  assert a.reasons[1] == "Step 2: 'dance' is rejected."  # the fenced answer of the 7th attempt
  assert len(server.calls) == 7 and teacher.stats.retries == 6 and not teacher.stats.errors
  # backoff 0.01 * 2**attempt, capped at 0.1; the 429's Retry-After (0.25) is honoured up to the cap.
  assert teacher.sleeps == pytest.approx([0.01, 0.1, 0.04, 0.08, 0.1, 0.1])


def test_timeout_is_retried(server, tmp_path):
  server.script[:] = ["slow"]
  teacher = _teacher(server, tmp_path, timeout_s=0.3, max_retries=1)
  assert len(teacher.annotate(_record()).reasons) == 3
  assert len(server.calls) == 2 and teacher.stats.retries == 1


def test_exhausted_retries_raise_or_fall_back(server, tmp_path):
  record = _record()
  server.script[:] = ["500", "wrong_count", "500"]
  teacher = _teacher(server, tmp_path, max_retries=2)
  with pytest.raises(TeacherError, match=r"episode 'expert:coin/train/0' failed after 3 attempts: HTTP 500"):
    teacher.annotate(record)
  assert not list((tmp_path / "cache").glob("**/*.json"))  # nothing cached from failures
  server.script[:] = ["500", "500"]
  fallback = _teacher(server, tmp_path, max_retries=1, on_failure="fallback")
  with pytest.warns(UserWarning, match="using rules:textworld_express instead"):
    a = fallback.annotate(record)
  assert a.reasons == rule_annotator("textworld_express").annotate(record).reasons
  assert a.annotator == "rules:textworld_express (teacher fallback)" and fallback.stats.fallbacks == 1
  assert fallback.annotate(record).annotator == "teacher:teacher-model"  # not cached: the teacher is asked again


def test_configuration_errors_are_not_retried(server, tmp_path):
  server.script[:] = ["401"]
  teacher = _teacher(server, tmp_path, on_failure="fallback")
  with pytest.raises(TeacherError, match=r"HTTP 401 .* \(not retried: check the URL, model and \$OPENAI_API_KEY\)"):
    teacher.annotate(_record())
  assert len(server.calls) == 1
  with pytest.raises(TeacherError, match="HTTP 404"):
    TeacherAnnotator(server.base_url + "/wrong", "m", cache_dir=None).annotate(_record())
  with pytest.raises(ValueError, match="on_failure must be one of"):
    TeacherAnnotator(server.base_url, "m", on_failure="ignore")


def test_unreachable_server_is_retried_then_reported(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  sleeps = []
  teacher = TeacherAnnotator(f"http://127.0.0.1:{port}/v1", "m", max_retries=2, backoff_s=0.5, sleep=sleeps.append)
  with pytest.raises(TeacherError, match="failed after 3 attempts: cannot reach"):
    teacher.annotate(_record())
  assert sleeps == [0.5, 1.0] and teacher.stats.requests == 3


def test_parse_answer():
  assert parse_answer('Sure! {"tutorial": "t", "reasons": [" a ", "b"]} Done.', 2) == ("t", ("a", "b"))
  for content, message in [("[1, 2]", "not a JSON object"), ('{"reasons": ["a"]}', "no 'tutorial'"),
                           ('{"tutorial": "t", "reasons": [1]}', "not a list of strings"),
                           ('{"tutorial": "t", "reasons": ["a", " "]}', "reason 2 is empty"),
                           ('{"tutorial": "t </next_state>", "reasons": ["a", "b"]}', "format tag </next_state>"),
                           ('{"tutorial": "t", "reasons": ["a"]}', "1 reasons for 2 steps")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      parse_answer(content, 2)


def test_annotate_file_and_cli_with_the_teacher(server, tmp_path, capsys):
  records = [_record(i, 1 + i % 3) for i in range(5)]
  src = tmp_path / "trajectories.jsonl"
  with JsonlWriter(src) as w:
    for r in records:
      w.write(r.to_json())
  teacher = _teacher(server, tmp_path)
  summary = annotate_file(src, tmp_path / "a.jsonl", teacher, workers=3)
  assert summary["annotated"] == 5 and len(server.calls) == 5
  written = read_annotations(tmp_path / "a.jsonl")
  assert list(written) == [r.episode_id for r in records]  # file order, whatever order the threads finished in
  for r in records:
    assert written[r.episode_id].reasons == tuple(expected_answer(render_episode(r))["reasons"])
  # `dreamjax annotate` with a fresh output over the same cache: every answer comes from disk.
  assert main(["annotate", "--config", CONFIG, "--set", f"trajectories={src}", "--set", "annotator=teacher",
               "--set", f"teacher.base_url={server.base_url}", "--set", "teacher.model=teacher-model",
               "--set", f"teacher.cache_dir={tmp_path / 'cache'}", "--set", f"out={tmp_path / 'b.jsonl'}"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert (out["annotated"], out["requests"], out["cache_hits"]) == (5, 0, 5) and len(server.calls) == 5
  assert read_annotations(tmp_path / "b.jsonl") == written


def _failed(i: int, n: int) -> TrajectoryRecord:
  """An episode the env ended at its step limit of n steps, without success."""
  r = _record(i, n)
  last = dataclasses.replace(r.steps[-1], reward=0.0, success=False)
  return dataclasses.replace(r, steps=r.steps[:-1] + (last,), success=False, score=0.0)


def _write_records(path: Path, records) -> Path:
  with JsonlWriter(path) as w:
    for r in records:
      w.write(r.to_json())
  return path


def test_cli_teacher_settings(server, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("DREAMJAX_TEST_KEY", "sk-cli")
  records = [_record(0, 2), _failed(1, 3), _record(2, 2), _record(3, 3)]
  src = _write_records(tmp_path / "data" / "trajectories.jsonl", records)
  (tmp_path / "data" / "collect_config.json").write_text(json.dumps({"env_kwargs": ["step_limit=3"]}))
  args = ["annotate", "--config", CONFIG, "--set", f"trajectories={src}", "--set", "annotator=teacher",
          "--set", f"teacher.base_url={server.base_url}", "--set", "teacher.model=teacher-model",
          "--set", "teacher.api_key_env=DREAMJAX_TEST_KEY", "--set", "teacher.json_mode=false",
          "--set", "teacher.temperature=0.5", "--set", "workers=2", "--set", "progress=false"]
  assert main(args + ["--set", "limit=3"]) == 0
  summary = json.loads(capsys.readouterr().out)
  out = tmp_path / "data" / "annotations.teacher.jsonl"  # the default output, beside the input
  assert (summary["annotated"], summary["requests"], summary["step_limit"], summary["out"]) == (3, 3, 3, str(out))
  assert [c["auth"] for c in server.calls] == ["Bearer sk-cli"] * 3
  for call in server.calls:
    body = call["body"]
    assert "response_format" not in body and body["temperature"] == 0.5 and body["model"] == "teacher-model"
  # The teacher is told why the failed episode ended: the step limit from collect_config.json.
  users = {c["body"]["messages"][1]["content"] for c in server.calls}
  assert render_episode(records[1], step_limit=3) in users
  assert "Outcome: failure (the step limit was reached) after 3 steps" in render_episode(records[1], step_limit=3)
  assert len(list((tmp_path / "data" / "teacher_cache").glob("**/*.json"))) == 3  # default cache, beside the output
  # The rerun resumes: one episode left, one request.
  assert main(args) == 0
  summary = json.loads(capsys.readouterr().out)
  assert (summary["annotated"], summary["already_done"], summary["requests"]) == (1, 3, 1) and len(server.calls) == 4
  assert list(read_annotations(out)) == [f"expert:coin/train/{i}" for i in range(4)]


def test_cli_teacher_failures(server, tmp_path, capsys):
  src = _write_records(tmp_path / "trajectories.jsonl", [_record(i) for i in range(3)])
  args = ["annotate", "--config", CONFIG, "--set", f"trajectories={src}", "--set", "annotator=teacher",
          "--set", f"teacher.base_url={server.base_url}", "--set", "teacher.model=teacher-model",
          "--set", f"teacher.cache_dir={tmp_path / 'cache'}", "--set", "teacher.max_retries=1"]
  # The first episode is answered; the second fails twice: exit code 2, the message names it, the first stays.
  server.script[:] = ["ok", "500", "500"]
  assert main(args) == 2
  err = capsys.readouterr().err
  assert "episode 'expert:coin/train/1' failed after 2 attempts: HTTP 500" in err and "rerun to resume" in err
  out = tmp_path / "annotations.teacher.jsonl"
  assert list(read_annotations(out)) == ["expert:coin/train/0"]
  server.script[:] = ["401"]  # a misconfiguration is not retried
  assert main(args) == 2 and "HTTP 401" in capsys.readouterr().err and len(server.calls) == 4
  # With on_failure=fallback the failed episode gets the rule-based annotation and the run completes.
  server.script[:] = ["500", "500"]
  with pytest.warns(UserWarning, match="using rules:textworld_express instead"):
    assert main(args + ["--set", "teacher.on_failure=fallback"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert (summary["annotated"], summary["already_done"], summary["fallbacks"]) == (2, 1, 1)
  written = read_annotations(out)
  assert written["expert:coin/train/1"].annotator == "rules:textworld_express (teacher fallback)"
  assert written["expert:coin/train/2"].annotator == "teacher:teacher-model"


class Recorder(Handler):
  """Records every request's method, path and headers; answers any POST or GET as a chat completion would."""

  def _record(self):
    with self.server.lock:
      self.server.calls.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
    length = int(self.headers.get("Content-Length") or 0)
    if length:
      self.rfile.read(length)
    content = json.dumps({"tutorial": "t", "reasons": ["a", "b", "c"]})
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
    self._send(200, json.dumps(body).encode(), [("Content-Type", "application/json")])

  do_GET = do_POST = _record


class Redirector(Handler):
  """Answers every POST with `server.code` to `server.location`, after recording its Authorization header."""

  def do_POST(self):
    self.rfile.read(int(self.headers["Content-Length"]))
    with self.server.lock:
      self.server.calls.append({"path": self.path, "auth": self.headers.get("Authorization")})
    self._send(self.server.code, b"moved", [("Location", self.server.location)])


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_the_key_never_follows_a_redirect_to_another_host(tmp_path, monkeypatch, code):
  monkeypatch.setenv("DREAMJAX_TEST_KEY", "sk-secret-123")
  with contextlib.ExitStack() as servers:
    try:
      elsewhere = servers.enter_context(_serve("127.0.0.2", Recorder))
    except OSError as e:  # 127.0.0.0/8 is all loopback on Linux; elsewhere only 127.0.0.1 may be
      pytest.skip(f"cannot listen on 127.0.0.2: {e}")
    first = servers.enter_context(_serve("127.0.0.1", Redirector))
    first.code, first.location = code, elsewhere.base_url + "/chat/completions"
    errors = []
    for on_failure in ("raise", "fallback"):  # a redirect is a misconfiguration: never hidden by the fallback
      teacher = _teacher(first, tmp_path, cache_dir=None, api_key_env="DREAMJAX_TEST_KEY", on_failure=on_failure)
      try:
        teacher.annotate(_record())
      except TeacherError as e:
        errors.append(str(e))
  assert [c["auth"] for c in first.calls] == ["Bearer sk-secret-123"] * 2  # the key went where it was sent
  leaked = [c for c in elsewhere.calls if any("sk-secret-123" in v for v in c["headers"].values())]
  assert not leaked, f"the API key reached {elsewhere.base_url}: {leaked}"
  assert not elsewhere.calls  # the redirect is not followed at all
  want = (f"HTTP {code} from {first.base_url}/chat/completions redirects to {elsewhere.base_url}/chat/completions: "
          "not followed")
  assert len(errors) == 2 and all(want in e for e in errors), errors


def test_plain_http_to_another_host_warns_when_a_key_is_set(monkeypatch):
  monkeypatch.setenv("DREAMJAX_TEST_KEY", "sk-x")
  with pytest.warns(UserWarning, match=r"http://teacher\.example\.com/v1 is plain http to teacher\.example\.com, not "
                                       r"this machine: the API key from \$DREAMJAX_TEST_KEY would cross the network"):
    TeacherAnnotator("http://teacher.example.com/v1", "m", api_key_env="DREAMJAX_TEST_KEY")  # no request is made
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for url in ("https://teacher.example.com/v1", "http://127.0.0.1:8000/v1", "http://127.0.0.2/v1",
                "http://localhost:8000/v1", "http://[::1]:8000/v1"):
      TeacherAnnotator(url, "m", api_key_env="DREAMJAX_TEST_KEY")
    monkeypatch.delenv("DREAMJAX_TEST_KEY")
    TeacherAnnotator("http://teacher.example.com/v1", "m", api_key_env="DREAMJAX_TEST_KEY")  # no key to leak
  for url in ("file:///tmp/v1", "teacher.example.com/v1"):
    with pytest.raises(ValueError, match="base_url must be an http:// or https:// URL"):
      TeacherAnnotator(url, "m")


def test_a_deeply_nested_answer_is_an_invalid_answer(server, tmp_path):
  with pytest.raises(ValueError, match="nested too deeply to parse"):
    parse_answer("[" * 100_000, 1)
  record = _record()
  server.script[:] = ["deep", "deep_body"]
  fallback = _teacher(server, tmp_path, max_retries=1, on_failure="fallback")
  with pytest.warns(UserWarning, match=r"failed after 2 attempts: malformed response body .*; using "
                                       r"rules:textworld_express instead"):
    a = fallback.annotate(record)
  assert a.reasons == rule_annotator("textworld_express").annotate(record).reasons
  assert fallback.stats.retries == 1 and fallback.stats.fallbacks == 1
  server.script[:] = ["deep_body", "deep"]
  with pytest.raises(TeacherError, match=r"failed after 2 attempts: invalid answer: the answer is JSON nested too "
                                         r"deeply to parse"):
    _teacher(server, tmp_path, max_retries=1).annotate(record)
  assert len(server.calls) == 4 and not list((tmp_path / "cache").glob("**/*.json"))
  # In annotate_file's worker threads too: every episode falls back and the file is complete.
  records = [_record(i, 2) for i in range(3)]
  src = _write_records(tmp_path / "trajectories.jsonl", records)
  server.script[:] = ["deep", "deep_body"] * 3
  threaded = _teacher(server, tmp_path, max_retries=1, on_failure="fallback")
  with pytest.warns(UserWarning, match="using rules:textworld_express instead"):
    summary = annotate_file(src, tmp_path / "a.jsonl", threaded, workers=2)
  assert summary["annotated"] == 3 and threaded.stats.fallbacks == 3
  assert {a.annotator for a in read_annotations(tmp_path / "a.jsonl").values()} == {
      "rules:textworld_express (teacher fallback)"}
