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

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.runtime.comm import Comm, LocalComm, make_comm

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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
    local_rank = int(env.get("LOCAL_RANK", "0"))
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
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}): {_first_line(err)}.{hint}"
        ) from err
    logger.info(
        "rank %d/%d: %s process group up (timeout %.0fs)", rank, world_size, backend, timeout_s
    )
    return make_comm(comm_impl, validate=validate)


def shutdown() -> None:
    """Tear the default process group down (no-op if there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
