"""Exact-size page-locked host memory (runtime/state/pinned.py): the arena's bookkeeping, and the
engine's offloaded boundaries taking exactly the bytes the ledger and the cost model count.
(Page-locking itself needs CUDA: scripts/gpu_check.py checks it on a GPU.)"""

from __future__ import annotations

import pytest
import torch

from cephalo.costmodel.host import host_bytes
from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.pinned import ALIGN, PinnedArena, pinned_empty
from engine_common import LR, make_data, make_plan


def test_arena_carves_first_fit_and_merges_freed_runs():
    arena = PinnedArena(4 * ALIGN, pin=False)
    a = arena.alloc(ALIGN // 4, torch.float32)  # one run of ALIGN bytes
    b = arena.alloc(ALIGN // 2, torch.float16)
    c = arena.alloc(2 * ALIGN // 4, torch.float32)  # two runs
    assert a.numel() == ALIGN // 4 and a.dtype == torch.float32
    assert arena.in_use == arena.peak == 4 * ALIGN
    assert arena.alloc(1, torch.float32) is None and arena.misses == 1  # full
    a.fill_(1.0), b.fill_(2.0), c.fill_(3.0)
    assert a.sum() == ALIGN // 4 and c.sum() == 3 * 2 * ALIGN // 4  # pieces do not overlap
    arena.free(a)
    arena.free(b)  # a and b merge: a two-run piece fits where they were
    d = arena.alloc(2 * ALIGN // 4, torch.float32)
    assert d is not None and arena.in_use == 4 * ALIGN
    arena.free(c)
    arena.free(d)
    assert arena.in_use == 0 and arena._free == [(0, 4 * ALIGN)]
    assert arena.alloc(0, torch.float32).numel() == 0


def test_pinned_empty_is_exact_size():
    t = pinned_empty(1000, torch.float16)
    assert t.numel() == 1000 and t.untyped_storage().nbytes() == 2000


@pytest.mark.parametrize("mode", ["lga", "standard"])
def test_offloaded_boundaries_fill_the_arena_exactly(mode):
    """Offloaded boundaries under uneven micro-batches (5 samples in 2 + 2 + 1) come from one
    block sized from the plan: no request misses it, its peak is its size (LGA keeps every
    micro-batch's boundaries at once; standard one at a time), the ledger's host peak is the
    same number, and under LGA so is the cost model's host_bytes."""
    plan = make_plan([5], [1.0], [2], offload=True)
    cfg = EngineConfig(mode=mode, pinned_arena=True)
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), cfg)
    for x, y in make_data(2, 5):
        stats = engine.train_step(x, y, lr=LR)
    arena = engine.ledger.arena
    assert arena is not None and arena.misses == 0
    assert arena.peak == arena.capacity == engine.boundary_host_bytes()
    assert stats.host_peak_bytes == arena.capacity
    assert arena.in_use == 0  # every boundary went back after the step
    spec = engine.model.spec
    if mode == "lga":
        assert arena.capacity == int(host_bytes(spec, plan.seq_len, "fp32", 5, True, 0.0))
    # the results are those of boundaries kept on the device
    ref = Engine(
        build_model("gpt-tiny"), make_plan([5], [1.0], [2]), LocalComm(), EngineConfig(mode=mode)
    )
    for x, y in make_data(2, 5):
        ref_stats = ref.train_step(x, y, lr=LR)
    assert stats.loss == ref_stats.loss


def test_emulated_link_copies_run_on_a_copy_engine():
    """An emulated link (`pcie=`) costs what a GPU's copy engine costs (runtime/boundary.py):
    a write to the host holds nothing, a read waits for its entry's write and its own link
    time, and a deferred read (a block's output gradient, beside its recompute) holds the
    compute only for what is left of it."""
    import time

    from cephalo.runtime.boundary import BoundaryStore
    from cephalo.runtime.emulation import ComputeEmulator
    from cephalo.runtime.memory import MemoryLedger
    from cephalo.runtime.state.host_state import HostLink

    cpu = torch.device("cpu")
    link = HostLink(MemoryLedger(0, cpu), cpu, 6.5e5, ComputeEmulator(1.0))
    store = BoundaryStore(MemoryLedger(0, cpu), cpu, offload=True, link=link)
    t = torch.randn(1 << 14)  # 64 KiB (no fresh pages per buffer) at 650 kB/s: 0.1 s a copy
    link_s = t.numel() * 4 / 6.5e5
    store.put((0, 0), t)  # first touches of fresh memory (page faults) are not the link's
    with store.loaded((0, 0)):
        pass
    store.drop((0, 0))
    t0 = time.perf_counter()
    store.put((1, 0), t)
    assert time.perf_counter() - t0 < 0.5 * link_s  # the write runs on the copy engine
    with store.loaded((1, 0)) as x:  # at once: behind its write, then its own copy
        assert torch.equal(x, t)
    assert time.perf_counter() - t0 >= 1.8 * link_s
    store.put((2, 0), t)
    time.sleep(link_s)  # the write has crossed
    t0 = time.perf_counter()
    with store.loaded((2, 0), deferred=True) as g:
        time.sleep(0.75 * link_s)  # the recompute beside the read
        store.ready(g)
        assert torch.equal(g, t)
    took = time.perf_counter() - t0
    assert 0.9 * link_s <= took < 1.5 * link_s, f"{took:.3f}s: the read did not overlap"
    assert len(store) == 2 and link.copied_bytes == 6 * t.numel() * 4
