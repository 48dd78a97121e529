"""The teacher annotator: a strong LLM behind an OpenAI-compatible endpoint writes each episode's reasoning.

As in the paper, the teacher sees the whole trajectory with its outcome and answers, in one JSON object, a task tutorial
(overall plan, success mode, failure mode) and one reason per step: {"tutorial": "...", "reasons": ["...", ...]}.

Robustness, since a dataset is thousands of calls:
- Every request is `POST {base_url}/chat/completions` (standard library urllib; no client package). The API key is
  read from the environment variable `api_key_env` when it is set (local servers often need none) and is never
  written anywhere.
- The key goes only to `base_url`'s host. Redirects are not followed: urllib would resend the request, Authorization
  header included, to whatever host the Location names (and as a GET without the body, so no redirect of this POST
  API can work anyway); a 3xx answer raises TeacherError naming its target. A plain http:// base URL to a host other
  than this machine (not loopback) warns at construction when the key is set, since the key would cross the network
  unencrypted.
- Retries with exponential backoff (`backoff_s * 2**attempt`, capped) on HTTP 429 (honouring Retry-After) and 5xx,
  timeouts, dropped connections, and answers that do not validate (not JSON, JSON nested too deeply to parse, wrong
  number of reasons, an empty reason, a format tag of the experience model's output inside a reason). Other HTTP
  errors (3xx, 400, 401, 404: a wrong URL, model or key) raise at once, since retrying or falling back would only hide
  a misconfiguration.
- When every attempt fails, `on_failure="raise"` raises TeacherError naming the episode and the last error;
  `on_failure="fallback"` warns and returns the fallback annotator's annotation (the env's rule-based one by default),
  which is not cached, so a later run asks the teacher again.
- Validated answers are cached on disk under `cache_dir`, one JSON file per request, keyed by the SHA-256 of the
  request body (model, messages, temperature, ...; not the URL, so moving a server keeps the cache). A rerun over the
  same episodes makes no HTTP call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import ipaddress
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dreamjax.data.records import TrajectoryRecord
from dreamjax.experience.annotate import Annotation, Annotator, ending, rule_annotator
from dreamjax.experience.format import TAGS, clip

FAILURE_MODES = ("raise", "fallback")
FALLBACK_MARK = "(teacher fallback)"  # appended to the annotator name of an annotation the fallback wrote
_MARKERS = tuple(m for tag in TAGS for m in (f"<{tag}>", f"</{tag}>"))
_ENDINGS = {"success": "success", "step_limit": "failure (the step limit was reached)",
            "invalid_action": "failure (an invalid action ended the episode)",
            "failure": "failure (the environment's failure condition)", "ended": "failure",
            "cut_off": "not finished (the recording stops before the episode ended)", "empty": "no steps"}

SYSTEM_PROMPT = (
    "You annotate recorded episodes of an agent acting in an environment. The annotations teach a world model to "
    "predict, from a state and an action, the next state, the reward and whether the episode ends. You see the whole "
    "episode and its outcome.\n"
    "For every step, write a reason of one to three sentences that explains why the action leads to that next state "
    "and outcome: whether the action is valid in the state, which preconditions in the state matter, what changes and "
    "what does not, and how the step moves the episode towards its outcome (success, or why it ends without it).\n"
    "Also write a tutorial for the task: the overall plan, how success looks (the final step and its reward), and how "
    "the episode can fail.\n"
    "Answer with one JSON object and nothing else: {\"tutorial\": \"...\", \"reasons\": [\"reason for step 1\", "
    "...]}, with exactly one reason per step, in order. Do not use angle-bracket tags such as <think> or <next_state>."
)


class TeacherError(RuntimeError):
  """The teacher could not annotate an episode (misconfiguration, or every retry failed)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
  def redirect_request(self, req, fp, code, msg, headers, newurl):
    return None  # urllib then raises the 3xx as an HTTPError, which `_post` reports


def _is_loopback(host: str) -> bool:
  """Whether `host` (a URL's hostname) names this machine; names are not resolved, so only localhost counts."""
  host = host.lower()
  if host == "localhost" or host.endswith(".localhost"):
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


class _Retryable(Exception):
  """A failure worth another attempt; `wait` is the server's Retry-After, if any."""

  def __init__(self, message: str, wait: float | None = None):
    super().__init__(message)
    self.wait = wait


@dataclasses.dataclass
class TeacherStats:
  requests: int = 0  # HTTP requests sent
  cache_hits: int = 0
  retries: int = 0
  fallbacks: int = 0
  errors: list[str] = dataclasses.field(default_factory=list)  # the last error of each failed episode


