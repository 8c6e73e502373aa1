"""scripts/gpu_check.py's checks of a node's host and device reserves (issue 38 findings 3, 12;
issue 41 point 6).

host_threads       the host AdamW of a GPU rank on the node's cores (`HostAdamW.threads`): the
                   same values on 1 thread and on the node's, the rank's count restored after
local_host_memory  `cephalo plan` for this machine's own GPUs counts on its available host
                   memory less reserves and says so; a cluster of other GPUs says what it assumed
device_reserve     the device memory outside PyTorch's allocator once an NCCL communicator
                   exists within the reserve the planner keeps (`device_reserve_bytes`)
"""

from __future__ import annotations

import time

import torch

from gpu_setup import Setup


def check_host_threads(setup: Setup) -> tuple[list[str], str]:
    """Issue 38, finding 12: torchrun starts every rank on one thread (OMP_NUM_THREADS=1); the
    host AdamW of a GPU rank runs on the node's cores (`HostAdamW.threads`, what the trainer
    sets from `threads_per_rank`). The same values on 1 thread and on the node's, the rank's
    count restored after, and the speed-up (a note: it depends on the host's memory bandwidth)."""
    from cephalo.launch.pool import threads_per_rank
    from cephalo.runtime.state.adamw import AdamWHyper
    from cephalo.runtime.state.host_state import HostAdamW, HostGroup

    n = 32_000_000 if setup.cuda else 1_000_000
    threads = threads_per_rank(1)
    failures, times, params = [], {}, {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in (None, threads):
            g = torch.Generator().manual_seed(0)
            group = HostGroup(
                *(torch.randn(n, generator=g) for _ in range(2)),
                torch.zeros(n),
                torch.zeros(n),
                [(0, n * 3 // 4)],
            )
            opt = HostAdamW([group], AdamWHyper(), "foreach", t)
            laps = []
            for step in range(1, 4):
                with opt.threads():
                    t0 = time.perf_counter()
                    opt.step_group(0, 1e-4, step)
                    laps.append(time.perf_counter() - t0)
                if torch.get_num_threads() != 1:
                    failures.append(f"host threads {t}: the rank's thread count was not restored")
            times[t], params[t] = min(laps[1:]), group.param
    finally:
        torch.set_num_threads(before)
    if not torch.equal(params[None], params[threads]):
        failures.append(f"host AdamW on {threads} threads changed the values")
    note = (
        f"{n / 1e6:.0f}M elements: {times[None] * 1e3:.1f} ms on 1 thread, "
        f"{times[threads] * 1e3:.1f} ms on {threads} ({times[None] / times[threads]:.2f}x)"
    )
    return failures, note


def check_local_host_memory(setup: Setup) -> tuple[list[str], str]:
    """Issue 41, point 6: the host memory a plan for this machine counts on is the machine's
    available memory, found by matching the CUDA devices to the catalog's types (only a GPU
    can check the match); a plan for GPUs this machine lacks says what it assumed."""
    import argparse

    from cephalo.commands.plan import host_memory_of
    from cephalo.specs.catalog.devices import device_type_for_gpu, is_unlisted
    from cephalo.train.discovery import usable_host_bytes

    local = []
    for i in range(torch.cuda.device_count() if setup.cuda else 0):
        props = torch.cuda.get_device_properties(i)
        key = device_type_for_gpu(props.name, props.total_memory)
        local.append(f"{key}:mem={props.total_memory // 2**20}MiB" if is_unlisted(key) else key)
    spec = ",".join(local) or "cpu,cpu"
    args = argparse.Namespace(host_memory=None)
    failures = []
    memory, note = host_memory_of(args, spec)
    available = usable_host_bytes(len(local) or 2)  # available less the reserves
    if memory is None or abs(memory - available) > 0.1 * available:
        failures.append(
            f"{spec}: planned with {memory} bytes of host memory, available {available}"
        )
    if not note or "this machine's available memory" not in note:
        failures.append(f"{spec}: the note does not say the machine's memory was used: {note!r}")
    other = "l4@node0,a6000@node1" if "l4" not in spec else "t4@node0,p40@node1"
    memory, note = host_memory_of(args, other)
    if memory is not None or not note or "assumed 256 GiB" not in note:
        failures.append(f"{other}: expected the assumed 256 GiB, got {memory}, {note!r}")
    return failures, f"{spec}: {available / 2**30:.1f} GiB" if available else spec


def check_device_reserve(setup: Setup) -> tuple[list[str], str]:
    from cephalo.costmodel.memory import device_reserve_bytes
    from cephalo.runtime.device_memory import (
        EmulatedDeviceMemory,
        outside_allocator_bytes,
        reserve_note,
    )
    from cephalo.specs.catalog.devices import device_type_for_gpu

    if not setup.cuda:
        planned = device_reserve_bytes("a100x80")
        mode = EmulatedDeviceMemory(0, 2 * planned, planned)
        failures = [] if mode.live_bytes == planned else [f"charged {mode.live_bytes}"]
        return failures, f"emulated device starts at the reserve ({planned >> 20} MiB)"
    flag = torch.ones(1, device=setup.device)
    setup.comm.all_reduce(flag, "sum")  # the communicator exists (NCCL creates it lazily)
    torch.ones(64, 64, device=setup.device) @ torch.ones(64, 64, device=setup.device)  # cuBLAS
    torch.cuda.synchronize(setup.device)
    props = torch.cuda.get_device_properties(setup.device)
    planned = device_reserve_bytes(device_type_for_gpu(props.name, props.total_memory))
    measured = outside_allocator_bytes(setup.device)
    failures = [] if measured <= planned else [reserve_note(measured, planned)]
    return failures, reserve_note(measured, planned)


def check_profiler_memory(setup: Setup) -> tuple[list[str], str]:
    """Issue 38, finding 1: the profiler materialises only the units it measures, in host
    memory (their constant buffers on the device), and the device holds their gathered
    compute-dtype copy and the trained parameters' gradients: a measurement runs there (no
    device mismatch between host parameters, device buffers and inputs) and its peak stays
    well under the whole model's fp32 bytes."""
    from cephalo.modeling.registry import build_model
    from cephalo.profiling.profiler import materialize_measured, measure_device
    from cephalo.profiling.settings import ProfileSettings
    from cephalo.specs.cluster import Cluster

    meta = build_model("gpt-tiny", n_layer=12)
    fp32 = 4 * meta.spec.total_params
    device = Cluster.parse("cpu").devices[0]
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
        base = torch.cuda.memory_allocated(setup.device)
    model = materialize_measured(meta, setup.device)
    failures = []
    on_device = [n for n, p in model.named_parameters() if p.device.type == setup.device.type]
    if setup.cuda and on_device:
        failures.append(f"parameters materialised on the device: {on_device[:3]}")
    settings = ProfileSettings(repeats=1, warmup=0, time_cap_s=5.0, max_micro_batch=2)
    profile = measure_device(model, 32, "bf16", device, setup.device, settings)
    if not profile.units["block"].fwd_s.xs:
        failures.append("no block measurement")
    if not setup.cuda:
        return failures, "measured on the host (CPU: no device peak)"
    peak = torch.cuda.max_memory_allocated(setup.device) - base
    if peak > 0.4 * fp32:
        failures.append(f"profiling peaked at {peak >> 20} MiB, over 0.4x the model's fp32 bytes")
    return failures, f"peak {peak / 2**20:.1f} MiB for a model of {fp32 / 2**20:.1f} MiB fp32"
