"""Multi-process (multi-host) runs: `jax.distributed.initialize` from config or environment, and the few host-side
helpers a loop needs when several JAX processes run the same program.

Where the settings come from, first match wins per field:
1. `DistributedConfig`'s own fields (`coordinator_address`, `num_processes`, `process_id`, `local_device_ids`);
2. the environment, one convention: `JAX_COORDINATOR_ADDRESS` (host:port of process 0's coordinator service),
   `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, `JAX_LOCAL_DEVICE_IDS` (comma-separated). JAX itself reads only the first
   and the last; the other two are read here so that any launcher (a shell loop, a job template) can set all four alike;
3. a cluster JAX bootstraps by itself, left to `jax.distributed.initialize` (fields still unknown are passed as None).
   It detects, and `auto` below recognises by the same variables:
   - SLURM: all of `SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`, `SLURM_PROCID`, `SLURM_LOCALID` (set inside
     an `srun` step; a bare `sbatch` script lacks the step variables); processes: `SLURM_NTASKS`;
   - Open MPI (ORTE, i.e. Open MPI 4): `OMPI_MCA_orte_hnp_uri`; processes: `OMPI_COMM_WORLD_SIZE`;
   - Cloud TPU VMs (GCE via the metadata server, GKE via `TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES`,
     multislice via `MEGASCALE_*`).
   Under SLURM and Open MPI, JAX assumes one process per accelerator (it sets `local_device_ids` to the local rank)
   unless `local_device_ids` / `JAX_LOCAL_DEVICE_IDS` says otherwise: with one process per host, list the host's
   devices there. Kubernetes (JAX's `k8s` detector) and mpi4py are not recognised by `auto`: use the variables of 2.,
   or `enabled="on"` to let JAX try every detector it has.

`enabled`: `off` never initialises; `on` always does (an error when nothing says how); `auto` (the default)
initialises only when a multi-process run is described: an explicit or environment `num_processes` above 1, a SLURM
step or Open MPI job of more than one task, or a Cloud TPU VM (where the host count comes from the metadata server, so
JAX decides; a single-host TPU VM then becomes a one-process cluster, which changes nothing). So single-process runs
and tests are untouched. Inconsistent settings (a process id without a process count, `process_id >=
num_processes`, an unparseable variable) are errors that name the field or variable. `initialize` runs
`jax.distributed.initialize` at most once per process and must come before anything touches devices.

After initialisation `jax.devices()` lists every process's devices, so a mesh built from it spans the whole cluster.
Arrays sharded over it are not fully addressable from any one process: `to_host` fetches them (a collective that
every process must call, in the same order; `leaf_to_host` one leaf at a time, as a model export must), `to_devices` places host arrays that every process holds alike,
`check_same` verifies cheaply that they do, `is_primary` picks the one writer of files, `barrier` orders a write
before other processes read it.

Known limit of CPU clusters (jaxlib 0.10.2): their collectives run over Gloo, which sets up a device group's
communicator the first time a program runs a collective over it, and each process then waits at most 30 s (fixed
in jaxlib, not configurable) for the others to arrive. A process that compiles that program much more slowly, e.g. on
a host loaded by other jobs, fails the run with "Gloo context initialization failed: DEADLINE_EXCEEDED". Run CPU
clusters on hosts with a core to spare per process (the limit is Gloo's, so CPU-only).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("auto", "on", "off")
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
# The variables JAX's own SLURM and Open MPI detectors require (jax/_src/clusters/{slurm,ompi}_cluster.py).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_URI = "OMPI_MCA_orte_hnp_uri"
TPU_HOST_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-process run; empty fields come from the environment (module docstring)."""

  coordinator_address: str = ""  # host:port of process 0's coordinator service
  num_processes: int = 0  # 0: from JAX_NUM_PROCESSES or the cluster
  process_id: int = -1  # -1: from JAX_PROCESS_ID or the cluster
  local_device_ids: tuple[int, ...] = ()  # devices this process drives; empty: JAX_LOCAL_DEVICE_IDS, else JAX's default
  enabled: str = "auto"  # auto | on | off
  initialization_timeout: int = 300  # seconds to wait for every process to connect

  def __post_init__(self):
    if self.enabled not in MODES:
      raise ValueError(f"DistributedConfig.enabled must be one of {MODES}, got {self.enabled!r}")
    if self.num_processes < 0:
      raise ValueError(f"DistributedConfig.num_processes must be >= 0 (0: from the environment), got "
                       f"{self.num_processes}")
    if self.process_id < -1:
      raise ValueError(f"DistributedConfig.process_id must be >= 0 (-1: from the environment), got {self.process_id}")
    if any(i < 0 for i in self.local_device_ids):
      raise ValueError(f"DistributedConfig.local_device_ids must be >= 0, got {self.local_device_ids}")
    if self.initialization_timeout < 1:
      raise ValueError(f"DistributedConfig.initialization_timeout must be >= 1, got {self.initialization_timeout}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The arguments `initialize` passes to `jax.distributed.initialize` (None: left to JAX's cluster detection), and
  where the settings came from ("config", "env", "slurm", "ompi", "tpu", joined with "+")."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  local_device_ids: tuple[int, ...] | None
  source: str


def _env_int(environ: Mapping[str, str], name: str, low: int) -> int | None:
  raw = environ.get(name, "").strip()
  if not raw:
    return None
  try:
    value = int(raw)
  except ValueError:
    raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
  if value < low:
    raise ValueError(f"environment variable {name}={raw!r} must be >= {low}")
  return value


def _env_ids(environ: Mapping[str, str]) -> tuple[int, ...] | None:
  raw = environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
  if not raw:
    return None
  try:
    ids = tuple(int(s) for s in raw.split(","))
  except ValueError:
    raise ValueError(f"environment variable {ENV_LOCAL_DEVICE_IDS}={raw!r} is not a comma-separated list of "
                     f"device ids") from None
  if any(i < 0 for i in ids):
    raise ValueError(f"environment variable {ENV_LOCAL_DEVICE_IDS}={raw!r}: device ids must be >= 0")
  return ids


def _on_cloud_tpu_vm() -> bool:
  # Set by `import jax` (cloud_tpu_init) when libtpu and TPU chips are present; not public API, hence the getattr.
  from jax._src import cloud_tpu_init

  return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def detect_cluster(environ: Mapping[str, str] | None = None, tpu_vm: bool | None = None) -> tuple[str, int | None] | None:
  """(cluster name, its process count or None when only JAX can tell) of a cluster JAX bootstraps by itself, or
  None. `tpu_vm` overrides the Cloud TPU VM check (tests)."""
  environ = os.environ if environ is None else environ
  if all(v in environ for v in SLURM_VARS):
    return "slurm", _env_int(environ, "SLURM_NTASKS", 1)
  if OMPI_URI in environ:
    return "ompi", _env_int(environ, "OMPI_COMM_WORLD_SIZE", 1)
  if _on_cloud_tpu_vm() if tpu_vm is None else tpu_vm:
    hosts = next((environ[v] for v in TPU_HOST_LISTS if environ.get(v)), None)
    slices = _env_int(environ, "MEGASCALE_NUM_SLICES", 1) or 1
    return "tpu", None if hosts is None else len(hosts.split(",")) * slices
  return None


def plan(cfg: DistributedConfig = DistributedConfig(), environ: Mapping[str, str] | None = None,
         tpu_vm: bool | None = None) -> Plan | None:
  """What `initialize` would do, without doing it: None (stay single-process) or the `Plan`; raises a ValueError
  naming the field or variable when the settings are inconsistent."""
  if cfg.enabled == "off":
    return None
  environ = os.environ if environ is None else environ
  sources = []

  def pick(own: Any, from_env: Any) -> Any:
    """The config's value, else the environment's (None: neither has one)."""
    if own is not None:
      sources.append("config")
      return own
    if from_env is not None:
      sources.append("env")
    return from_env

  coordinator = pick(cfg.coordinator_address or None, environ.get(ENV_COORDINATOR, "").strip() or None)
  num = pick(cfg.num_processes or None, _env_int(environ, ENV_NUM_PROCESSES, 1))
  pid = pick(cfg.process_id if cfg.process_id >= 0 else None, _env_int(environ, ENV_PROCESS_ID, 0))
  ids = pick(cfg.local_device_ids or None, _env_ids(environ))
  cluster = detect_cluster(environ, tpu_vm)
  names = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES, "process_id": ENV_PROCESS_ID}

  def field(name: str) -> str:
    return f"DistributedConfig.{name} (or {names[name]})"

  if num is not None and pid is not None and pid >= num:
    raise ValueError(f"{field('process_id')} is {pid}, not below {field('num_processes')} = {num}")
  if cluster is None:
    if num is None and (coordinator is not None or pid is not None):
      given = "coordinator_address" if coordinator is not None else "process_id"
      raise ValueError(f"{field(given)} is set but {field('num_processes')} is not; set all three of "
                       f"coordinator_address, num_processes and process_id, or none")
    if num is not None and num > 1:
      for name, value in (("coordinator_address", coordinator), ("process_id", pid)):
        if value is None:
          raise ValueError(f"{field('num_processes')} is {num} but {field(name)} is not set (and no SLURM, Open MPI "
                           f"or Cloud TPU environment was found to supply it)")
  count = num if num is not None else (cluster[1] if cluster is not None else None)  # None: JAX will tell
  if cfg.enabled == "auto" and (count == 1 or (cluster is None and num is None)):
    return None
  if cluster is None and num is None:
    raise ValueError("DistributedConfig.enabled is 'on' but nothing describes the processes: set "
                     "coordinator_address, num_processes and process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                     "JAX_PROCESS_ID), or run under SLURM, Open MPI or on a Cloud TPU VM")
  if cluster is None and coordinator is None:  # `on` with num_processes 1 (above 1 it was an error already)
    raise ValueError(f"DistributedConfig.enabled is 'on' with one process: {field('coordinator_address')} is needed")
  if cluster is not None:
    sources.append(cluster[0])
  return Plan(coordinator, num, pid, ids, "+".join(s for s in ("config", "env", "slurm", "ompi", "tpu") if s in sources))


