"""`profile_devices`: measure every device type of a cluster and the collectives between its
ranks, inside the distributed job, with a database so a second run is instant.

Every rank calls it with the same arguments. Rank 0 reads the database and says (to all)
which device types are already known. When the ranks are CPU processes on one host (the
emulated clusters), every rank then measures its own device type at the same time, by the
wall clock, each timed repetition started on all ranks together: in training these ranks
share the cores in lockstep (each unit starts on all ranks when its all-gather completes),
so each one's unit compute is slower in wall time than measured alone, and the emulator
stretches that wall time by its slowdown. Measured one at a time, the profiles predicted
about a third of the measured step on a 2-core host; together, about 0.7 (docs/profiling.md).
Such profiles hold for this set of co-located ranks, which is part of their database key.
Otherwise (ranks on several hosts, GPUs, or `concurrent=False`) each unknown type is
measured by the FIRST rank of that type while every other rank waits for its result (a
blocking broadcast). The collectives are measured by all ranks together. Rank 0 then writes
the database. In one process (world size 1) the same call measures every distinct type
itself: emulated types differ only in their slowdown.

Memory: a rank materialises only the units it measures (the embedding, one block, the head:
`materialize_measured`), never the whole model, so a model that fits only sharded can be
profiled (docs/profiling.md, "What it holds in memory").

Threads: measurements run with the caller's `torch.get_num_threads()`, which should be what
training uses (the local launcher gives every rank its share of the cores); it is recorded
in each profile's `meta`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.modeling.registry import build_model
from cephalo.modeling.units import UnitModel
from cephalo.profiling.database import (
    CommKey,
    DeviceKey,
    ProfileDatabase,
    host_signature,
    model_signature,
)
from cephalo.profiling.measure import (
    Timing,
    UnitBench,
    fit_comm,
    measure_collectives,
    measure_host_copy,
    measure_host_optimizer,
    measure_nf4_dequant,
    measure_optimizer,
    nf4_dequant_shape,
)
from cephalo.profiling.settings import ProfileSettings
from cephalo.runtime.capture.apply import apply_compile, resolve_compile
from cephalo.runtime.collectives.comm import Comm, LocalComm
from cephalo.runtime.collectives.dist import startup_barrier
from cephalo.runtime.device_memory import host_memory
from cephalo.runtime.emulation import ComputeEmulator
from cephalo.runtime.state.precision import compute_dtype
from cephalo.specs.cluster import Cluster, Device
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import CommProfile, Curve, DeviceProfile, MeasuredProfiles, UnitProfile

ProgressFn = Callable[[str], None]


# ====================================================================== one device type
def measured_units(model: UnitModel) -> dict[str, int]:
    """Unit kind -> the index of the unit that stands for it: the embedding, the first block,
    the head. The only units `measure_device` runs, so the only ones it needs materialised."""
    return {"embedding": 0, "block": 1, "head": len(model.units) - 1}


def materialize_measured(meta_model: UnitModel, device: torch.device) -> UnitModel:
    """A copy of `meta_model` with only its `measured_units` materialised, in host memory (their
    constant buffers on `device`; `UnitModel.materialize_units`; the other blocks stay on the
    meta device): the profiler
    holds the embedding, one block and the head, never the whole model. Their values are
    drawn for them alone (a model with pretrained weights reads those units' tensors), so
    they are not what a whole-model materialisation gives them: timings and activation
    bytes do not depend on the values."""
    model = copy.deepcopy(meta_model)
    chosen = sorted(set(measured_units(model).values()))
    # in host memory, as the engine's initial values are: the device holds only what the
    # measurement copies there (`UnitBench`: the gathered compute-dtype parameters, the trained
    # parameters' fp32 gradients), not a second, fp32 copy of the units
    with host_memory():
        model.materialize_units("cpu", torch.Generator().manual_seed(0), chosen)
    if device.type != "cpu":  # constant buffers (rotary tables) are read on the device
        for i in chosen:
            for module in model.units[i].module.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None:
                        module._buffers[name] = buf.to(device)
    return model


def measure_device(
    model: UnitModel,
    seq_len: int,
    dtype: str,
    device: Device,
    torch_device: torch.device,
    settings: ProfileSettings,
    progress: ProgressFn | None = None,
    together: Comm | None = None,
    compile_mode: str = "off",
) -> DeviceProfile:
    """Measure one device type on this process. The model's `measured_units` (the embedding,
    the first block, the head) must be materialised on `torch_device` (`materialize_measured`);
    no other unit's tensors are read.

    `together`: every rank of this job calls this at once (concurrent profiling): timed by
    the wall clock and each repetition started on all ranks together. All ranks then run
    the same sequence of measurements: a rank done with its sizes (memory, time cap) keeps
    repeating its last size, unrecorded, until every rank is done, so the others are still
    measured under the load they will see in training."""
    started = time.perf_counter()
    timing = Timing(warmup=settings.warmup, repeats=settings.repeats)
    if together is not None:
        timing = Timing(
            warmup=timing.warmup,
            repeats=timing.repeats,
            wall_clock=True,
            start_together=together.barrier,
            contention=[0.0, 0.0],
        )

    def all_ranks(done: bool) -> bool:
        if together is None:
            return done
        flag = torch.tensor([float(not done)], device=torch_device)
        together.all_reduce(flag, "max")
        return flag.item() == 0.0

    spec = model.spec
    emulator = ComputeEmulator(device.slowdown)
    cdtype = compute_dtype(dtype)
    kinds = measured_units(model)
    # the blocks as the engine will run them (`parallel.compile`): compiled profiles
    compiled = apply_compile(model, torch_device, compile_mode, settings.per_sample_dropout)
    benches = {
        kind: UnitBench(
            model.units[i],
            i,
            seq_len,
            spec.hidden_size,
            spec.vocab_size,
            torch_device,
            cdtype,
            settings.per_sample_dropout,
            compiled,
        )
        for kind, i in kinds.items()
    }
    points: dict[str, list[tuple[int, float, float, int]]] = {k: [] for k in kinds}
    m, done = 1, False
    while m <= settings.max_micro_batch:
        size = int(points["head"][-1][0]) if done else m  # a done rank only loads the cores
        try:
            for kind, bench in benches.items():
                if progress and not done:
                    progress(f"{device.type_key}: {kind} at micro-batch {m}")
                fwd, bwd, act = bench.measure(size, timing, emulator)
                if not done:
                    points[kind].append((m, fwd, bwd, act))
        except torch.cuda.OutOfMemoryError:
            logger.info("%s: out of memory at micro-batch %d; stopping there", device.type_key, m)
            break
        finally:
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
        for kind in kinds:  # keep the per-kind lists equally long (OOM mid-size)
            del points[kind][len(points["head"]) :]
        if not done:
            elapsed = time.perf_counter() - started
            act_now = points["block"][-1][3] + points["head"][-1][3]
            if elapsed > settings.time_cap_s and len(points["block"]) >= 2:
                logger.info("%s: time cap reached after micro-batch %d", device.type_key, m)
                done = True
            elif (
                2 * act_now > device.memory_bytes / 2
            ):  # the next size would not leave room for the state
                logger.info(
                    "%s: micro-batch %d already uses %.0f MiB of activations; stopping",
                    device.type_key,
                    m,
                    act_now / 2**20,
                )
                done = True
        if all_ranks(done):
            break
        m *= 2
    if not points["head"]:
        raise CephaloError(
            f"{device.type_key}: not even micro-batch 1 of {spec.name} fits in memory; use a smaller model or sequence"
        )
    # how much of the units' measured time the host's sharing made (concurrent profiling of CPU
    # ranks; runtime/emulation.py "Contention"): training sees its own, which may differ
    measured_s, contended_s = timing.contention or (0.0, 0.0)
    contention_share = contended_s / measured_s if measured_s > 0 else None
    timing = dataclasses.replace(timing, contention=None)
    units = {}
    for kind, pts in points.items():
        xs = [float(p[0]) for p in pts]
        units[kind] = UnitProfile(
            fwd_s=Curve(xs, [p[1] for p in pts]),
            bwd_s=Curve(xs, [p[2] for p in pts]),
            activation_bytes=Curve(xs, [float(p[3]) for p in pts]),
        )
    if progress:
        progress(f"{device.type_key}: optimizer and host copies")
    # the fixed-size benchmarks take a small share of the device (an emulated one of a few MiB
    # included): the optimizer's state (16 B per element) and the copies' source and target
    # each at most 1/64 of it
    opt_numel = max(1, min(settings.optimizer_numel, device.memory_bytes // (16 * 64)))
    copy_bytes = max(4, min(settings.host_copy_bytes, device.memory_bytes // 128))
    opt_s = measure_optimizer(torch_device, opt_numel, timing, emulator)
    extra = {}
    if model.quantized_parameters:  # QLoRA: the engine dequantizes every pass of a block
        shapes = [
            tuple(p.shape)
            for unit in model.units
            for name, p in unit.module.named_parameters()
            if f"{unit.name}.{name}" in model.quantized_parameters
        ]
        extra["nf4_dequant_s_per_param"] = measure_nf4_dequant(
            torch_device, compute_dtype(dtype), timing, emulator, nf4_dequant_shape(shapes)
        )
    with host_memory():  # the host's AdamW runs in host memory
        host_opt_s = measure_host_optimizer(settings.optimizer_numel, timing)
    # the engine copies offloaded boundaries on a side stream only on CUDA (runtime/boundary.py);
    # elsewhere they are memcpys inside the (stretched) unit compute, or, with an emulated
    # link (pcie=), copies of their own
    async_copies = torch_device.type == "cuda"
    link = device.pcie_bytes_per_s if not async_copies else None
    copy_bw = measure_host_copy(
        torch_device,
        copy_bytes,
        timing,
        None if async_copies or link is not None else emulator,
        link_bytes_per_s=link,
    )
    return DeviceProfile(
        device_type=device.type_key,
        memory_bytes=device.memory_bytes,
        units=units,
        optimizer_s_per_param=opt_s,
        host_copy_bytes_per_s=copy_bw,
        source="measured",
        async_copies=async_copies,
        host_optimizer_s_per_param=host_opt_s,
        boundary_writes_in_compute=link is None,
        meta={
            "torch_threads": torch.get_num_threads(),
            "slowdown": device.slowdown,
            "host": host_signature(torch_device),
            "measure_s": round(time.perf_counter() - started, 3),
            "repeats": settings.repeats,
            "concurrent": together is not None,
            **(
                {"contention_share": round(contention_share, 4)}
                if contention_share is not None
                else {}
            ),
            # a model with a frozen base (LoRA / QLoRA adapters applied) is measured as the
            # engine runs it: no gradient for the base. QLoRA's NF4 dequantization is timed on
            # its own (seconds per weight; the cost model adds it per pass of a block).
            **({"adapter": "lora"} if _has_frozen_base(model) else {}),
            **extra,
        },
    )


def comm_sizes(sizes: tuple[int, ...], memory_bytes: int) -> tuple[int, ...]:
    """The collective benchmark's message sizes on devices of `memory_bytes` (the smallest of
    the job's): each at most 1/32 of it (a gather holds the message and a piece), the small
    one kept 32x below the large one so that the fit still sees latency and bandwidth."""
    cap = max(1 << 10, memory_bytes // 32)
    large = min(max(sizes), cap)
    return tuple(min(s, large if s == max(sizes) else max(256, large // 32)) for s in sizes)


def _has_frozen_base(model: UnitModel) -> bool:
    return any(not p.requires_grad for u in model.units for p in u.module.parameters())


# ====================================================================== the whole cluster
def _wait_for_all(comm: Comm, timeout_s: float | None) -> None:
    """The start-up barrier (named late ranks, the start-up's timeout) before the collective
    that ends a measurement; nothing without a start-up timeout or in one process."""
    if timeout_s is not None and comm.world_size > 1:
        startup_barrier(comm, "profiling", timeout_s)


def _broadcast(obj: object, src: int, comm: Comm) -> object:
    if comm.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _torch_device(comm: Comm) -> torch.device:
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _measuring_ranks(devices: list[Device], world_size: int) -> dict[str, int]:
    """Type key -> the rank that measures it: the first of that type (all 0 in one process)."""
    first: dict[str, int] = {}
    for i, d in enumerate(devices):
        first.setdefault(d.type_key, i if world_size > 1 else 0)
    return first


def _concurrent(setting: bool | None, hosts: list[str], backend: str) -> bool:
    """Whether to measure all ranks at once: asked for, or (None) when several CPU ranks
    share one host, where in training they compete for its cores."""
    if len(hosts) < 2:
        return False
    if setting is not None:
        return setting
    return backend != "nccl" and len(set(hosts)) == 1


def _keys(
    meta_model: UnitModel,
    seq_len: int,
    dtype: str,
    devices: list[Device],
    hosts: list[str],
    first_rank: dict[str, int],
    backend: str,
    concurrent: bool = False,
) -> tuple[dict[str, DeviceKey], CommKey]:
    signature = model_signature(meta_model, meta_model.spec)
    peers = ",".join(d.type_key for d in devices) if concurrent else ""
    keys = {
        k: DeviceKey(k, signature, seq_len, dtype, torch.__version__, hosts[r], peers=peers)
        for k, r in first_rank.items()
    }
    return keys, CommKey(tuple(d.type_key for d in devices), backend, torch.__version__, hosts[0])


def cached_profiles(
    model: str | UnitModel,
    seq_len: int,
    dtype: str,
    devices: Cluster | list[Device],
    backend: str = "gloo",
    cache: str | Path | None = None,
    concurrent: bool | None = None,
    **model_overrides,
) -> MeasuredProfiles | None:
    """Everything `profile_devices` would return for ranks on THIS host, if the database
    already has all of it (else None): lets a launcher skip starting ranks at all."""
    started = time.perf_counter()
    devices = list(devices.devices if isinstance(devices, Cluster) else devices)
    # timings do not depend on the values: never read pretrained weights to profile
    meta_model = (
        build_model(model, init="random", **model_overrides) if isinstance(model, str) else model
    )
    host = host_signature(
        "cpu" if backend != "nccl" else torch.device("cuda", torch.cuda.current_device())
    )
    hosts = [host] * len(devices)
    keys, comm_key = _keys(
        meta_model,
        seq_len,
        dtype,
        devices,
        hosts,
        _measuring_ranks(devices, len(devices)),
        backend,
        _concurrent(concurrent, hosts, backend),
    )
    db = ProfileDatabase.load(cache)
    profiles = {k: db.get_device(key) for k, key in keys.items()}
    comm = db.get_comm(comm_key) if len(devices) > 1 else None
    if any(p is None for p in profiles.values()) or (len(devices) > 1 and comm is None):
        return None
    for k, p in profiles.items():
        p.memory_bytes = min(d.memory_bytes for d in devices if d.type_key == k)
    return MeasuredProfiles(
        profiles=profiles,
        comm=comm,
        model=meta_model.spec.name,
        seq_len=seq_len,
        dtype=dtype,
        cached=[*profiles, *(["comm"] if comm else [])],
        elapsed_s=time.perf_counter() - started,
    )


def profile_devices(
    model: str | UnitModel,
    seq_len: int,
    dtype: str,
    devices: Cluster | list[Device],
    comm: Comm | None = None,
    settings: ProfileSettings | None = None,
    cache: str | Path | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    progress: ProgressFn | None = None,
    device: torch.device | None = None,
    startup_timeout_s: float | None = None,
    compile_mode: str = "off",
    **model_overrides,
) -> MeasuredProfiles:
    """Profiles of every device type in `devices` (rank order) and of the collectives.

    Call on every rank (see the module docstring). `model` is a registry name (with
    `model_overrides`) or a meta-built `UnitModel` (it is copied, never materialised in
    place; only the units measured are materialised: `materialize_measured`). `cache` is the database file (default `default_db_path()`); `use_cache=False`
    neither reads nor writes it; `refresh=True` re-measures and overwrites its entries.
    `device`: where this rank measures (default: its GPU under NCCL, else the CPU).
    `startup_timeout_s`: the ranks meet at a start-up barrier of this timeout after each
    measurement (a device type measured while the others wait can outlast the process group's
    timeout, sized for steps); None: the collectives' own timeout.
    `compile_mode`: the job's `parallel.compile`: blocks are measured as the engine will run
    them (compiled: each micro-batch size compiles first), and the profile is keyed by it.
    """
    started = time.perf_counter()
    settings = settings or ProfileSettings()
    comm = comm or LocalComm()
    devices = list(devices.devices if isinstance(devices, Cluster) else devices)
    if comm.world_size > 1 and len(devices) != comm.world_size:
        raise CephaloError(
            f"the cluster lists {len(devices)} devices but the job has {comm.world_size} ranks; "
            "give one device per rank, in rank order"
        )
    if seq_len < 1:
        raise CephaloError(f"seq_len must be >= 1, got {seq_len}")
    compute_dtype(dtype)  # a clear error for a bad dtype
    # timings do not depend on the values: never read pretrained weights to profile
    meta_model = (
        build_model(model, init="random", **model_overrides) if isinstance(model, str) else model
    )
    spec: ModelSpec = meta_model.spec
    if seq_len > spec.max_seq_len:
        raise CephaloError(
            f"seq_len {seq_len} is longer than {spec.name}'s {spec.max_seq_len} positions; "
            "use a shorter sequence or a model built for it"
        )
    tdev = device or _torch_device(comm)
    rank = comm.rank
    type_keys = list(dict.fromkeys(d.type_key for d in devices))
    first_rank = _measuring_ranks(devices, comm.world_size)
    hosts = comm.all_gather_object(host_signature(tdev))
    together = _concurrent(settings.concurrent, hosts, comm.backend)
    keys, comm_key = _keys(
        meta_model, seq_len, dtype, devices, hosts, first_rank, comm.backend, together
    )
    resolved = resolve_compile(compile_mode, tdev)
    keys = {k: dataclasses.replace(key, compile=resolved) for k, key in keys.items()}

    # rank 0 decides what is known; everyone learns the same answer
    known: dict | None = None
    if rank == 0:
        db = ProfileDatabase.load(cache) if use_cache else None
        known = {"devices": {}, "comm": None}
        if db is not None and not refresh:
            for k, key in keys.items():
                p = db.get_device(key)
                if p is not None:
                    known["devices"][k] = p.to_dict()
            c = db.get_comm(comm_key) if comm.world_size > 1 else None
            known["comm"] = (
                None if c is None else {"bytes_per_s": c.bytes_per_s, "latency_s": c.latency_s}
            )
    known = _broadcast(known, 0, comm)
    assert known is not None

    profiles: dict[str, DeviceProfile] = {
        k: DeviceProfile.from_dict(p) for k, p in known["devices"].items()
    }
    cached = [k for k in type_keys if k in profiles]
    measured: list[str] = []
    if together and len(profiles) < len(type_keys):
        # every rank measures its own device at once (ranks of one type too: they load the
        # cores in training); the first rank of each type speaks for it
        materialised = materialize_measured(meta_model, tdev)
        logger.info(
            "rank %d: measuring %s with %d concurrent ranks (%s, seq %d, %s)",
            rank,
            devices[rank].type_key,
            comm.world_size,
            spec.name,
            seq_len,
            dtype,
        )
        mine = measure_device(
            materialised,
            seq_len,
            dtype,
            devices[rank],
            tdev,
            settings,
            progress,
            together=comm,
            compile_mode=resolved,
        ).to_dict()
        del materialised
        _wait_for_all(comm, startup_timeout_s)
        results = comm.all_gather_object(mine)
        for k in type_keys:
            profiles[k] = DeviceProfile.from_dict(results[first_rank[k]])
            measured.append(k)
        cached = []
    materialised: UnitModel | None = None
    for k in type_keys:
        if k in profiles:
            continue
        src = first_rank[k]
        result = None
        if rank == src:
            if materialised is None:
                materialised = materialize_measured(meta_model, tdev)
            device = next(d for d in devices if d.type_key == k)
            logger.info(
                "rank %d: measuring %s (%s, seq %d, %s)", rank, k, spec.name, seq_len, dtype
            )
            result = measure_device(
                materialised, seq_len, dtype, device, tdev, settings, progress, None, resolved
            ).to_dict()
        _wait_for_all(comm, startup_timeout_s)  # the others waited while `src` measured
        profiles[k] = DeviceProfile.from_dict(_broadcast(result, src, comm))
        measured.append(k)
    del materialised

    comm_profile: CommProfile | None = None
    comm_meta: dict = {}
    if comm.world_size > 1:
        if known["comm"] is not None:
            comm_profile = CommProfile(**known["comm"])
            cached.append("comm")
        else:
            if progress:
                progress("collectives across all ranks")
            samples = measure_collectives(
                comm,
                tdev,
                comm_sizes(settings.comm_sizes_bytes, min(d.memory_bytes for d in devices)),
                Timing(warmup=settings.warmup, repeats=settings.repeats),
            )
            bw, lat = fit_comm(samples, comm.world_size)
            comm_profile = CommProfile(bytes_per_s=bw, latency_s=lat)
            comm_meta = {"samples": [(s.name, s.nbytes, s.seconds) for s in samples]}
            measured.append("comm")

    # each type's memory is the device's (the smallest among ranks of that type)
    for k, p in profiles.items():
        p.memory_bytes = min(d.memory_bytes for d in devices if d.type_key == k)

    if rank == 0 and use_cache and measured:
        db = ProfileDatabase.load(cache)
        for k in measured:
            if k != "comm":
                db.put_device(keys[k], profiles[k])
        if "comm" in measured and comm_profile is not None:
            db.put_comm(comm_key, comm_profile, comm_meta)
        db.save()
        logger.info("profile database %s: stored %s", db.path, ", ".join(measured))
    if comm.world_size > 1:
        comm.barrier()
    return MeasuredProfiles(
        profiles=profiles,
        comm=comm_profile,
        model=spec.name,
        seq_len=seq_len,
        dtype=dtype,
        measured=measured,
        cached=cached,
        elapsed_s=time.perf_counter() - started,
    )
