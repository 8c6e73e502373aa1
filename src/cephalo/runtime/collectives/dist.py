"""Process-group start-up and teardown under `torchrun` (or none, for one process).

`init_distributed()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), picks the backend (NCCL when CUDA is available, else gloo), binds
the CUDA device from LOCAL_RANK, initialises the default process group WITH a timeout (a
collective that never completes then fails instead of hanging forever) and returns the
`Comm` for it. Without the torchrun environment it returns a `LocalComm` (world size 1, no
process group), so the same training code runs as a plain script.
"""

from __future__ import annotations

import datetime
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError, first_line
from cephalo.log import logger
from cephalo.runtime.collectives.comm import Comm, LocalComm, make_comm

MIN_TORCH = (2, 4)
_BACKENDS = ("gloo", "nccl")


def check_torch_version(version: str | None = None) -> None:
    """Raise `CephaloError` if torch is older than `MIN_TORCH` (FSDP2-era collectives and
    the process-group timeout semantics the runtime relies on)."""
    version = version or torch.__version__
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError as err:
        raise CephaloError(f"cannot parse the torch version {version!r}") from err
    if (major, minor) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise CephaloError(
            f"torch {version} is too old: cephalo needs torch >= {need}; upgrade torch"
        )


def _env_int(name: str, env: dict[str, str]) -> int:
    raw = env.get(name)
    if raw is None:
        raise CephaloError(
            f"{name} is not set but RANK/WORLD_SIZE are: launch with torchrun, or set RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together"
        )
    try:
        return int(raw)
    except ValueError:
        raise CephaloError(f"{name}={raw!r} is not an integer") from None


LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
)
"""Where a launcher says which process of its node this is: torchrun, SLURM's srun, Open MPI,
MPICH. The first one set counts."""


def _local_rank(env: dict[str, str], world_size: int) -> int:
    """This process's index on its node, which picks its GPU. Without any launcher's variable
    it is 0 only where that cannot be wrong (one process, or no more than one CUDA device):
    two ranks of one node would otherwise share GPU 0 and run out of its memory."""
    for name in LOCAL_RANK_VARIABLES:
        if env.get(name, "") != "":
            try:
                return int(env[name])
            except ValueError:
                raise CephaloError(f"{name}={env[name]!r} is not an integer") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size > 1 and gpus > 1:
        raise CephaloError(
            f"RANK and WORLD_SIZE are set but not LOCAL_RANK (nor {', '.join(LOCAL_RANK_VARIABLES[1:])}), "
            f"and this node has {gpus} GPUs: cephalo cannot tell which one is this rank's. Launch "
            "with torchrun (it sets LOCAL_RANK), or set LOCAL_RANK to the process's index on its node"
        )
    return 0


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in _BACKENDS:
        raise CephaloError(f"unknown distributed backend {backend!r}; use one of {_BACKENDS}")
    if not dist.is_available():
        raise CephaloError(
            "this torch build has no torch.distributed; install a standard torch build"
        )
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise CephaloError(
            "backend 'nccl' needs CUDA GPUs and a torch build with NCCL; none here. Use 'gloo' "
            "(CPU) or run on a machine with GPUs"
        )
    if backend == "gloo" and not dist.is_gloo_available():
        raise CephaloError("this torch build has no gloo backend; use 'nccl' on GPUs")
    return backend


SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's c10d rendezvous shares its TCPStore with the workers by default, and a restarted
worker group reuses it without a fresh key prefix: the new process group reads the dead
group's addresses and cannot connect (pytorch/pytorch#135712). Setting this variable to 1 for
the agent gives every round its own store; `cephalo run` sets it, torchrun users must."""


def uses_shared_store(env: dict[str, str]) -> bool:
    """Started by a torchrun agent that shares its rendezvous store with the workers."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restarted_on_shared_store(env: dict[str, str]) -> bool:
    """A restarted worker group on a shared store (see `SHARED_STORE_ENV`)."""
    return uses_shared_store(env) and env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 300.0,
    comm_impl: str = "auto",
    validate: bool | None = None,
) -> Comm:
    """Initialise the default process group from the torchrun environment and return its
    `Comm` (a `LocalComm` without that environment). Calling it again reuses the group."""
    check_torch_version()
    if timeout_s <= 0:
        raise CephaloError(f"timeout_s must be positive, got {timeout_s}")
    env = dict(os.environ)
    if "RANK" not in env and "WORLD_SIZE" not in env:
        if dist.is_available() and dist.is_initialized():
            return make_comm(comm_impl, validate=validate)
        if backend is not None:
            _pick_backend(backend)  # still report an unusable backend clearly
        return LocalComm(validate=validate)
    rank, world_size = _env_int("RANK", env), _env_int("WORLD_SIZE", env)
    local_rank = _local_rank(env, world_size)
    if not 0 <= rank < world_size:
        raise CephaloError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    backend = _pick_backend(backend)
    if torch.cuda.is_available() and backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise CephaloError(
                f"LOCAL_RANK={local_rank} but this node has {count} CUDA device(s); start at "
                "most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        if dist.get_backend() != backend:
            logger.warning(
                "process group already initialised with %s (asked for %s)",
                dist.get_backend(),
                backend,
            )
        return make_comm(comm_impl, validate=validate)
    if rank == 0 and uses_shared_store(env) and env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        logger.warning(
            "torchrun shares its rendezvous store with the workers: a restart will not be able to "
            "start its process group (pytorch#135712); launch torchrun with %s=1",
            SHARED_STORE_ENV,
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise CephaloError(
                f"{name} is not set: launch with torchrun, or set it for rank 0's host"
            )
    try:
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # NCCL binds the communicator to this rank's own GPU (without it, a barrier guesses
            # GPU = rank % GPUs per node, wrong on nodes with different GPU counts)
            **({"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}),
        )
    except (RuntimeError, ValueError, TimeoutError) as err:
        hint = (
            f" This is restart {env['TORCHELASTIC_RESTART_COUNT']} under torchrun's shared rendezvous "
            f"store, which still holds the previous attempt's addresses: launch with "
            f"{SHARED_STORE_ENV}=1 (`cephalo run` sets it)"
            if restarted_on_shared_store(env)
            else " Check that every rank was started with the same MASTER_ADDR/MASTER_PORT and "
            "WORLD_SIZE and can reach rank 0"
        )
        raise CephaloError(
            f"could not start the {backend} process group (rank {rank} of {world_size}, "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}): {first_line(err)}.{hint}"
        ) from err
    logger.info(
        "rank %d/%d: %s process group up (timeout %.0fs)", rank, world_size, backend, timeout_s
    )
    if world_size > 1:
        _FailureWatch.start(rank)
    return make_comm(comm_impl, validate=validate)


# ------------------------------------------------------------------ a rank's failure, for all
# A rank that fails (out of memory, a bad batch, any error) while the others wait in a
# collective would leave them there until the process-group timeout: torchrun kills the
# workers of its own node when one dies, but not those of other nodes, nor processes started
# without it. So the failing rank announces its error in the process group's store, and every
# rank watches that key: the others abort their process group (their pending collective then
# raises) and stop with the failing rank's message, within `_WATCH_INTERVAL_S`.
_WATCH_INTERVAL_S = 0.5


FAILURE_KEY_PREFIX = "cephalo/failed/"


def failure_key(rank: int) -> str:
    """The store key a failing rank of this rendezvous round announces under (collective:
    every rank of the default group calls it once, at start-up). Not the restart count
    (`TORCHELASTIC_RESTART_COUNT`): torchrun agents that joined the rendezvous in different
    rounds count restarts differently, so a failing rank's peers would look under another key
    and miss it, and see an older round's announcement left in a shared store. Rank 0 draws
    a random round id and broadcasts it over the new process group, whose members are exactly
    this round's ranks: one key every rank of the round agrees on, and no other round has."""
    box = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return f"{FAILURE_KEY_PREFIX}{box[0]}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class _FailureWatch:
    """The thread that watches for another rank's announced failure (see above)."""

    _instance: _FailureWatch | None = None

    def __init__(self, rank: int, store, key: str) -> None:
        self.rank, self.store, self.key = rank, store, key
        self.message: str | None = None
        """The failing rank's announcement, once seen."""
        self.announced = False
        """This rank announced its own failure (it does not abort itself on seeing it)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cephalo-failure-watch", daemon=True)

    @classmethod
    def start(cls, rank: int, watch: bool = True) -> None:
        """Agree on this round's key (collective) and watch it; `watch=False`: the key and
        the announcements without the thread that aborts the group (tests)."""
        cls.stop()
        store = _store()
        if store is None:
            return
        cls._instance = cls(rank, store, failure_key(rank))
        if watch:
            cls._instance._thread.start()

    @classmethod
    def stop(cls) -> None:
        if cls._instance is not None:
            cls._instance._stop.set()
            thread = cls._instance._thread
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=2 * _WATCH_INTERVAL_S)
            cls._instance = None

    def _run(self) -> None:
        key = self.key
        while not self._stop.wait(_WATCH_INTERVAL_S):
            try:
                if not self.store.check([key]):
                    continue
                message = self.store.get(key).decode(errors="replace")
            except Exception:  # the store is gone: the job is ending anyway
                return
            if self.announced:
                return
            self.message = message
            logger.error("rank %d stops: %s", self.rank, message)
            # the main thread's pending collective raises once the group is aborted
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            try:
                if abort is not None:
                    abort()
                else:
                    dist.destroy_process_group()
            except Exception as err:  # nothing more can be done from here
                logger.error("rank %d: could not abort the process group: %s", self.rank, err)
            return


def announce_failure(message: str) -> None:
    """Tell every rank that this one failed (see `_FailureWatch`); no-op without a group."""
    watch = _FailureWatch._instance
    if watch is None or watch.message is not None:
        return  # no group, or this rank is stopping because of another's failure
    watch.announced = True
    rank = watch.rank
    try:
        watch.store.set(watch.key, f"rank {rank} failed: {message}")
    except Exception as err:
        logger.warning("rank %d: could not announce its failure to the others: %s", rank, err)


def peer_failure(wait_s: float = 0.0) -> str | None:
    """Another rank's announced failure, if there is one; looks in the store for up to
    `wait_s` (a collective that failed because a peer exited may fail before the announcement
    of its reason has arrived)."""
    watch = _FailureWatch._instance
    if watch is None or watch.announced:
        return None
    if watch.message is not None or wait_s <= 0:
        return watch.message
    key, deadline = watch.key, time.monotonic() + wait_s
    while True:
        try:
            if watch.store.check([key]):
                return watch.store.get(key).decode(errors="replace")
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def shutdown(failed: bool = False) -> None:
    """Tear the default process group down (no-op if there is none). `failed`: this rank stops
    on an error, possibly with collectives its peers never matched; `destroy_process_group`
    can then block on NCCL (it waits for that work), so the group is aborted instead."""
    _FailureWatch.stop()
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None:
        try:
            abort()
            return
        except Exception as err:  # fall back to the orderly teardown
            logger.warning("could not abort the process group (%s); destroying it", err)
    dist.destroy_process_group()


# ------------------------------------------------------------------ start-up barriers
# The start-up's phases (a node's imports and CUDA context, tokenising the data, profiling one
# device type while the others wait, reading weights) take very different times on different
# ranks, and the next collective would give the late ones only the process group's timeout
# (`parallel.timeout_s`, sized for steps). Before each such collective the ranks meet at a
# barrier in the process group's store, with the start-up's own timeout; a rank later than it
# is NAMED (a store key per rank says who arrived), instead of a collective timing out somewhere.
_barrier_calls: dict[str, int] = {}
_BARRIER_POLL_S = (0.01, 0.5)
"""First and longest wait between two looks at the store."""


def startup_barrier(comm: Comm, phase: str, timeout_s: float) -> None:
    """Wait until every rank has reached `phase` (collective: every rank calls it, in the same
    order); raise one `CephaloError` naming the ranks that did not within `timeout_s`. Without a
    store (one process, a comm of its own) it is the comm's plain barrier, or nothing."""
    if comm.world_size == 1:
        return
    store = _store()
    if store is None:
        comm.barrier()
        return
    # not keyed by the restart count: agents that joined in different rounds count restarts
    # differently; each rendezvous round has a store of its own (SHARED_STORE_ENV)
    n = _barrier_calls[phase] = _barrier_calls.get(phase, 0) + 1
    prefix = f"cephalo/startup/{phase}/{n}/"
    if store.check([prefix + "given-up"]):
        raise CephaloError(
            f"rank {comm.rank} reached start-up phase {phase!r} after the other ranks had given up "
            f"waiting for it: see their message"
        )
    store.set(f"{prefix}rank{comm.rank}", "1")
    arrived = store.add(prefix + "count", 1)
    deadline, pause = time.monotonic() + timeout_s, _BARRIER_POLL_S[0]
    while arrived < comm.world_size:
        if time.monotonic() > deadline:
            late = [r for r in range(comm.world_size) if not store.check([f"{prefix}rank{r}"])]
            store.set(prefix + "given-up", str(comm.rank))
            raise CephaloError(
                f"rank(s) {', '.join(map(str, late))} did not reach start-up phase {phase!r} "
                f"within {timeout_s:g} s of rank {comm.rank} (parallel.startup_timeout_s). Raise "
                "parallel.startup_timeout_s if those ranks are only slow (a node tokenising, "
                "loading weights or profiling), else see their log for why they stopped"
            )
        peer = peer_failure()
        if peer is not None:
            raise CephaloError(f"rank {comm.rank}: start-up stopped because {peer}")
        time.sleep(pause)
        pause = min(2 * pause, _BARRIER_POLL_S[1])
        arrived = store.add(prefix + "count", 0)