def initialize(cfg: DistributedConfig = DistributedConfig()) -> None:
  """Joins the multi-process run `cfg` and the environment describe (see `plan`); a no-op for single-process runs and
  when this process has already joined. Call it before anything touches devices."""
  if jax.distributed.is_initialized():
    return
  p = plan(cfg)
  if p is None:
    return
  try:
    jax.distributed.initialize(coordinator_address=p.coordinator_address, num_processes=p.num_processes,
                               process_id=p.process_id,
                               local_device_ids=list(p.local_device_ids) if p.local_device_ids else None,
                               initialization_timeout=cfg.initialization_timeout)
  except (RuntimeError, ValueError) as e:
    raise type(e)(f"dreamjax.parallel.initialize ({p}): {e}") from e


def is_primary() -> bool:
  """Process 0: the one that writes run files (metrics, summaries, exported models)."""
  return jax.process_index() == 0


# How long the other processes wait while process 0 alone does host work (`barrier(..., host_work=True)`).
HOST_WORK_TIMEOUT_S = 7 * 24 * 3600
_barrier_uses: dict[str, int] = {}


def barrier(name: str, host_work: bool = False) -> None:
  """Blocks until every process reaches the barrier of this name (a no-op with one process). By default a device
  collective. `host_work=True` is for processes that wait while process 0 alone works on the host for as long as it
  takes (collecting episodes, asking a teacher): they wait at the coordination service's barrier instead, up to
  `HOST_WORK_TIMEOUT_S`, where a collective gives up after XLA's collective timeout."""
  if jax.process_count() == 1:
    return
  if not host_work:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
    return
  from jax._src import distributed as jax_distributed  # the client JAX's own serialization waits on

  # A coordination-service barrier id is used once: every process counts its uses in the same order.
  _barrier_uses[name] = _barrier_uses.get(name, 0) + 1
  jax_distributed.global_state.client.wait_at_barrier(f"dreamjax:{name}:{_barrier_uses[name]}",
                                                      timeout_in_ms=HOST_WORK_TIMEOUT_S * 1000)


