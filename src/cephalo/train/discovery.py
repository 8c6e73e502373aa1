"""The job's cluster, as its ranks discover it: every rank describes only its own device.

One path for real and emulated clusters alike:

1. each rank describes ITSELF (`describe_own_device`):
   - emulated: its own entry of `parallel.devices` (`cephalo run`), or the one device in the
     `CEPHALO_DEVICE` environment variable (a launcher or test giving each process its own);
   - on CUDA: its GPU's name (mapped to a catalog type where the catalog knows it, else
     `gpu-<name>`, profiled under that name), its memory, its node (torchrun's `GROUP_RANK`,
     else the host name) and its node's host memory;
   - else the CPU.
2. the descriptions are all-gathered (`discover_cluster`); every rank builds the same
   `Cluster` from the same list, so no rank ever assumes anything about another, and the
   profiler then measures each distinct type on a rank that has it. Ranks that disagree about
   their node (how they know it, a node spanning machines, torchrun's count) stop with one
   message on every rank (`node_map.py`).

The same all-gather carries a fingerprint of the job (config, world size, cephalo's
version): ranks started with different configs stop with one message on every rank, naming
the fields that differ, instead of hanging in a later collective.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cephalo import __version__, envvars
from cephalo.costmodel.host import host_budget
from cephalo.errors import CephaloError
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.emulation import spec_position
from cephalo.specs.catalog.devices import DEFAULT_HOST_MEMORY_BYTES, device_type_for_gpu
from cephalo.specs.cluster import Cluster, Device, parse_bytes
from cephalo.train.config import JobConfig
from cephalo.train.node_map import check_node_map


@dataclass(frozen=True)
class RankDescription:
    """What one rank knows about itself (plain values: it travels through an all-gather)."""

    rank: int
    device: dict
    """`Device.to_dict()` of this rank's device (its `node` is filled in by the cluster)."""
    node: str
    """This rank's node as it knows it: an emulated `@nodeK`, torchrun's group rank, or the
    host name."""
    host_memory_bytes: int
    """Its node's host memory."""
    name: str
    """The device's own name (`NVIDIA L4`, `cpu`), for messages."""
    job: str
    """Fingerprint of the job this rank was started with."""
    job_fields: dict
    """The flattened config the fingerprint hashes (to name the fields that differ)."""
    node_source: str = "host"
    """How it knows its node: `spec` (@nodeK), `torchrun` (GROUP_RANK) or `host` (host name)."""
    host: str = ""
    """The machine it runs on (its host name)."""
    torchrun_group: str | None = None
    """torchrun's GROUP_RANK, where torchrun started it."""
    local_world_size: int | None = None
    """torchrun's LOCAL_WORLD_SIZE: the ranks its node runs."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def job_fingerprint(cfg: JobConfig, world_size: int) -> tuple[str, dict]:
    """A hash of what every rank must agree on, and the flat fields it hashes."""
    fields = _flatten(cfg.to_dict())
    fields["world_size"] = world_size
    fields["cephalo_version"] = __version__
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], json.loads(text)


def physical_host_memory() -> int:
    """This host's physical memory in bytes (the catalog default where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return DEFAULT_HOST_MEMORY_BYTES


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Host memory the kernel says is available now (`MemAvailable`, Linux); None where it
    cannot be read (what it has at all: `physical_host_memory`)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_host_bytes(local_ranks: int | None = None) -> int:
    """This node's host memory budget for the plan (`costmodel.host.host_budget`): available
    memory less the OS's and each of its `local_ranks` ranks' reserves (torchrun's
    LOCAL_WORLD_SIZE where None); physical memory stands in where MemAvailable cannot be read."""
    physical = physical_host_memory()
    available = available_host_bytes()
    ranks = local_ranks if local_ranks is not None else (_local_world_size() or 1)
    return host_budget(physical if available is None else available, physical, ranks)


def _torchrun_group() -> str | None:
    group_rank = os.environ.get("GROUP_RANK")
    return group_rank if group_rank not in (None, "") else None


