"""scripts/gpu_check.py's checks of how communication is timed and overlapped on a GPU (issue
38, findings 9 and 10), in a module of their own (gpu_check.py is near the 900-line bound).

  comm_wait_events   (one GPU) NCCL's `work.wait()` does not block the host, it makes the
                     compute stream wait: `StepClock.wait` must count that stall from CUDA
                     events (a wait on a side stream held by torch.cuda._sleep stands in for
                     a collective in flight); the host's own time in the wait stays near 0.
                     CPU part: the emulated stream's stall counted at the next compute.
  bf16_cross_reduce  (world size >= 2, `--collectives`) the bf16 all-reduce between shard
                     groups (all-to-all, fp32 sum on a side stream, all-gather) gives every
                     owner the fp32 sum of the bf16 values rounded once, the same bits on
                     every rank, while the compute stream keeps running.
  boundary_overlap   (one GPU) runtime/boundary.py's copy streams: a deferred read runs beside
                     busy compute, a later write does not hold it, the data bitwise.
  input_prefetch     (one GPU) a step's inputs (`HostLink.inputs`: pageable host tensors, as
                     the data hands them in) staged in pinned memory and copied on their own
                     stream while the compute stream is busy: the host does not wait, the copy
                     lands before the busy work ends, the data bitwise.
"""

from __future__ import annotations

import time

import torch

from gpu_setup import Setup


def check_comm_wait_events(setup: Setup) -> tuple[list[str], str]:
    from cephalo.runtime.collectives.comm import Handle
    from cephalo.runtime.collectives.emulated import EmulatedStream
    from cephalo.runtime.emulation import ComputeEmulator
    from cephalo.runtime.engine.step_clock import StepClock

    failures: list[str] = []
    if not setup.cuda:
        stream = EmulatedStream()
        clock = StepClock(setup.device, ComputeEmulator(1.0), stream)
        due = time.perf_counter() + 0.05
        clock.wait(Handle([], lambda: stream.wait_until(due)))
        host = clock.comm_wait_s
        with clock.compute():
            pass
        stall = clock.comm_wait_s - host
        if host > 0.02 or not 0.03 < stall < 0.2:
            failures.append(f"emulated: host wait {host:.3f}s, stall {stall:.3f}s (want ~0, ~0.05)")
        return failures, f"emulated stall {stall * 1e3:.0f} ms counted, host {host * 1e3:.1f} ms"
    device = setup.device
    clock = StepClock(device, ComputeEmulator(1.0))
    clock.reset()  # the step's start event (collect reads the events only after one)
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the "collective": some 0.1-0.2 s of GPU clock cycles
        done = torch.cuda.Event()
        done.record(side)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
    end.record(side)

    def wait() -> None:  # NCCL's work.wait(): the current stream waits, the host does not
        torch.cuda.current_stream(device).wait_event(done)

    t0 = time.perf_counter()
    clock.wait(Handle([], wait))
    host = time.perf_counter() - t0
    with clock.compute():
        torch.ones(1, device=device).add_(1)
    with clock.compute():  # the same run: no events of its own (step_clock.py)
        torch.ones(1, device=device).add_(1)
    records = clock.records
    times = clock.collect()  # (was `collect_busy`, which StepClock no longer has)
    torch.cuda.synchronize(device)
    sleep_s = start.elapsed_time(end) / 1000.0
    if host > 0.5 * sleep_s:
        failures.append(f"the host blocked {host:.3f}s in an asynchronous wait")
    if times.comm_wait_s < 0.5 * sleep_s:
        failures.append(
            f"the stream's stall ({sleep_s:.3f}s) was not counted: comm_wait_s "
            f"{times.comm_wait_s:.3f}s (StepClock's wait events)"
        )
    if records != 4 or times.busy_s <= 0 or times.busy_s > 0.5 * sleep_s:
        failures.append(
            f"a run of two compute spans after a wait: {records} events before collect "
            f"(want 4: start, the wait's two, the run's start), busy {times.busy_s:.4f}s"
        )
    return (
        failures,
        f"stall {times.comm_wait_s * 1e3:.0f} ms counted from events (host {host * 1e3:.1f} ms)",
    )


