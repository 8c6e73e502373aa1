"""`cephalo doctor`: the pre-flight of a job, run on every rank under the launch of the job.

Every rank runs the same checks (`run_doctor`); what a check finds on each rank is
all-gathered, so every rank computes the same `Check` rows and the same verdict (rank 0 prints
them: `views.tables.doctor_table`). The rows, in order:

1. `ranks`: each rank's discovery (train/discovery.py): rank -> node -> device (type, memory);
   one job, one node map.
2. `plan`: the plan file (`--plan`, or `parallel.plan` a file) matched to the discovered
   devices (planner/rank_match.py): as it is, reordered, or refused with its message.
3. `device memory`: free device memory once the process groups exist (CUDA:
   `torch.cuda.mem_get_info`; an emulated device: its `mem=` budget) against the plan's
   predicted peak of each rank.
4. `host memory`: each node's usable memory (`/proc/meminfo` MemAvailable less the reserves of
   costmodel/host.py; an emulated node: its own budget) against what the plan puts on its host
   (predicted host bytes, else costmodel/host.py's formula).
5. `checkpoints`: every rank writes a probe with a random token into the checkpoint directory,
   a barrier, every rank looks for every other rank's probe: a directory not every rank shares
   names the ranks that do not see each other (an emulated cluster with `parallel.
   emulate_node_fs = private` fails it on one machine). With `checkpoint.node_local` it passes
   where the ranks fall into sets that each see one directory (a disk per node): those sets
   are the checkpoint's sites (train/checkpoint/sites.py). Training runs the same probe before
   its first step (`checkpoint_check`, train/trainer.py).
6. `NCCL`: the NCCL variables that matter (docs/gpu.md), set or unset; a warning for a
   multi-node NCCL job without NCCL_SOCKET_IFNAME on a host with several interfaces.
7. `collectives`: one uneven `all_gather_v`, `reduce_scatter_v` (a zero-size shard included)
   and `all_reduce` on the job's `Comm`, checked for their values, and the measured rate of an
   all-gather of a few MB. A collective that raises or times out (the process group's
   timeout, short under the doctor) fails the row.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cephalo.errors import CephaloError, first_line
from cephalo.planner.plan import Plan, check_stages_runnable
from cephalo.planner.rank_match import match_plan, plan_devices
from cephalo.runtime.collectives.comm import Comm
from cephalo.specs.cluster import Cluster
from cephalo.train.checkpoint.sites import Sites, sites_from_probe
from cephalo.train.config import JobConfig, stage_refusals
from cephalo.train.discovery import (
    RankDescription,
    check_same_job,
    cluster_from_descriptions,
    describe_own_device,
    is_emulated,
    job_torch_device,
    node_view,
    usable_host_bytes,
)
from cephalo.train.node_map import check_node_map

OK, FAIL, WARN = "ok", "FAIL", "warn"
NCCL_VARIABLES = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_DEBUG")
RATE_BYTES = 4 * 2**20
"""Bytes every rank receives in the measured all-gather."""
PROBE_PREFIX = ".cephalo-doctor-"


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table."""

    name: str
    status: str
    """`ok`, `FAIL` or `warn`."""
    found: str
    fix: str = ""
    """What to do, for a row that is not ok."""
    sites: tuple[int, ...] | None = None
    """The `checkpoints` row under `checkpoint.node_local`: each rank's site leader (the
    lowest rank that sees its directory); None: one directory every rank shares."""


@dataclass(frozen=True)
class DoctorOptions:
    """What the doctor checks beyond the job config."""

    plan: str | None = None
    """A plan file to match (None: `parallel.plan` where it is a file)."""
    checkpoint_dir: str | None = None
    """The directory to probe (None: the config's checkpoint directory)."""


def passed(checks: list[Check]) -> bool:
    """Whether no row failed (warnings pass)."""
    return all(c.status != FAIL for c in checks)


