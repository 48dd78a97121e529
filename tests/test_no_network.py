"""Nothing reaches the network: a MiniWoB episode on Chromium and an offline W&B run, each in a subprocess under
`strace -f`, make no connection (and send no datagram) to any address outside loopback and look up no name; the
TextWorld-Express JVM's py4j gateway refuses clients without its token.

Under strace, "network" means an AF_INET/AF_INET6 address in connect, sendto, sendmsg or sendmmsg that is not
127.0.0.0/8 or ::1, or any address on port 53 (a DNS server, loopback ones such as systemd-resolved's included).
Unix sockets and netlink are local. A UDP connect sends no packet, but Chromium's only such connect is the probe it
makes before looking a name up, so it is counted too.
"""

import importlib.util
import ipaddress
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dreamjax.envs.chromium import CHROMIUM_FLAGS, DEFAULT_CHROMIUM, DISABLED_FEATURES, INSTALL_HINT, wrapper_script

REPO = Path(__file__).resolve().parents[1]
STRACE = shutil.which("strace")
TRACED_CALLS = "connect,sendto,sendmsg,sendmmsg"
# One socket address as strace 5/6 prints it: sa_family, port, then the address, inet_pton(AF_INET6, "...") for IPv6.
_ADDRESS = re.compile(r'sa_family=(AF_INET6?),[^{}]*?htons\((\d+)\)[^{}]*?'
                      r'(?:inet_addr|inet_pton)\((?:AF_INET6?, )?"([^"]+)"')
_CALL = re.compile(r"^\d+\s+(?:<\.\.\. )?(\w+)\(")


def outside_traffic(trace: str) -> list[str]:
  """The lines of an `strace -f` log that reach the network: an IPv4/IPv6 address outside loopback, or port 53."""
  hits = []
  for line in trace.splitlines():
    call = _CALL.match(line)
    if not call or call[1] not in TRACED_CALLS.split(","):
      continue
    for _, port, address in _ADDRESS.findall(line):
      ip = ipaddress.ip_address(address.split("%")[0])
      mapped = getattr(ip, "ipv4_mapped", None)
      if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)) or int(port) == 53:
        hits.append(line.strip())
  return hits


def _v6(pid: int, port: int, address: str) -> str:
  """An IPv6 connect line as strace 6 prints it."""
  return (f"{pid} connect(9, {{sa_family=AF_INET6, sin6_port=htons({port}), sin6_flowinfo=htonl(0), "
          f'inet_pton(AF_INET6, "{address}", &sin6_addr), sin6_scope_id=0}}, 28) = 0')


def test_outside_traffic_reads_strace_lines():
  trace = "\n".join([
      _v6(101, 443, "2001:4860:4860::8888"),
      '101 connect(22, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, 16) = 0',
      '102 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.53")}, 16) = 0',
      '103 sendto(5, "x", 1, 0, {sa_family=AF_INET, sin_port=htons(1900), sin_addr=inet_addr("239.255.255.250")}, 16)',
      '104 connect(8, {sa_family=AF_INET, sin_port=htons(41234), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
      _v6(104, 8080, "::1"),
      _v6(104, 8080, "::ffff:127.0.0.1"),
      '105 connect(27, {sa_family=AF_UNIX, sun_path="/run/dbus/system_bus_socket"}, 29) = -1 ENOENT',
      "105 sendmsg(32, {msg_name={sa_family=AF_NETLINK, nl_pid=0, nl_groups=00000000}, msg_namelen=12}, 0) = 20",
      '106 connect(4, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("93.184.216.34")}, 16 <unfinished',
      "106 <... connect resumed>)             = -1 EINPROGRESS (Operation now in progress)",
  ])
  hits = outside_traffic(trace)
  assert [h.split()[0] for h in hits] == ["101", "101", "102", "103", "106"], hits