def render_episode(record: TrajectoryRecord, max_state_chars: int = 1500, step_limit: int | None = None) -> str:
  """The user message: task, outcome, the first state, then per step the action, validity, next state, outcome."""
  outcome = _ENDINGS[ending(record, step_limit)]
  lines = [f"Environment: {record.env}", f"Task: {' '.join(record.instruction.split())}",
           f"Outcome: {outcome} after {record.num_steps} steps", f"Number of steps (reasons to write): "
           f"{record.num_steps}", ""]
  if record.steps:
    lines += ["Initial state:", clip(record.steps[0].state, max_state_chars), ""]
  for j, s in enumerate(record.steps):
    if j and s.state != record.steps[j - 1].next_state:  # never in env records; shown if a record is stitched
      lines += ["State before this step:", clip(s.state, max_state_chars)]
    valid = "no (the environment rejects it)" if s.invalid else "yes"
    lines += [f"### Step {j + 1}", f"Action: {s.action}", f"Valid: {valid}", "Next state:",
              clip(s.next_state, max_state_chars),
              f"Reward: {s.reward:g}, done: {str(s.done).lower()}, success: {str(s.success).lower()}", ""]
  return "\n".join(lines).rstrip() + "\n"


def parse_answer(content: str, num_steps: int) -> tuple[str, tuple[str, ...]]:
  """(tutorial, reasons) from the teacher's message; raises ValueError saying what is wrong."""
  text = content.strip()
  if text.startswith("```"):  # a fenced block despite the instructions
    text = text.split("\n", 1)[1] if "\n" in text else ""
    text = text.rsplit("```", 1)[0]
  try:
    try:
      answer = json.loads(text)
    except json.JSONDecodeError:
      start, end = text.find("{"), text.rfind("}")
      try:
        answer = json.loads(text[start : end + 1]) if 0 <= start < end else None
      except json.JSONDecodeError:
        answer = None
  except RecursionError:  # no ValueError: uncaught, it would end `dreamjax annotate` whatever on_failure says
    raise ValueError(f"the answer is JSON nested too deeply to parse: {clip(content, 120)!r}") from None
  if not isinstance(answer, dict):
    raise ValueError(f"the answer is not a JSON object: {clip(content, 120)!r}")
  tutorial, reasons = answer.get("tutorial"), answer.get("reasons")
  if not isinstance(tutorial, str) or not tutorial.strip():
    raise ValueError("the answer has no 'tutorial' string")
  if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
    raise ValueError("the answer's 'reasons' is not a list of strings")
  if len(reasons) != num_steps:
    raise ValueError(f"the answer has {len(reasons)} reasons for {num_steps} steps")
  for j, r in enumerate(reasons):
    if not r.strip():
      raise ValueError(f"reason {j + 1} is empty")
    tag = next((m for m in _MARKERS if m in r or m in tutorial), None)
    if tag:
      raise ValueError(f"the answer contains the format tag {tag} (reason {j + 1} or the tutorial)")
  return tutorial.strip(), tuple(r.strip() for r in reasons)