def _torchrun_node() -> tuple[str, str]:
    """(node, how it is known): torchrun's group rank, else the host name."""
    group = _torchrun_group()
    return (f"group{group}", "torchrun") if group is not None else (socket.gethostname(), "host")


def _local_world_size() -> int | None:
    try:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def _one_device(spec: str, what: str) -> tuple[Device, Cluster]:
    cluster = Cluster.parse(spec)
    if cluster.world_size != 1:
        raise CephaloError(
            f"{what} must name exactly one device (this rank's), got {cluster.world_size}: {spec!r}"
        )
    return cluster.devices[0], cluster


def describe_own_device(cfg: JobConfig, rank: int, world_size: int) -> RankDescription:
    """This rank's description of itself (see the module docstring)."""
    job, fields = job_fingerprint(cfg, world_size)
    host_override = (
        parse_bytes(cfg.parallel.host_memory, "parallel.host_memory")
        if cfg.parallel.host_memory is not None
        else None
    )
    own_spec = os.environ.get(envvars.DEVICE)
    if cfg.parallel.devices:
        cluster = Cluster.parse(cfg.parallel.devices)
        if cluster.world_size != world_size:
            raise CephaloError(
                f"parallel.devices lists {cluster.world_size} device(s) ({cfg.parallel.devices!r}) but "
                f"the job has {world_size} process(es): give one device per rank, or launch "
                f"{cluster.world_size} processes (`cephalo run` starts one per device)"
            )
        # the ranks may join in another order than the spec's devices (as under c10d)
        device = cluster.devices[spec_position(cfg.parallel.emulate_join_order, rank, world_size)]
        (node, source), name = (f"node{device.node}", "spec"), "cpu"
        host = host_override or cluster.host_memory_of(device.node)
    elif own_spec:
        device, cluster = _one_device(own_spec, f"{envvars.DEVICE}")
        explicit_node = "@" in own_spec
        node, source = (f"node{device.node}", "spec") if explicit_node else _torchrun_node()
        name = device.type
        host = host_override or cluster.host_memory_of(device.node)
    elif torch.cuda.is_available() and cfg.parallel.backend != "gloo":
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        memory = int(props.total_memory)
        device = Device(type=device_type_for_gpu(props.name, memory), memory_bytes=memory)
        (node, source), name = _torchrun_node(), props.name
        host = host_override or usable_host_bytes()
    else:
        device = Device(type="cpu", memory_bytes=Cluster.parse("cpu").devices[0].memory_bytes)
        (node, source), name = _torchrun_node(), "cpu"
        host = host_override or DEFAULT_HOST_MEMORY_BYTES
    return RankDescription(
        rank,
        device.to_dict(),
        node,
        int(host),
        name,
        job,
        fields,
        node_source=source,
        host=socket.gethostname(),
        torchrun_group=_torchrun_group(),
        local_world_size=_local_world_size(),
    )


NODE_FS_DIR = "node-fs"
"""Under `logging.dir`: the filesystems of an emulated cluster's other nodes (`node_view`)."""


def node_view(cfg: JobConfig, path: str | Path, node: int) -> Path:
    """Where `path` is for the ranks of emulated node `node` (`parallel.emulate_node_fs`): as
    given on a filesystem every node shares (`shared`, node 0, or a path under `parallel.
    shared_dir`), else under `<logging.dir>/node-fs/node<K>/` (its absolute path made relative
    there), the local disk of a machine of its own. Node 0 is the machine the job was started
    from: its run directory is where the user looks."""
    p = Path(path)
    if cfg.parallel.emulate_node_fs != "private" or node == 0:
        return p
    absolute = p.absolute()
    if cfg.parallel.shared_dir is not None:
        shared = Path(cfg.parallel.shared_dir).absolute()
        if absolute == shared or shared in absolute.parents:
            return p
    root = Path(cfg.logging.dir).absolute() / NODE_FS_DIR / f"node{node}"
    return root / absolute.relative_to(absolute.anchor)