def size_text(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _split_fix(message: str, default: str) -> tuple[str, str]:
    """A CephaloError's message as (what was found, the fix): its last sentence is the fix."""
    head, sep, tail = message.rpartition(". ")
    if sep and tail[:1].isupper():
        return head, tail[0].lower() + tail[1:]
    return message, default


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# ----------------------------------------------------------------------------- 1. discovery
def discovery_check(
    descriptions: list[RankDescription], cfg: JobConfig
) -> tuple[Check, Cluster | None]:
    """The rank -> node -> device map, or the message that stops the job at start-up."""
    try:
        check_same_job(descriptions)
        check_node_map(descriptions)
    except CephaloError as err:
        found, fix = _split_fix(str(err), "start every rank with the same command")
        return Check("ranks", FAIL, found, fix), None
    links = Cluster.parse(cfg.parallel.devices) if cfg.parallel.devices else None
    cluster = cluster_from_descriptions(descriptions, links)
    lines = [
        f"{d.rank} -> node{dev.node} {dev.type_key} ({size_text(dev.memory_bytes)})"
        for d, dev in zip(sorted(descriptions, key=lambda d: d.rank), cluster.devices, strict=True)
    ]
    nodes = cluster.num_nodes
    head = f"{cluster.world_size} rank(s) on {nodes} node(s):"
    return Check("ranks", OK, "\n".join([head, *lines])), cluster


# ----------------------------------------------------------------------------- 2. the plan
def plan_source(cfg: JobConfig, options: DoctorOptions) -> str | None:
    if options.plan:
        return options.plan
    if cfg.parallel.plan not in ("auto", "even", "proportional"):
        return cfg.parallel.plan
    return None


def plan_check(
    cfg: JobConfig, options: DoctorOptions, cluster: Cluster | None
) -> tuple[Check, Plan | None]:
    """The plan file matched to the discovered devices (as it is, reordered, or refused)."""
    source = plan_source(cfg, options)
    if source is None:
        found = f"parallel.plan = {cfg.parallel.plan}: made at start-up for the ranks that come up"
        return Check("plan", OK, found), None
    if cluster is None:
        return Check("plan", FAIL, f"{source}: not matched (no cluster)", "fix `ranks` first"), None
    try:
        plan = Plan.from_json(source)
        check_stages_runnable(plan, source, stage_refusals(cfg))
        plan.validate(world_size=cluster.world_size)
        matched, order = match_plan(plan, cluster, source)
    except CephaloError as err:
        found, fix = _split_fix(str(err), f"make the plan for this cluster: {_plan_fix(cluster)}")
        return Check("plan", FAIL, found, fix), None
    if order is None:
        return Check("plan", OK, f"{source}: each rank's device is the plan's"), matched
    keys = [p.key for p in plan_devices(plan)]
    moved = ", ".join(f"{j}<-{i} ({keys[i]})" for j, i in enumerate(order) if i != j)
    return Check("plan", OK, f"{source}: reordered (rank<-plan rank: {moved})"), matched


def _plan_fix(cluster: Cluster) -> str:
    return f"`cephalo plan --cluster {cluster.to_spec()} --json PLAN`"


# ----------------------------------------------------------------------------- 3. device memory
def free_device_bytes(cfg: JobConfig, comm: Comm, own: RankDescription) -> tuple[int, str]:
    """This rank's free device memory and where the number comes from."""
    device = job_torch_device(cfg, comm)
    if device.type == "cuda" and not is_emulated(cfg):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "free"
    return int(own.device["memory_bytes"]), "budget" if is_emulated(cfg) else "assumed"


def device_memory_check(free: list[tuple[int, str]], plan: Plan | None) -> Check:
    short, lines = [], []
    for rank, (nbytes, how) in enumerate(free):
        need = plan.ranks[rank].predicted_peak_memory_bytes if plan is not None else None
        text = f"{rank}: {size_text(nbytes)} {how}"
        if need is not None:
            text += f", plan peak {size_text(need)}"
            if need > nbytes:
                short.append(rank)
                text += " (too little)"
        lines.append(text)
    if short:
        return Check(
            "device memory",
            FAIL,
            "\n".join(lines),
            f"rank(s) {_ranks_text(short)} cannot hold the plan's peak: free the device (another "
            "process holds memory) or make the plan for the memory these devices have",
        )
    if plan is None or all(r.predicted_peak_memory_bytes is None for r in plan.ranks):
        lines.append("(no predicted peak to check against)")
    return Check("device memory", OK, "\n".join(lines))


# ----------------------------------------------------------------------------- 4. host memory
def plan_host_bytes(plan: Plan) -> list[int]:
    """What each of the plan's ranks puts on its host: its predicted host bytes, else the cost
    model's formula (costmodel/host.py) where its model is known, else 0."""
    out = []
    for r in plan.ranks:
        if r.predicted_host_bytes is not None:
            out.append(int(r.predicted_host_bytes))
            continue
        if r.host_state_fraction == 0 and not r.offload_activations:
            out.append(0)
            continue
        try:
            from cephalo.costmodel.host import host_bytes
            from cephalo.modeling.registry import model_spec_for

            spec = model_spec_for(plan.model)
            x = r.state_fraction * r.host_state_fraction
            b = host_bytes(spec, plan.seq_len, plan.dtype, r.batch_size, r.offload_activations, x)
            out.append(int(math.ceil(float(b))))
        except (CephaloError, KeyError, ValueError, OSError):
            out.append(0)
    return out


def host_memory_check(
    available: list[int | None], cluster: Cluster | None, plan: Plan | None
) -> Check:
    if cluster is None:
        return Check("host memory", FAIL, "not checked (no cluster)", "fix `ranks` first")
    need = plan_host_bytes(plan) if plan is not None else [0] * cluster.world_size
    lines, short = [], []
    for node in cluster.nodes():
        ranks = [r for r, d in enumerate(cluster.devices) if d.node == node]
        have = [available[r] for r in ranks if available[r] is not None]
        wants = sum(need[r] for r in ranks)
        if not have:
            lines.append(f"node{node}: MemAvailable unknown, plan {size_text(wants)}")
            continue
        text = f"node{node}: {size_text(min(have))} available, plan {size_text(wants)}"
        if wants > min(have):
            short.append(node)
            text += " (too little)"
        lines.append(text)
    if short:
        return Check(
            "host memory",
            FAIL,
            "\n".join(lines),
            f"node(s) {_ranks_text(short)} lack the host memory the plan needs: free memory there, "
            "or make the plan with less host state / offloading",
        )
    return Check("host memory", OK, "\n".join(lines))


# ----------------------------------------------------------------------------- 5. checkpoints
def checkpoint_check(directory: Path, comm: Comm, node_local: bool = False) -> Check:
    """Probe files written by every rank into `directory` (as this rank sees it: an emulated
    node's own filesystem gives each node another one), looked for by every rank (collective).
    `node_local` (`checkpoint.node_local`): ranks that see one directory per set pass too."""
    rank = comm.rank
    own = directory
    run = comm.all_gather_object(secrets.token_hex(8))[0]
    token = secrets.token_hex(16)
    probe = own / f"{PROBE_PREFIX}{run}-rank{rank}"
    error = None
    try:
        own.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    except OSError as err:
        error = first_line(err)
    tokens = comm.all_gather_object((token, error))
    comm.barrier()
    seen = []
    for other, (their, _) in enumerate(tokens):
        with contextlib.suppress(OSError):
            path = own / f"{PROBE_PREFIX}{run}-rank{other}"
            if path.read_text() == their:
                seen.append(other)
    everyone = comm.all_gather_object(seen)
    comm.barrier()
    with contextlib.suppress(OSError):
        probe.unlink()
    failed = [(r, e) for r, (_, e) in enumerate(tokens) if e]
    if failed:
        return Check(
            "checkpoints",
            FAIL,
            "; ".join(f"rank {r} cannot write to {directory}: {e}" for r, e in failed),
            "make the directory writable by every rank (checkpoint.dir or --checkpoint-dir)",
        )
    n = comm.world_size
    blind = sorted(
        (a, b)
        for a in range(n)
        for b in range(a + 1, n)
        if b not in everyone[a] or a not in everyone[b]
    )
    if node_local:
        return _node_local_row(directory, everyone)
    if blind:
        pairs = ", ".join(f"{a}<->{b}" for a, b in blind[:8]) + (" ..." if len(blind) > 8 else "")
        return Check(
            "checkpoints",
            FAIL,
            f"{directory}: ranks that do not see each other's files: {pairs}",
            "not a filesystem every rank shares: put checkpoints on shared storage "
            "(checkpoint.dir or --checkpoint-dir), or set checkpoint.node_local = true to have "
            "each node write its own ranks' shards to its own directory",
        )
    return Check("checkpoints", OK, f"{directory}: shared by all {n} rank(s)")


def _node_local_row(directory: Path, seen: list[list[int]]) -> Check:
    """`checkpoint.node_local`: the ranks fall into sets that each see one directory."""
    sites, problem = sites_from_probe(seen)
    if sites is None:
        return Check(
            "checkpoints",
            FAIL,
            f"{directory}: {problem}",
            "give each node a directory of its own (a local disk) or one every rank shares",
        )
    groups = Sites.of(sites).groups(len(sites))
    if len(groups) == 1:
        return Check("checkpoints", OK, f"{directory}: shared by all {len(sites)} rank(s)")
    where = " | ".join(f"[{', '.join(map(str, g))}]" for g in groups)
    return Check(
        "checkpoints", OK, f"{directory}: node-local, {len(groups)} directories: {where}", "", sites
    )


# ----------------------------------------------------------------------------- 6. NCCL
def network_interfaces(root: str = "/sys/class/net") -> list[str]:
    """This host's non-loopback network interfaces (empty where /sys cannot be read)."""
    try:
        return sorted(n for n in os.listdir(root) if n != "lo")
    except OSError:
        return []


def nccl_facts() -> dict:
    return {
        "env": {v: os.environ.get(v) for v in NCCL_VARIABLES},
        "interfaces": network_interfaces(),
    }


def nccl_check(facts: list[dict], backend: str, cluster: Cluster | None) -> Check:
    env = facts[0]["env"]
    shown = ", ".join(
        f"{k.removeprefix('NCCL_')}={v if v is not None else 'unset'}" for k, v in env.items()
    )
    differ = [r for r, f in enumerate(facts) if f["env"] != env]
    found = f"backend {backend}; {shown}"
    if differ:
        found += f"; ranks {_ranks_text(differ)} have other values"
    nodes = cluster.num_nodes if cluster is not None else 1
    several = [r for r, f in enumerate(facts) if len(f["interfaces"]) > 1]
    unset = [r for r, f in enumerate(facts) if f["env"]["NCCL_SOCKET_IFNAME"] is None]
    if backend == "nccl" and nodes > 1 and set(several) & set(unset):
        return Check(
            "NCCL",
            WARN,
            found + f"; ranks {_ranks_text(sorted(set(several) & set(unset)))} have several "
            "interfaces",
            "set NCCL_SOCKET_IFNAME to the interface the nodes reach each other on (docs/gpu.md)",
        )
    return Check("NCCL", OK, found)


# ----------------------------------------------------------------------------- 7. collectives
def uneven_sizes(world_size: int) -> list[int]:
    """Uneven shard sizes with a zero-size one (rank 0's) where there are several ranks."""
    if world_size == 1:
        return [5]
    return [0] + [2 * r + 1 for r in range(1, world_size)]


def collectives_facts(comm: Comm, device: torch.device) -> tuple[str | None, float | None]:
    """(what went wrong, or None; the all-gather's measured rate in bytes/s per rank)."""
    n, rank = comm.world_size, comm.rank
    sizes = uneven_sizes(n)
    offsets = [sum(sizes[:r]) for r in range(n)]
    total = sum(sizes)
    mine = slice(offsets[rank], offsets[rank] + sizes[rank])
    full = torch.arange(total, dtype=torch.float32, device=device)
    try:
        out = torch.full((total,), -1.0, device=device)
        comm.all_gather_v(out, full[mine].clone(), sizes).wait()
        if not torch.equal(out, full):
            return "all_gather_v gave wrong values", None
        shard = torch.empty(sizes[rank], device=device)
        comm.reduce_scatter_v(shard, full * (rank + 1), sizes).wait()
        if not torch.equal(shard, full[mine] * (n * (n + 1) // 2)):
            return "reduce_scatter_v gave wrong values", None
        t = torch.tensor([float(rank + 1)], device=device)
        comm.all_reduce(t, "sum")
        m = torch.tensor([float(rank + 1)], device=device)
        comm.all_reduce(m, "max")
        if t.item() != n * (n + 1) / 2 or m.item() != n:
            return "all_reduce gave wrong values", None
        return None, _gather_rate(comm, device)
    except Exception as err:  # a timeout, a broken link: the row says which
        return f"{type(err).__name__}: {first_line(err)}", None


def _gather_rate(comm: Comm, device: torch.device) -> float | None:
    n = comm.world_size
    if n == 1:
        return None
    per_rank = RATE_BYTES // 4 // n
    sizes = [per_rank] * n
    out = torch.empty(per_rank * n, device=device)
    shard = torch.ones(per_rank, device=device)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    comm.all_gather_v(out, shard, sizes).wait()  # warm-up
    sync()
    reps = 3
    with comm.unvalidated():
        start = time.perf_counter()
        for _ in range(reps):
            comm.all_gather_v(out, shard, sizes).wait()
        sync()
        elapsed = time.perf_counter() - start
    return (n - 1) * per_rank * 4 * reps / max(elapsed, 1e-9)


def collectives_check(facts: list[tuple[str | None, float | None]], backend: str) -> Check:
    wrong = [(r, e) for r, (e, _) in enumerate(facts) if e]
    if wrong:
        return Check(
            "collectives",
            FAIL,
            "; ".join(f"rank {r}: {e}" for r, e in wrong[:3]),
            "check the network between the ranks (NCCL_DEBUG=INFO shows NCCL's choices) and "
            "that every rank runs the same torch",
        )
    rates = [rate for _, rate in facts if rate is not None]
    found = f"{backend}: all_gather_v, reduce_scatter_v (a zero shard), all_reduce right"
    if rates:
        found += (
            f"; all-gather of {size_text(RATE_BYTES)}: {size_text(min(rates))}/s (slowest rank)"
        )
    return Check("collectives", OK, found)


# ----------------------------------------------------------------------------- all of it
def run_doctor(cfg: JobConfig, comm: Comm, options: DoctorOptions | None = None) -> list[Check]:
    """Every check on this rank (collective: every rank calls it); the same rows on every rank."""
    options = options or DoctorOptions()
    own = describe_own_device(cfg, comm.rank, comm.world_size)
    descriptions = comm.all_gather_object(own)
    ranks, cluster = discovery_check(descriptions, cfg)
    plan_row, plan = plan_check(cfg, options, cluster)
    free = comm.all_gather_object(free_device_bytes(cfg, comm, own))
    node = cluster.devices[comm.rank].node if cluster is not None else 0
    # an emulated node's host is its budget; a real one's what it has free less the reserves
    usable = own.host_memory_bytes if is_emulated(cfg) else usable_host_bytes(own.local_world_size)
    available = comm.all_gather_object(usable)
    directory = Path(options.checkpoint_dir) if options.checkpoint_dir else cfg.checkpoint_dir
    directory = node_view(cfg, directory, node) if is_emulated(cfg) else directory
    nccl = comm.all_gather_object(nccl_facts())
    local = collectives_facts(comm, job_torch_device(cfg, comm))
    try:
        collectives = comm.all_gather_object(local)
    except Exception as err:  # the group broke in the check: this rank's own finding
        reason = local[0] or f"could not share its result: {first_line(err)}"
        collectives = [(None, None)] * comm.world_size
        collectives[comm.rank] = (reason, None)
    return [
        ranks,
        plan_row,
        device_memory_check(free, plan),
        host_memory_check(available, cluster, plan),
        checkpoint_check(directory, comm, cfg.checkpoint.node_local),
        nccl_check(nccl, comm.backend, cluster),
        collectives_check(collectives, comm.backend),
    ]