class TeacherAnnotator:
  """Annotates episodes with a teacher LLM; see the module docstring for retries, caching and fallback."""

  def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", max_retries: int = 4,
               timeout_s: float = 120.0, cache_dir: str | Path | None = None, temperature: float = 0.0,
               backoff_s: float = 1.0, max_backoff_s: float = 60.0, on_failure: str = "raise",
               fallback: Annotator | None = None, json_mode: bool = True, max_tokens: int | None = None,
               max_state_chars: int = 1500, step_limit: int | None = None,
               sleep: Callable[[float], None] = time.sleep):
    if on_failure not in FAILURE_MODES:
      raise ValueError(f"on_failure must be one of {FAILURE_MODES}, got {on_failure!r}")
    if max_retries < 0 or timeout_s <= 0:
      raise ValueError(f"max_retries must be >= 0 and timeout_s > 0, got {max_retries} and {timeout_s}")
    self.url = base_url.rstrip("/") + "/chat/completions"
    parts = urllib.parse.urlsplit(self.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
      raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
    if parts.scheme == "http" and os.environ.get(api_key_env) and not _is_loopback(parts.hostname):
      warnings.warn(f"teacher base_url {base_url} is plain http to {parts.hostname}, not this machine: the API key "
                    f"from ${api_key_env} would cross the network unencrypted (use https)", stacklevel=2)
    self.model, self.api_key_env, self.max_retries, self.timeout_s = model, api_key_env, max_retries, timeout_s
    self.cache_dir = Path(cache_dir) if cache_dir is not None else None
    self.temperature, self.backoff_s, self.max_backoff_s = temperature, backoff_s, max_backoff_s
    self.on_failure, self.fallback, self.json_mode, self.max_tokens = on_failure, fallback, json_mode, max_tokens
    self.max_state_chars, self.step_limit, self.sleep = max_state_chars, step_limit, sleep
    self.name = f"teacher:{model}"
    self.stats = TeacherStats()
    self._lock = threading.Lock()  # stats may be updated from annotate_file's worker threads
    # urlopen's default opener, less redirects (OpenerDirector.open is used from several threads, as urlopen is).
    self._opener = urllib.request.build_opener(_NoRedirect)

  def request_body(self, record: TrajectoryRecord) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": self.model, "temperature": self.temperature,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": render_episode(record, self.max_state_chars, self.step_limit)}]}
    if self.json_mode:
      body["response_format"] = {"type": "json_object"}
    if self.max_tokens is not None:
      body["max_tokens"] = self.max_tokens
    return body

  def annotate(self, record: TrajectoryRecord) -> Annotation:
    body = self.request_body(record)
    key = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    cached = self._cache_get(key, record.num_steps)
    if cached is not None:
      self._count(cache_hits=1)
      return Annotation(record.episode_id, cached[0], cached[1], self.name)
    error = ""
    for attempt in range(self.max_retries + 1):
      if attempt:
        self._count(retries=1)
      try:
        tutorial, reasons = parse_answer(self._post(body), record.num_steps)
      except _Retryable as e:
        error, wait = str(e), e.wait
      except ValueError as e:
        error, wait = f"invalid answer: {e}", None
      else:
        self._cache_put(key, record, tutorial, reasons)
        return Annotation(record.episode_id, tutorial, reasons, self.name)
      if attempt < self.max_retries:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        self.sleep(max(delay, min(wait, self.max_backoff_s)) if wait is not None else delay)
    message = f"{self.name}: episode {record.episode_id!r} failed after {self.max_retries + 1} attempts: {error}"
    with self._lock:
      self.stats.errors.append(message)
    if self.on_failure == "raise":
      raise TeacherError(message)
    fallback = self.fallback or rule_annotator(record.env, self.step_limit)
    warnings.warn(f"{message}; using {fallback.name} instead", stacklevel=2)
    self._count(fallbacks=1)
    annotation = fallback.annotate(record)
    return dataclasses.replace(annotation, annotator=f"{annotation.annotator or fallback.name} {FALLBACK_MARK}")

  def _count(self, **deltas: int) -> None:
    with self._lock:
      for k, v in deltas.items():
        setattr(self.stats, k, getattr(self.stats, k) + v)

  def _post(self, body: dict[str, Any]) -> str:
    """The answer's message content; _Retryable for transient failures, TeacherError for configuration errors."""
    request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    api_key = os.environ.get(self.api_key_env, "")
    if api_key:
      # Unredirected: should a redirect ever be followed, urllib does not copy this header to it.
      request.add_unredirected_header("Authorization", f"Bearer {api_key}")
    self._count(requests=1)
    try:
      with self._opener.open(request, timeout=self.timeout_s) as response:
        raw = response.read()
    except urllib.error.HTTPError as e:
      detail = clip(e.read().decode("utf-8", "replace").strip(), 300) if e.fp is not None else ""
      if 300 <= e.code < 400:
        target = e.headers.get("Location") if e.headers is not None else None
        raise TeacherError(f"{self.name}: HTTP {e.code} from {self.url} redirects to {target or '(no Location)'}: "
                           "not followed, since the request and its API key would go to another address (not "
                           "retried: set the base URL to the address that serves the API)") from None
      if e.code == 429 or e.code >= 500:
        retry_after = e.headers.get("Retry-After") if e.headers is not None else None
        try:
          wait = float(retry_after) if retry_after is not None else None
        except ValueError:
          wait = None
        raise _Retryable(f"HTTP {e.code} from {self.url}: {detail}", wait) from None
      raise TeacherError(f"{self.name}: HTTP {e.code} from {self.url} (not retried: check the URL, model and "
                         f"${self.api_key_env}): {detail}") from None
    except urllib.error.URLError as e:
      raise _Retryable(f"cannot reach {self.url}: {e.reason}") from None
    except (TimeoutError, socket.timeout):
      raise _Retryable(f"no answer from {self.url} within {self.timeout_s} s") from None
    except (http.client.HTTPException, ConnectionError) as e:
      raise _Retryable(f"connection to {self.url} failed: {type(e).__name__}: {e}") from None
    try:
      content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
      raise _Retryable(f"malformed response body from {self.url}: {clip(raw.decode('utf-8', 'replace'), 120)!r}"
                       ) from None
    if not isinstance(content, str):
      raise _Retryable(f"the response's message content is {type(content).__name__}, not text")
    return content

  def _cache_path(self, key: str) -> Path | None:
    return None if self.cache_dir is None else self.cache_dir / key[:2] / f"{key}.json"

  def _cache_get(self, key: str, num_steps: int) -> tuple[str, tuple[str, ...]] | None:
    path = self._cache_path(key)
    if path is None or not path.is_file():
      return None
    try:
      entry = json.loads(path.read_text(encoding="utf-8"))
      return parse_answer(json.dumps({"tutorial": entry["tutorial"], "reasons": entry["reasons"]}), num_steps)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
      warnings.warn(f"{path}: unreadable cache entry ({e}); asking the teacher again", stacklevel=3)
      return None

  def _cache_put(self, key: str, record: TrajectoryRecord, tutorial: str, reasons: tuple[str, ...]) -> None:
    path = self._cache_path(key)
    if path is None:
      return
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "model": self.model, "episode_id": record.episode_id, "tutorial": tutorial,
             "reasons": list(reasons)}
    tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(entry, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, path)  # atomic: a killed run leaves no half-written entry