def _traced(tmp_path: Path, code: str, *args: str, env: dict[str, str] | None = None,
            timeout: int = 240) -> tuple[str, str]:
  """Runs `code` in a fresh Python under strace, in `env` (default: ours); returns (its stdout, the trace). Skips
  where tracing is impossible."""
  if STRACE is None:
    pytest.skip("needs strace (apt-get install -y strace; tools/install_system_deps.sh installs it)")
  probe = subprocess.run([STRACE, "-f", "-o", os.devnull, "-e", "trace=connect", "true"], capture_output=True,
                         text=True, timeout=60)
  if probe.returncode != 0:
    pytest.skip(f"strace cannot trace here (ptrace not permitted?): {probe.stderr.strip()[-300:]}")
  log = tmp_path / "strace.log"
  run_env = {**(os.environ if env is None else env), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  proc = subprocess.run([STRACE, "-f", "-qq", "-e", f"trace={TRACED_CALLS}", "-e", "signal=none", "-o", str(log),
                         sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, env=run_env,
                        timeout=timeout)
  assert proc.returncode == 0, f"traced run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  return proc.stdout, log.read_text()


# --- Chromium ---------------------------------------------------------------------------------------------------------

_EPISODE = """
import sys
from dreamjax.envs.miniwob import MiniWobEnv, tasks

env = MiniWobEnv(chromium_dir=sys.argv[1], max_steps=5)
env.reset(tasks("click-button", "eval", 1)[0])
steps, done = 0, False
while not done:
  result = env.step(env.expert_action() or "noop()")
  steps, done = steps + 1, result.done
env.close()
print(f"episode steps={steps} success={result.success}")
"""


def test_miniwob_episode_stays_off_the_network(tmp_path):
  if not os.path.exists(DEFAULT_CHROMIUM):
    pytest.skip(f"needs Debian's Chromium: {INSTALL_HINT}")
  if importlib.util.find_spec("browsergym") is None or importlib.util.find_spec("miniwob") is None:
    pytest.skip("needs browsergym-miniwob and miniwob (pip install -e .[envs])")
  out, trace = _traced(tmp_path, _EPISODE, str(tmp_path / "chromium"))
  assert "episode steps=" in out, out
  hits = outside_traffic(trace)
  assert not hits, f"{len(hits)} connections/datagrams left loopback during a MiniWoB episode:\n" + "\n".join(hits[:20])


def test_chromium_wrapper_merges_feature_lists(tmp_path):
  # Chromium obeys only the last --disable-features; Playwright and BrowserGym each pass one. A stand-in binary that
  # prints its arguments shows what Chromium would get.
  argdump = tmp_path / "argdump"
  argdump.write_text('#!/bin/sh\nfor a do printf "%s\\n" "$a"; done\n')
  argdump.chmod(0o755)
  wrapper = tmp_path / "wrapper.sh"
  wrapper.write_text(wrapper_script(str(argdump)))
  wrapper.chmod(0o755)
  got = subprocess.run([str(wrapper), "--headless", "--disable-features=A,B", "--user-data-dir=/tmp/x y",
                        "--disable-features=C"], capture_output=True, text=True, check=True).stdout.splitlines()
  assert got[:len(CHROMIUM_FLAGS)] == list(CHROMIUM_FLAGS)
  assert got[len(CHROMIUM_FLAGS):] == ["--headless", "--user-data-dir=/tmp/x y",
                                       "--disable-features=" + ",".join((*DISABLED_FEATURES, "A", "B", "C"))]
  rules = [f for f in CHROMIUM_FLAGS if f.startswith("--host-resolver-rules=")]
  assert rules == ["--host-resolver-rules=MAP * ^NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"]


# --- W&B --------------------------------------------------------------------------------------------------------------

_OFFLINE_RUN = """
import sys
from dreamjax.loop.track import Tracker, TrackConfig

with Tracker(sys.argv[1], {"lr": 0.1}, TrackConfig(wandb="offline")) as tracker:
  for step in range(3):
    tracker.log(step, {"loss": 1.0 / (step + 1)})
  tracker.summary({"final_loss": 1.0 / 3})
print("run", tracker.run_id)
"""


def test_offline_wandb_stays_off_the_network(tmp_path):
  if importlib.util.find_spec("wandb") is None:
    pytest.skip("needs wandb")
  # The user's W&B settings are left out so the run shows what offline does by default (no key, no mode, no server).
  env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
  out_dir = tmp_path / "run"
  out, trace = _traced(tmp_path, _OFFLINE_RUN, str(out_dir), env=env)
  run_id = out.split()[-1]
  assert list((out_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")), out
  hits = outside_traffic(trace)
  assert not hits, "an offline W&B run reached the network or DNS:\n" + "\n".join(hits[:20])


# --- TextWorld-Express ------------------------------------------------------------------------------------------------


def test_twx_gateway_refuses_clients_without_its_token():
  if shutil.which("java") is None or importlib.util.find_spec("textworld_express") is None:
    pytest.skip("needs Java and textworld-express (tools/install_system_deps.sh, pip install -e .[envs])")
  from py4j.java_gateway import GatewayParameters, JavaGateway
  from py4j.protocol import Py4JError

  from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks

  env = TextWorldExpressEnv()
  try:
    env.reset(tasks("coin", "train", 1, env=env)[0])  # the JVM is up and serves us through the token
    params = env._twx._gateway.gateway_parameters
    assert params.auth_token and params.address == "127.0.0.1"
    for token in (None, "x" * len(params.auth_token)):  # another local user: no token, or a guess
      intruder = JavaGateway(gateway_parameters=GatewayParameters(port=params.port, auth_token=token))
      try:
        with pytest.raises(Py4JError):
          intruder.jvm.java.lang.System.getProperty("user.name")
      finally:
        intruder.close()
    assert env._twx._gateway.get_callback_server() is None  # no Python-side server for anyone to call either
    assert env.step(env.expert_action()).observation.state  # our own connection still works
  finally:
    env.close()
