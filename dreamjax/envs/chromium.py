"""Points Playwright (hence BrowserGym) and MiniWoB at Debian's Chromium, offline.

Playwright's own browser download fails on these machines, and BrowserGym opens a second browser (its chat window)
through `pw.chromium.launch()` without passing `executable_path`, so the only switch both launches obey is the
browser folder Playwright looks in: `$PLAYWRIGHT_BROWSERS_PATH/chromium-<revision>/chrome-linux/chrome`. We put a
small wrapper script there that runs the system Chromium with flags that keep it off the network (CHROMIUM_FLAGS;
without them it also keeps retrying outside connections and stalls). The revision is read from the installed
Playwright, so an upgrade of the `playwright` wheel does not silently break the lookup.

Call `configure_chromium()` before the first BrowserGym reset in a process: Playwright's driver reads the
environment once, when BrowserGym starts its global instance.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from pathlib import Path

INSTALL_HINT = "apt-get install -y chromium chromium-driver"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
# --no-sandbox: containers here lack user namespaces; --disable-dev-shm-usage avoids crashes with a small /dev/shm.
# The network, measured with `strace -f -e trace=connect` over a MiniWoB episode (tests/test_no_network.py): Chromium's
# background services (clock sync with clients2.google.com, component updates, sign-in's account list on
# accounts.google.com, optimization-guide models) run despite --disable-background-networking and
# --disable-component-update, and every host name they look up costs a UDP connect to Google's public DNS address
# (Chromium's IPv6 reachability probe) and queries to the DNS server. The resolver rule is what stops all of it: it
# fails every name but localhost before Chromium's resolver (where DNS over HTTPS lives too) sees it. `^NOTFOUND` is
# the current spelling; the older `~NOTFOUND` is now just an invalid name that reaches the resolver, probe included.
# The other network switches are cheap belt and braces.
CHROMIUM_FLAGS = (
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-default-apps",
    "--disable-breakpad", "--metrics-recording-only", "--mute-audio",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-pings",
    "--disable-domain-reliability", "--disable-client-side-phishing-detection",
    "--host-resolver-rules=MAP * ^NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
)
# Features switched off on top of the launchers' (Playwright's, BrowserGym's): the clock sync and the optimization
# guide's fetches, so they do not even try (measured: both gone; sign-in and the component check still try, and fail
# at the resolver rule).
DISABLED_FEATURES = (
    "NetworkTimeServiceQuerying", "OptimizationHints", "OptimizationHintsFetching", "OptimizationGuideModelDownloading",
)


@dataclasses.dataclass(frozen=True)
class ChromiumSetup:
  browsers_path: Path  # the folder set as PLAYWRIGHT_BROWSERS_PATH
  executable: Path  # where Playwright will look for chrome (a link to the wrapper)
  revision: str  # the chromium revision the installed Playwright expects
  miniwob_url: str  # the MINIWOB_URL in effect


def playwright_chromium_revision() -> str:
  """The chromium revision the installed Playwright driver expects (e.g. '1117' for Playwright 1.44)."""
  import playwright

  browsers_json = Path(playwright.__file__).parent / "driver" / "package" / "browsers.json"
  try:
    browsers = json.loads(browsers_json.read_text())["browsers"]
  except (OSError, KeyError, ValueError) as e:
    raise RuntimeError(f"cannot read the chromium revision from {browsers_json}: {e}") from e
  for browser in browsers:
    if browser.get("name") == "chromium":
      return str(browser["revision"])
  raise RuntimeError(f"{browsers_json} lists no 'chromium' browser")


def miniwob_html_url() -> str:
  """file:// URL of the MiniWoB++ task pages shipped in the `miniwob` wheel (with a trailing slash)."""
  try:
    import miniwob
  except ImportError as e:
    raise ImportError("MiniWoB++ pages come from the `miniwob` package: pip install miniwob==1.1.0") from e
  html = Path(miniwob.__file__).parent / "html" / "miniwob"
  if not (html / "click-button.html").is_file():
    raise RuntimeError(f"the miniwob package at {html.parent.parent} ships no task pages under {html}")
  return html.as_uri() + "/"


def default_cache_dir() -> Path:
  """`$DREAMJAX_CHROMIUM_DIR`, else `<repo>/.cache/chromium` (git-ignored)."""
  if os.environ.get("DREAMJAX_CHROMIUM_DIR"):
    return Path(os.environ["DREAMJAX_CHROMIUM_DIR"])
  return Path(__file__).resolve().parents[2] / ".cache" / "chromium"


def _write_atomic(path: Path, text: str, mode: int) -> None:
  # Pool workers may configure at the same time; a rename never exposes a half-written script.
  tmp = path.with_name(f".{path.name}.{os.getpid()}")
  tmp.write_text(text)
  tmp.chmod(mode)
  os.replace(tmp, path)


def wrapper_script(binary: str) -> str:
  """The shell script Playwright runs as its chrome: the system Chromium with CHROMIUM_FLAGS and DISABLED_FEATURES.

  Chromium obeys only the last --disable-features switch (measured), and Playwright and BrowserGym each pass a list
  (BrowserGym's used to silently replace Playwright's, MediaRouter and Translate among it), so the script folds every
  list it is given and ours into one, last on the command line. Arguments are passed on unchanged otherwise. `exec`,
  so the process Playwright started is Chromium itself and closing the browser leaves no shell behind."""
  return (
      "#!/bin/sh\n"
      f"disabled={shlex.quote(','.join(DISABLED_FEATURES))}\n"
      "for arg do\n"
      "  shift\n"
      "  case $arg in\n"
      "    --disable-features=*) disabled=\"$disabled,${arg#--disable-features=}\" ;;\n"
      "    *) set -- \"$@\" \"$arg\" ;;\n"
      "  esac\n"
      "done\n"
      f'exec {shlex.join([binary, *CHROMIUM_FLAGS])} "$@" "--disable-features=$disabled"\n')


def configure_chromium(cache_dir: str | os.PathLike | None = None, chromium: str = DEFAULT_CHROMIUM,
                       set_miniwob_url: bool = True) -> ChromiumSetup:
  """Writes the wrapper (idempotent) and sets PLAYWRIGHT_BROWSERS_PATH and, unless already set, MINIWOB_URL."""
  binary = shutil.which(chromium) or chromium
  if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
    raise FileNotFoundError(f"no Chromium at {chromium}: BrowserGym/MiniWoB need Debian's Chromium here "
                            f"(Playwright's own download does not work offline). Install it with: {INSTALL_HINT}")
  revision = playwright_chromium_revision()
  root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
  chrome_dir = root / f"chromium-{revision}" / "chrome-linux"
  chrome_dir.mkdir(parents=True, exist_ok=True)
  wrapper = root / "chromium-wrapper.sh"
  script = wrapper_script(binary)
  if not wrapper.is_file() or wrapper.read_text() != script:
    _write_atomic(wrapper, script, 0o755)
  link = chrome_dir / "chrome"
  if not (link.is_symlink() and os.readlink(link) == str(wrapper)):
    tmp = chrome_dir / f".chrome.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(wrapper)
    os.replace(tmp, link)
  os.environ["PLAYWRIGHT_BROWSERS_PATH"] = str(root)
  if set_miniwob_url and not os.environ.get("MINIWOB_URL"):
    os.environ["MINIWOB_URL"] = miniwob_html_url()
  return ChromiumSetup(root, link, revision, os.environ.get("MINIWOB_URL", ""))