def node_local_config(cfg: JobConfig, node: int) -> JobConfig:
    """The job's config as the ranks of emulated node `node` see it: the directories they
    write (checkpoints, the run directory) on that node's filesystem (`node_view`); the same
    config where the nodes share one."""
    if cfg.parallel.emulate_node_fs != "private" or node == 0:
        return cfg
    local = copy.deepcopy(cfg)
    local.checkpoint.dir = str(node_view(cfg, cfg.checkpoint_dir, node))
    local.logging.dir = str(node_view(cfg, cfg.logging.dir, node))
    return local


def is_emulated(cfg: JobConfig) -> bool:
    """Whether this rank's device is an emulated one (its memory then a budget the engine
    enforces, its host share a host budget)."""
    return bool(cfg.parallel.devices or os.environ.get(envvars.DEVICE))


def job_torch_device(cfg: JobConfig, comm: Comm) -> torch.device:
    """Where this rank computes: its GPU under NCCL, and also in a one-process job on a GPU
    machine (torchrun at world size 1 gives a `LocalComm`, whose backend says nothing about
    the device); the CPU under gloo, for emulated devices, or without CUDA."""
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if (
        comm.backend == "gloo"
        or is_emulated(cfg)
        or cfg.parallel.backend == "gloo"
        or not torch.cuda.is_available()
    ):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_same_job(descriptions: list[RankDescription]) -> None:
    """Raise (on every rank: each sees the same list) if the ranks were started with different
    jobs, naming the fields that differ."""
    first = descriptions[0]
    odd = [d for d in descriptions if d.job != first.job]
    if not odd:
        return
    other = odd[0]
    keys = sorted(set(first.job_fields) | set(other.job_fields))
    diff = [k for k in keys if first.job_fields.get(k) != other.job_fields.get(k)]
    shown = ", ".join(
        f"{k}: {first.job_fields.get(k)!r} on rank {first.rank} vs {other.job_fields.get(k)!r} "
        f"on rank {other.rank}"
        for k in diff[:5]
    )
    raise CephaloError(
        f"the ranks were started with different jobs (ranks {[d.rank for d in odd]} differ from "
        f"rank 0): {shown}. Start every rank with the same config, command line and cephalo "
        "version"
    )


def cluster_from_descriptions(
    descriptions: list[RankDescription], links_from: Cluster | None = None
) -> Cluster:
    """The cluster the descriptions make, in rank order. Nodes are numbered in order of first
    appearance; an emulated cluster's links come from its spec (`links_from`)."""
    node_index: dict[str, int] = {}
    host_memory: dict[int, int] = {}
    devices = []
    for d in sorted(descriptions, key=lambda d: d.rank):
        if d.node.startswith("node") and d.node[4:].isdigit():
            index = int(d.node[4:])  # an emulated @nodeK keeps its number
        else:
            index = node_index.setdefault(d.node, len(node_index))
        device = Device(**{**d.device, "node": index})
        devices.append(device)
        # ranks of one node report the same host; take the smallest if they do not
        host_memory[index] = min(host_memory.get(index, d.host_memory_bytes), d.host_memory_bytes)
    kwargs: dict[str, Any] = {}
    if links_from is not None:
        kwargs = dict(
            intra_node_bytes_per_s=links_from.intra_node_bytes_per_s,
            inter_node_bytes_per_s=links_from.inter_node_bytes_per_s,
            collective_latency_s=links_from.collective_latency_s,
            host_optimizer_s_per_param=links_from.host_optimizer_s_per_param,
        )
    cluster = Cluster(devices, **kwargs)
    values = set(host_memory.values())
    if len(values) == 1:
        cluster.host_memory_bytes = values.pop()
    else:
        cluster.node_host_memory_bytes = dict(host_memory)
    return cluster


def discover_cluster(cfg: JobConfig, comm: Comm) -> Cluster:
    """Every rank describes itself; the descriptions are all-gathered and checked (one job, one
    rank-to-node map: `node_map`); the cluster is built from them (collective: call on every
    rank)."""
    mine = describe_own_device(cfg, comm.rank, comm.world_size)
    descriptions = comm.all_gather_object(mine)
    check_same_job(descriptions)
    check_node_map(descriptions)
    links = Cluster.parse(cfg.parallel.devices) if cfg.parallel.devices else None
    return cluster_from_descriptions(descriptions, links)