def from_primary(value: int) -> int:
  """Process 0's `value` on every process (a collective every process must call; with one process, `value` itself):
  for a decision all processes must take alike where only process 0's view is sure, as whether a file process 0
  writes exists yet (another process may look before or after process 0 wrote it)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils

  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def to_devices(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` for host (NumPy) arrays that every process holds whole and alike, as when all
  run the same program: each process places only its own devices' blocks. `device_put` itself would first all-gather
  every array from every process to check they agree (`multihost_utils.assert_equal`): a compilation per shape and
  the whole batch over the network on each call. jax.Arrays are resharded by `device_put` as usual."""

  def one(x, sharding):
    if isinstance(x, jax.Array) or sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, tree, shardings)


def check_same(what: str, *arrays: Any) -> None:
  """Raises a RuntimeError naming `what` when the processes hold different `arrays`, e.g. rollouts that diverged
  because an env is not deterministic. Compares SHA-256 digests, so 32 bytes per process cross the network. A
  collective (every process calls it at the same point); a no-op with one process."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  digest = hashlib.sha256()
  for a in arrays:
    digest.update(np.ascontiguousarray(a).tobytes())
  digests = np.asarray(multihost_utils.process_allgather(np.frombuffer(digest.digest(), np.uint8)))
  differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
  if differ:
    raise RuntimeError(f"{what} differs between process 0 and processes {differ}: every process must run the same "
                       f"program on the same data (is an env not deterministic?)")


def _identity(x: Any) -> Any:
  return x


def to_host(tree: Any) -> Any:
  """A tree of arrays as NumPy arrays, whole (PRNG keys as their key data). Arrays sharded over other processes'
  devices are first resharded to replicated, in one jitted identity for the whole tree (the per-leaf
  `process_allgather` compiles once per leaf shape); that is a collective: with several processes every one must call
  this on the same tree at the same point. With one process (or replicated arrays) it is `jax.device_get`."""
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [jax.random.key_data(x) if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x for x in leaves]
  gather = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated]
  if gather:
    from jax.sharding import NamedSharding, PartitionSpec

    for i in gather:
      if not isinstance(leaves[i].sharding, NamedSharding):
        raise TypeError(f"to_host: leaf {i} has a {type(leaves[i].sharding).__name__}; only NamedSharding arrays "
                        f"spanning several processes can be gathered")
    replicated = [leaves[i].sharding.update(spec=PartitionSpec()) for i in gather]
    out = jax.jit(_identity, out_shardings=replicated)([leaves[i] for i in gather])
    for i, x in zip(gather, out):
      leaves[i] = x.addressable_data(0)
  return jax.tree.unflatten(treedef, [np.asarray(x) if isinstance(x, jax.Array) else x
                                      for x in jax.device_get(leaves)])


# Rows of a leaf gathered per step of an export (`leaf_to_host`): at most this many bytes in the export dtype, so a
# device holds about three blocks (XLA's temporaries included, measured on CPU), not the leaf: an 8B model's
# float32 embedding is 2 GiB.
EXPORT_BLOCK_BYTES = 1 << 27


def export_blocks(shape: tuple[int, ...], dtype: Any) -> list[tuple[int, int]]:
  """The (start, stop) row ranges along the first axis that `leaf_to_host` gathers one at a time."""
  if not shape:
    return [(0, 0)]
  row = math.prod(shape[1:]) * jnp.dtype(dtype).itemsize
  step = max(1, EXPORT_BLOCK_BYTES // max(1, row))
  return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


@functools.lru_cache(maxsize=256)  # one jitted function per block and layout: jit caches per function object
def export_program(sharding: jax.sharding.Sharding, dtype: Any, start: int, stop: int) -> Any:
  """The jitted program `leaf_to_host` runs, per block, on an array that spans other processes: rows [start, stop)
  cast to `dtype` and replicated on every device, so this process can read them. The bounds are static: a dynamic
  slice of a sharded axis made XLA gather the whole axis first. An export of 32 alike layers compiles each block of
  each kind of leaf once. Exposed so tests/test_memory.py can compile it on the fake mesh and read its bytes."""
  from jax.sharding import NamedSharding, PartitionSpec

  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"export_program: a {type(sharding).__name__}; only NamedSharding arrays spanning several "
                    f"processes can be gathered")
  return jax.jit(functools.partial(_rows, start=start, stop=stop, dtype=dtype),
                 out_shardings=sharding.update(spec=PartitionSpec()))


def _rows(x: jax.Array, start: int, stop: int, dtype: Any) -> jax.Array:
  return (x[start:stop] if x.ndim else x).astype(dtype)


_cast_in_place = jax.jit(lambda x, dtype: x.astype(dtype), static_argnames="dtype")  # keeps x's sharding


def leaf_to_host(x: Any, dtype: Any = None) -> np.ndarray:
  """One array whole as a NumPy array, cast to `dtype` first (None: its own) on its devices, so a bfloat16 export
  moves half the bytes. The whole-tree `to_host` replicates every leaf on every device at once (a float32 8B model
  does not fit a 32 GiB chip beside its training state); a model export goes leaf by leaf with this. An array that
  spans other processes comes over in blocks of rows (`export_blocks`, `export_program`), each a collective: every
  process calls this on the same leaves in the same order. Otherwise the host assembles the shards and no device
  holds more than its own shard (and its cast)."""
  if not isinstance(x, jax.Array):
    out = np.asarray(x)
    return out if dtype is None else out.astype(dtype)
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  if x.is_fully_addressable or x.is_fully_replicated:
    if x.dtype != dtype:
      x = _cast_in_place(x, dtype=dtype)
    return np.asarray(jax.device_get(x if x.is_fully_addressable else x.addressable_data(0)))
  return gather_blocks(x, dtype)


def gather_blocks(x: jax.Array, dtype: Any) -> np.ndarray:
  """`x` whole on the host in `dtype`, fetched block by block through replicated copies (`export_program`): the path
  `leaf_to_host` takes for arrays spanning processes, callable on any NamedSharding array so one process can test it."""
  out = np.empty(x.shape, dtype)
  for start, stop in export_blocks(x.shape, dtype):
    block = np.asarray(export_program(x.sharding, dtype, start, stop)(x).addressable_data(0))
    if x.ndim:
      out[start:stop] = block
    else:
      out[...] = block
  return out


def spans_every_process(mesh: jax.sharding.Mesh, what: str) -> jax.sharding.Mesh:
  """`mesh`, checked to hold devices of every process: a process with none could not take part in gathering its
  outputs (`to_host`), so a multi-process run would fail later with an unclear error."""
  missing = sorted(set(range(jax.process_count())) - {d.process_index for d in mesh.devices.flat})
  if missing:
    raise ValueError(f"{what}: the mesh's {mesh.devices.size} devices include none of processes {missing}; in a "
                     f"multi-process run the mesh must span every process (jax.devices() lists process 0's devices "
                     f"first, so taking the first devices cuts whole processes off)")
  return mesh