def check_bf16_cross_reduce(comm, device: torch.device) -> list[str]:
    """Every rank one owner of one segment: the bf16 reduce's sums against the reference."""
    import torch.distributed as dist

    from cephalo.runtime.collectives.shard_groups import _Bf16Reduce

    n = comm.world_size
    if n < 2:
        return []
    group = dist.new_group(ranks=list(range(n)))
    numel = 1000 + 7  # not a multiple of the owners: the padding is cut off
    values = [
        torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)).to(torch.bfloat16)
        for r in range(n)
    ]
    expect = torch.stack([v.float() for v in values]).sum(0).to(torch.bfloat16)
    grad = values[comm.rank].float().to(device)
    red = _Bf16Reduce.start(grad, 0, numel, group, n)
    red.gather()
    busy = torch.randn(256, 256, device=device) @ torch.randn(256, 256, device=device)
    red.finish()
    got = grad.to(torch.bfloat16).cpu()
    failures = []
    if not torch.equal(got, expect):
        bad = int((got != expect).sum())
        failures.append(f"bf16 cross-group reduce: {bad} of {numel} sums differ from fp32-summed")
    if not bool(busy.isfinite().all()):
        failures.append("bf16 cross-group reduce: compute beside it went wrong")
    return failures


def check_boundary_overlap(setup: Setup) -> tuple[list[str], str]:
    """runtime/boundary.py's copy streams: a deferred read of an offloaded boundary runs while
    the compute stream is still busy (a torch.cuda._sleep stands in for the recompute), a
    write does not wait behind it, and what the compute stream reads after `ready` is
    bitwise the tensor put (the engine-level bitwise check: `offload_bitwise`)."""
    from cephalo.runtime.boundary import BoundaryStore
    from cephalo.runtime.memory import MemoryLedger

    n, failures = 1 << 22, []
    store = BoundaryStore(MemoryLedger(0, setup.device), setup.device, offload=True)
    src = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(setup.device)
    store.put((1, 0), src)
    overlapped = None
    with store.loaded((1, 0), deferred=True) as staged:
        if setup.cuda:
            busy = torch.cuda.Event()
            torch.cuda._sleep(400_000_000)  # the recompute: ~0.2-0.4 s on the compute stream
            busy.record()
        store.put((2, 0), src * 0 + 1)  # queued behind the sleep: must not hold the read
        if setup.cuda:
            copied = store._pending[staged.data_ptr()]
            time.sleep(0.05)
            overlapped = copied.query() and not busy.query()
        store.ready(staged)
        got = (staged * 1).cpu()
    with store.loaded((2, 0)) as ones:
        if not bool((ones == 1).all()):
            failures.append("the second write did not land")
    if not torch.equal(got, src.cpu()):
        failures.append("the deferred read is not bitwise the tensor put")
    if overlapped is False:
        failures.append("the read waited for the compute stream (no overlap)")
    store.clear()
    note = "read beside compute, bitwise" if overlapped else "bitwise (CPU: no streams)"
    return failures, note


def check_input_prefetch(setup: Setup) -> tuple[list[str], str]:
    """runtime/state/host_state.py `HostLink.inputs`: a step's inputs reach the device while
    the compute stream is busy (a torch.cuda._sleep stands in for the previous step's
    optimizer). A `non_blocking` copy from pageable memory would first wait, on the host, for
    the compute stream to drain; from pinned memory on the inputs' own stream the host goes
    on at once, the copy lands before the busy work ends, and what the compute stream reads
    after it is bitwise the host's tensors."""
    from cephalo.runtime.memory import MemoryLedger
    from cephalo.runtime.state.host_state import HostLink

    link = HostLink(MemoryLedger(0, setup.device), setup.device)
    ids = torch.randint(0, 50_000, (64, 2048), generator=torch.Generator().manual_seed(5))
    labels = ids.roll(1, dims=1)
    failures: list[str] = []
    overlapped, host_s = None, None
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
        busy = torch.cuda.Event()
        torch.cuda._sleep(400_000_000)  # ~0.2-0.4 s of work queued on the compute stream
        busy.record()
        t0 = time.perf_counter()
        out = link.inputs([ids, labels, None])
        host_s = time.perf_counter() - t0
        copied = torch.cuda.Event()
        copied.record(link._inputs)
        time.sleep(0.05)
        overlapped = copied.query() and not busy.query()
    else:
        out = link.inputs([ids, labels, None])
    got = [(t * 1).cpu() for t in out[:2]]  # read on the compute stream, after its wait
    if not (torch.equal(got[0], ids) and torch.equal(got[1], labels)):
        failures.append("the inputs on the device are not bitwise the host's")
    if out[2] is not None:
        failures.append("an absent input came back as a tensor")
    if overlapped is False:
        failures.append("the inputs' copy waited for the compute stream (no overlap)")
    if host_s is not None and host_s > 0.1:
        failures.append(f"the host waited {host_s:.3f} s in the copy (a pageable copy's sync)")
    if host_s is None:
        return failures, "bitwise (CPU: no streams)"
    return failures, f"copied beside busy compute, host {host_s * 1e3:.1f} ms, bitwise"
