"""GPU check of the engine's CUDA paths; run it through scripts/gpu_check.sh (docs/gpu.md).

On one CUDA GPU (torchrun, one process, NCCL at world size 1) every check below runs and one
summary table is printed; `--cpu` runs each check's CPU part (small models, LocalComm), which
a CI test does, so the checks themselves cannot rot unseen. Each check is a function
returning its failures; a check that raises is a failure, not the end of the run.

  bf16_train       GPT-2 124M trains in bf16 (the loss falls); the ledger's device peak is
                   within 10 % of torch.cuda.max_memory_allocated over a step; the update
                   (clip coefficient on the device, fused AdamW) makes no host sync
  fp16_scaling     fp16 with dynamic loss scaling: the first loss equals fp32's (1e-2), an
                   overflowing step is skipped and halves the scale, training goes on
  offload_bitwise  boundaries offloaded to pinned host memory (4 micro-batches) against kept
                   on the device: the same losses and weights, bitwise where the device run
                   repeats itself bitwise; the exact-size pinned arena serves every request
  staging_race     a deterministic probe of the side-stream ordering: a consumer queued
                   behind torch.cuda._sleep still reads its input correctly after the
                   boundary store's staging copy and HostLink.up reuse / overwrite memory
  host_link        HostLink's copies: pinned, direct and accumulated, uploads ordered
  host_state       host_state_fraction 0.5 and 1.0 (memory-tight): the losses of all state on
                   the device, pinned host buffers, the device state lower by exactly 14 bytes
                   per host-held element
  dropout          dropout 0.1 under micro-batches of 1 and of 4: the same losses
  standard_eval    the standard (FSDP-like) schedule equals LGA; evaluation equals the loss
  collectives      all_gather_v / reduce_scatter_v: uneven, zero and equal sizes (the even
                   collectives, no flattening copy), every dtype, sync and async
  hf_models        tiny Qwen2, Gemma 2, Gemma 3 and Qwen3-MoE (router loss on) directories:
                   transformers' own first loss on the device (fp32), and bf16 training
                   lowers the loss
  adapters         LoRA and QLoRA (NF4 base, torchao): transformers' first loss with LoRA, bf16
                   training lowers the loss, the NF4 base at most 0.3x bf16's bytes, NF4 codes
                   made on the GPU equal the CPU's
  chat_packed      chat data packed into windows against padded one per sample: the same loss
                   over the assistant's tokens (attention never crosses conversations on this
                   device's kernels), and a packed bf16 step
  replan_staging   a re-plan staged through host memory (train/replan.py): the old engine's
                   device memory is free before the new engine allocates, and the losses
                   equal those of a switch that keeps both engines on the device
  local_host_memory  `cephalo plan` for this machine's own GPUs (CUDA names matched to catalog
                   types, commands/plan.py) counts on its available host memory and says so; a
                   cluster of other GPUs says the 256 GiB it assumed (CPU part: `cpu,cpu`)
  device_reserve   the device memory outside PyTorch's allocator once an NCCL communicator
                   exists (`mem_get_info`: CUDA context, NCCL, cuBLAS) within the reserve the
                   planner keeps (costmodel/memory.py `device_reserve_bytes`, one group); both
                   figures in the note. CPU: the emulated device is charged the same reserve
  profiler_memory  the profiler's measured units materialised in host memory, their buffers on
                   the device: a measurement runs and peaks under 0.4x the model's fp32 bytes
                   (scripts/gpu_check_host.py; issue 38, finding 1)
  throughput       tokens/s and MFU of the engine against plain PyTorch (the same GPT-2 124M,
                   batch and bf16 autocast-free weights, fused AdamW) on this GPU
  step_syncs, adamw_split, step_split   issue 38's findings 11, 13 and 10 (scripts/
                   gpu_check_syncs.py): no host sync in a step after the first (GPT, Qwen3-MoE);
                   hierarchical plans keep the fused AdamW, bitwise under any shard cut; the
                   step clock's CUDA events split the device's span of the step
  comm_wait_events the stream's stall at an asynchronous collective wait counted from CUDA
                   events, the host not blocked (scripts/gpu_comm_checks.py)
  boundary_overlap an offloaded boundary's deferred read runs beside busy compute on its own
                   stream, bitwise the tensor put (with offload_bitwise: the engine on the
                   copy streams against the on-device run)
  input_prefetch   a step's inputs staged in pinned memory and copied on their own stream
                   beside busy compute, the host not waiting (scripts/gpu_comm_checks.py)

  pipeline_p2p     pipeline stages at world size 1: the boundary re-partition between two
                   stages' splits, the schedules, the exchange's device buffers and stream
                   order through a side-stream loopback (scripts/gpu_check_pipeline.py; with
                   `--collectives`, a 2-stage engine against one process, GPipe and 1F1B)

  compile          the blocks compiled (`parallel.compile`: graphs, inductor) against the
                   eager engine, GPT-2 124M bf16 with dropout: within rounding, the loss
                   falls, each mode's step time (scripts/gpu_check_compile.py)

`--collectives` (torchrun, one process per GPU, world size >= 2): the uneven NCCL collectives
and an uneven engine plan, skewed and near even (padded-even, runtime/collectives/padded.py), against one
process, and the bf16 all-reduce between shard groups on its side stream (scripts/gpu_comm_checks.py;
gpu_check.sh runs it where 2 GPUs exist).
Exit status: 0 all checks pass, 1 a check failed, 77 no CUDA GPU (nothing was run).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, however loaded
from gpu_comm_checks import (  # noqa: E402
    check_bf16_cross_reduce,
    check_boundary_overlap,
    check_comm_wait_events,
    check_input_prefetch,
)
from gpu_setup import Setup  # noqa: E402

SKIP = 77
ENGINE_STEPS = 3
TINY_SEQ = 32
"""Sequence length of the gpt-tiny checks (its context)."""
TIME_LIMIT_S = 480


@dataclass
class Result:
    name: str
    status: str
    seconds: float
    note: str


# ----------------------------------------------------------------------------- helpers
def _engine(setup: Setup, model: str, batches, micro, dtype: str, **kw):
    """One engine on one rank of `setup` (kw: plan fields, EngineConfig fields, model overrides)."""
    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    plan_kw = {k: kw.pop(k) for k in ("offload", "host", "overlap") if k in kw}
    overrides = kw.pop("overrides", {})
    rank = RankPlan(
        0,
        "gpu",
        batches,
        micro,
        -(-batches // micro),
        1.0,
        offload_activations=plan_kw.get("offload", False),
    )
    rank.host_state_fraction = plan_kw.get("host", 0.0)
    rank.overlap_reduce = plan_kw.get("overlap", True)
    seq = TINY_SEQ if model == "gpt-tiny" else setup.seq  # gpt-tiny's context is 32
    plan = Plan("manual", model, seq, batches, dtype, [rank])
    cfg = EngineConfig(device=str(setup.device), seed=0, **kw)
    return Engine(build_model(model, **overrides), plan, setup.comm, cfg)


def _data(vocab: int, batch: int, seq: int, steps: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


def _free(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.empty_cache()


def _vocab(setup: Setup) -> int:
    return 50257 if setup.cuda else 256


# ----------------------------------------------------------------------------- checks
def _no_host_sync(engine) -> list[int]:
    """Run the engine's update (clip coefficient, AdamW, zeroed gradients:
    `engine.update.device_step`) under `torch.cuda.set_sync_debug_mode("error")`: a host sync
    in it raises. Returns a one-item list counting the updates run that way."""
    step, count = engine.update.device_step, [0]

    def checked(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        count[0] += 1

    engine.update.device_step = checked
    return count


def check_bf16_train(setup: Setup) -> tuple[list[str], str]:
    batch, micro, steps = (8, 4, 8) if setup.cuda else (4, 2, 6)
    data = _data(_vocab(setup), batch, setup.seq) * steps
    engine = _engine(setup, setup.big_model, batch, micro, setup.low)
    no_sync = _no_host_sync(engine) if setup.cuda else None
    losses, ratios = [], []
    for x, y in data:
        _sync(setup)
        if setup.cuda:
            torch.cuda.reset_peak_memory_stats(setup.device)
        stats = engine.train_step(x, y, lr=3e-4 if setup.cuda else 3e-3)
        _sync(setup)
        losses.append(stats.loss)
        if setup.cuda:
            ratios.append(stats.peak_bytes / torch.cuda.max_memory_allocated(setup.device))
    failures = []
    if not losses[-1] < losses[0] - 0.3:
        failures.append(f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    if no_sync is not None:
        if no_sync[0] != len(data):
            failures.append(f"the update ran without a host sync {no_sync[0]} of {len(data)} steps")
        note += f"; {no_sync[0]} updates without a host sync"
    if ratios:
        worst = max(abs(1 - r) for r in ratios[1:])  # step 0 holds one-off allocations
        note += f"; ledger/allocator peak {min(ratios[1:]):.3f}-{max(ratios[1:]):.3f}"
        if worst > 0.10:
            failures.append(f"ledger peak off max_memory_allocated by {worst:.1%} (> 10 %)")
    del engine
    _free(setup)
    return failures, note


def check_fp16_scaling(setup: Setup) -> tuple[list[str], str]:
    model, batch, micro = "gpt-tiny", 4, 2
    data = _data(256, batch, TINY_SEQ, steps=4, seed=1)
    dtype = "fp16" if setup.cuda else "fp32"
    ref = _engine(setup, model, batch, micro, "fp32")
    half = _engine(setup, model, batch, micro, dtype, loss_scale_init=2.0**14)
    first_ref = ref.train_step(*data[0], lr=1e-3).loss
    first = half.train_step(*data[0], lr=1e-3)
    failures = []
    if abs(first.loss / first_ref - 1) > 1e-2:
        failures.append(f"first fp16 loss {first.loss:.5f} vs fp32 {first_ref:.5f}")
    note = f"first loss {first.loss:.4f} (fp32 {first_ref:.4f})"
    if setup.cuda:
        # a scale that overflows fp16 on the first backward: skipped, scale halved
        assert half.scaler is not None
        before = dict(half.full_state_dict())
        half.scaler.scale = 2.0**40
        over = half.train_step(*data[1], lr=1e-3)
        after = half.full_state_dict()
        if not over.skipped:
            failures.append("a step whose gradient overflowed fp16 was not skipped")
        if not all(torch.equal(before[k], after[k]) for k in before):
            failures.append("the skipped step changed the weights")
        if half.scaler.scale != 2.0**39:
            failures.append(f"the loss scale became {half.scaler.scale}, not 2**39")
        half.scaler.scale = 2.0**14  # a scale that fits again
        losses = [half.train_step(x, y, lr=1e-3) for x, y in data[2:]]
        if any(s.skipped for s in losses):
            failures.append("steps after the overflow kept overflowing")
        note += "; an overflowing step skipped, scale 2**40 -> 2**39"
    return failures, note


def _deterministic(setup: Setup):
    """Deterministic kernels for bitwise comparisons (restored by the caller)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    return was


def check_offload_bitwise(setup: Setup) -> tuple[list[str], str]:
    """Offloaded boundaries against the on-device run, bitwise. The on-device run fuses its
    tail (the last block in the head's pass, runtime/engine/tail_pass.py) and the offloaded one keeps
    the unfused order, so this compares the two orders on the device too."""
    batch, micro = (8, 2) if setup.cuda else (8, 2)  # 4 micro-batches
    data = _data(_vocab(setup), batch, setup.seq, steps=3, seed=2)
    was = _deterministic(setup)
    try:
        runs = []
        for offload in (False, False, True):
            engine = _engine(setup, setup.big_model, batch, micro, setup.low, offload=offload)
            if engine.fuse_tail == offload:
                raise AssertionError("the on-device run must fuse its tail, the offloaded not")
            losses = [engine.train_step(x, y, lr=3e-4).loss for x, y in data]
            state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
            arena = engine.ledger.arena
            runs.append((losses, state, arena, engine.ledger.host_peak_bytes))
            del engine
            _free(setup)
    finally:
        torch.use_deterministic_algorithms(was)
    (dev, dev_state, _, _), (again, again_state, _, _), (off, off_state, arena, host_peak) = runs
    repeatable = dev == again and all(torch.equal(dev_state[k], again_state[k]) for k in dev_state)
    failures = []
    if repeatable:
        if off != dev or not all(torch.equal(dev_state[k], off_state[k]) for k in dev_state):
            failures.append(
                f"offload (unfused tail) is not bitwise the on-device run (fused): {off} vs {dev}"
            )
        note = "bitwise equal"
    else:  # the device itself does not repeat bitwise: compare within rounding
        worst = max(abs(a - b) / abs(b) for a, b in zip(off, dev, strict=True))
        if worst > 1e-3:
            failures.append(f"offload changed the losses by {worst:.2e}: {off} vs {dev}")
        note = f"device not bitwise repeatable; losses within {worst:.1e}"
    if setup.cuda:
        if arena is None or not arena.pinned:
            failures.append("offloaded boundaries are not in the pinned arena")
        elif arena.misses or arena.peak != arena.capacity or host_peak != arena.capacity:
            failures.append(
                f"pinned arena: {arena.misses} misses, peak {arena.peak} of {arena.capacity} "
                f"bytes, ledger host peak {host_peak}"
            )
        else:
            note += f"; pinned arena {arena.capacity / 2**20:.1f} MiB, exactly filled"
    return failures, note


def check_staging_race(setup: Setup) -> tuple[list[str], str]:
    """A consumer kernel queued behind a long `torch.cuda._sleep` must read its input before
    the side stream reuses (staging) or overwrites (upload) that memory."""
    from cephalo.runtime.boundary import BoundaryStore
    from cephalo.runtime.memory import MemoryLedger
    from cephalo.runtime.state.host_state import HostLink

    n, failures = 1 << 22, []
    ledger = MemoryLedger(0, setup.device)
    store = BoundaryStore(ledger, setup.device, offload=True)
    store.put((1, 0), torch.full((n,), 7.0, device=setup.device))
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
    # 1. staging: `x`'s block goes back to the allocator while `y = 2x` still waits
    x = torch.full((n,), 1.0, device=setup.device)
    if setup.cuda:
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the compute stream
    y = x * 2
    del x
    with store.loaded((1, 0)) as staged:
        got = staged.sum().item()
    if not torch.equal(y.cpu(), torch.full((n,), 2.0)):
        failures.append("the staging copy overwrote memory a queued kernel still read")
    if got != 7.0 * n:
        failures.append(f"the staged boundary holds the wrong values (sum {got})")
    store.clear()
    # 2. upload: `dst` is read by a kernel queued behind the sleep, then uploaded into
    link = HostLink(ledger, setup.device)
    dst = torch.full((n,), 1.0, device=setup.device)
    src = ledger.alloc("host/state", n, torch.float32, pin=True).fill_(5.0)
    if setup.cuda:
        torch.cuda._sleep(200_000_000)
    y = dst * 3
    link.up(dst, src)
    link.wait_uploads()
    if not torch.equal(y.cpu(), torch.full((n,), 3.0)):
        failures.append("HostLink.up overwrote memory a queued kernel still read")
    if not torch.equal(dst.cpu(), torch.full((n,), 5.0)):
        failures.append("HostLink.up did not land")
    link.sync()
    return failures, "consumers read before the side stream wrote" if not failures else ""


def check_host_link(device: torch.device) -> list[str]:
    """HostLink's CUDA path on its own: exact values through pinned memory and the side stream."""
    from cephalo.runtime.memory import MemoryLedger
    from cephalo.runtime.state.host_state import HostLink

    failures = []
    ledger = MemoryLedger(0, device)
    link = HostLink(ledger, device)
    n = 1 << 22
    src = torch.arange(n, dtype=torch.float32, device=device)
    host = ledger.alloc("host/state", n, torch.float32, pin=True).zero_()
    if device.type == "cuda" and not host.is_pinned():
        failures.append("host link: ledger host buffers are not pinned")
    link.down(host, src, accumulate=False)
    src2 = src * 2  # queued on the compute stream after the first copy was issued
    link.down(host, src2, accumulate=True)  # lands in pinned staging, added by sync
    del src2  # the caching allocator must not reuse it before the copy ran (record_stream)
    torch.empty(n, device=device).fill_(-1.0)  # would overwrite it if reused too early
    link.sync()
    expect = torch.arange(n, dtype=torch.float32) * 3
    if not torch.equal(host, expect):
        failures.append("host link: downward copies (direct + accumulated) are wrong")
    if ledger.current_by_category.get("host/staging", 0) != 0:
        failures.append("host link: a staging buffer outlived sync")
    back = torch.zeros(n, device=device)
    link.up(back, host)
    link.wait_uploads()
    back.add_(1.0)  # on the compute stream: must see the upload
    if not torch.equal(back.cpu(), expect + 1):
        failures.append("host link: upload / wait_uploads ordering is wrong")
    link.sync()
    return failures


def check_host_state(setup: Setup) -> tuple[list[str], str]:
    batch, micro = (8, 4) if setup.cuda else (4, 2)
    data = _data(_vocab(setup), batch, setup.seq, steps=3, seed=3)
    tol = 1e-3 if setup.cuda else 1e-6
    ref = _engine(setup, setup.big_model, batch, micro, setup.low)
    ref_losses = [ref.train_step(x, y, lr=3e-4).loss for x, y in data]
    ref_state = ref.ledger.current_by_category["state"]
    del ref
    _free(setup)
    failures, notes = [], []
    for host, overlap in ((0.5, True), (1.0, False)):
        eng = _engine(setup, setup.big_model, batch, micro, setup.low, host=host, overlap=overlap)
        losses = [eng.train_step(x, y, lr=3e-4).loss for x, y in data]
        tag = f"host_state_fraction {host}"
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        if worst > tol:
            failures.append(f"{tag} changed the losses by {worst:.1e}: {losses} vs {ref_losses}")
        hosted = sum(us.host_n for us in eng.shards)
        drop = ref_state - eng.ledger.current_by_category["state"]
        per = 16 - torch.empty((), dtype=eng.dtype).element_size()
        if drop != per * hosted:
            failures.append(f"{tag}: device state fell by {drop} bytes, not {per} x {hosted}")
        if setup.cuda and not all(us.host.param.is_pinned() for us in eng.shards if us.host):
            failures.append(f"{tag}: host state is not page-locked")
        notes.append(f"{host}: {hosted / 1e6:.1f}M elements on the host, {worst:.0e}")
        del eng
        _free(setup)
    return failures, "; ".join(notes)


def check_dropout(setup: Setup) -> tuple[list[str], str]:
    data = _data(256, 4, TINY_SEQ, steps=3, seed=4)
    runs = []
    for micro in (1, 4):
        eng = _engine(setup, "gpt-tiny", 4, micro, "fp32", overrides={"dropout": 0.1})
        runs.append([eng.train_step(x, y, lr=1e-3).loss for x, y in data])
    plain = _engine(setup, "gpt-tiny", 4, 4, "fp32")
    without = plain.train_step(*data[0], lr=1e-3).loss
    worst = max(abs(a - b) / abs(b) for a, b in zip(*runs, strict=True))
    failures = []
    if worst > 1e-4:
        failures.append(f"dropout masks depend on the micro-batching: {runs[0]} vs {runs[1]}")
    if runs[0][0] == without:
        failures.append("dropout 0.1 gave the loss of no dropout")
    return failures, f"micro-batches 1 vs 4 within {worst:.0e}"


def check_standard_eval(setup: Setup) -> tuple[list[str], str]:
    data = _data(256, 6, TINY_SEQ, steps=3, seed=5)
    runs = {}
    for mode in ("lga", "standard"):
        eng = _engine(setup, "gpt-tiny", 6, 2, "fp32", mode=mode)
        runs[mode] = [eng.train_step(x, y, lr=1e-3).loss for x, y in data]
        runs[mode + "_eval"] = eng.eval_loss(*data[0])
    worst = max(abs(a - b) / abs(b) for a, b in zip(runs["lga"], runs["standard"], strict=True))
    failures = []
    if worst > 1e-4:
        failures.append(f"standard schedule differs from LGA: {runs['standard']} vs {runs['lga']}")
    if abs(runs["lga_eval"] / runs["standard_eval"] - 1) > 1e-4:
        failures.append("evaluation differs between the schedules")
    fresh = _engine(setup, "gpt-tiny", 6, 2, "fp32")
    before = fresh.eval_loss(*data[0])
    first = fresh.train_step(*data[0], lr=0.0).loss
    if abs(before / first - 1) > 1e-5:
        failures.append(f"eval_loss {before} != the training loss {first} of the same weights")
    return failures, f"standard vs LGA within {worst:.0e}; eval = loss"


def check_uneven_collectives(comm, device: torch.device) -> list[str]:
    """Uneven `all_gather_v` / `reduce_scatter_v` (zero and equal shards included), sync and
    async, in fp32, bf16 and fp16 (the gather also in place: the shard inside the output), and `all_reduce` sum / max, against what each rank computes
    by itself; then a cross-rank size mismatch must raise `CephaloError` on every rank. Returns
    this rank's failures (every rank must call it: it runs collectives)."""
    from cephalo.errors import CephaloError

    world, rank = comm.world_size, comm.rank
    cases = [
        [(3 * k + 2) % 5 for k in range(world)],  # uneven, a zero on some world sizes
        [0] * (world - 1) + [5],  # only the last rank owns anything
        [0] * world,  # nothing at all
        [4099 if k == 0 else 17 * k for k in range(world)],  # large and odd
        [64] * world,  # equal: the even collectives
    ]
    failures = []
    even_before = dict(comm.counters.even_calls)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for sizes in cases:
            for async_op in (False, True):
                what = f"{type(comm).__name__} {str(dtype)[6:]} sizes {sizes} async={async_op}"
                shard = _shard_values(rank, sizes[rank]).to(device, dtype)
                out = torch.full((sum(sizes),), -1.0, dtype=dtype, device=device)
                _backend(comm, "all_gather_v")(out, shard, sizes, async_op).wait()
                expect = torch.cat([_shard_values(k, n) for k, n in enumerate(sizes)])
                if not torch.equal(out.float().cpu(), expect):
                    failures.append(f"all_gather_v {what}: got {out[:8].tolist()}...")
                # in place, as the engine gathers (runtime/engine/unit_comm.py `gather_piece`:
                # each rank's shard cast into its own piece of the output)
                start = sum(sizes[:rank])
                out = torch.full((sum(sizes),), -1.0, dtype=dtype, device=device)
                own = out[start : start + sizes[rank]]
                own.copy_(_shard_values(rank, sizes[rank]))
                _backend(comm, "all_gather_v")(out, own, sizes, async_op).wait()
                if not torch.equal(out.float().cpu(), expect):
                    failures.append(f"in-place all_gather_v {what}: got {out[:8].tolist()}...")
                full = _full_values(rank, sum(sizes)).to(device, dtype)
                mine = torch.full((sizes[rank],), -1.0, dtype=dtype, device=device)
                _backend(comm, "reduce_scatter_v")(mine, full, sizes, async_op).wait()
                total = sum(_full_values(k, sum(sizes)) for k in range(world))
                start = sum(sizes[:rank])
                if not torch.equal(mine.float().cpu(), total[start : start + sizes[rank]]):
                    failures.append(f"reduce_scatter_v {what}: got {mine[:8].tolist()}...")
    if world > 1 and type(comm).__name__ in ("GlooComm", "NcclComm"):
        # the equal case, 3 dtypes x sync/async (gloo gathers with its broadcasts: even_gather)
        for name in ("all_gather_v", "reduce_scatter_v"):
            took = comm.counters.even_calls[name] - even_before[name]
            if took < 6 and (name != "all_gather_v" or comm.even_gather):
                failures.append(f"equal sizes took the even {name} {took} times, not 6")
    for op, expect in (("sum", world * (world + 1) / 2), ("max", float(world))):
        t = torch.full((3,), float(rank + 1), device=device)
        comm.all_reduce(t, op=op)
        if t.cpu().tolist() != [expect] * 3:
            failures.append(f"all_reduce {op}: got {t.tolist()}, expected {expect}")
    # rank 0 swaps the sizes: every rank (the healthy ones too) must raise, none may hang
    if comm.validate and world > 1:
        sizes = [2] + [1] * (world - 1)
        if rank == 0:
            sizes = sizes[::-1]
        try:
            shard = torch.zeros(sizes[rank], device=device)
            comm.all_gather_v(torch.zeros(sum(sizes), device=device), shard, sizes)
            failures.append("a cross-rank size mismatch did not raise")
        except CephaloError as err:
            if "disagree on sizes" not in str(err):
                failures.append(f"size mismatch raised the wrong error: {err}")
    return failures


def _backend(comm, name: str) -> Callable:
    """The collective `name` as the checks call it. At world size 1 the public call is a copy
    whatever the backend (runtime/collectives/comm.py), so one GPU calls the backend's own implementation
    (NCCL's padding, dtypes and streams) directly; at world size >= 2 the public call."""
    if comm.world_size == 1:
        return getattr(comm, f"_{name}")
    return getattr(comm, name)


def _shard_values(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s shard of `n` elements: small halves, exact in fp32, bf16 and fp16."""
    return (rank + 1) * 0.5 + (torch.arange(n) % 7).float()


def _full_values(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s full reduce-scatter input: sums over a few ranks stay exact in bf16."""
    return (rank + 1) + (torch.arange(n) % 5).float()


def check_collectives(setup: Setup) -> tuple[list[str], str]:
    failures = check_uneven_collectives(setup.comm, setup.device)
    if setup.cuda:
        from cephalo.runtime.collectives.comm import make_comm

        failures += check_uneven_collectives(make_comm("padded"), setup.device)
    return failures, f"{type(setup.comm).__name__}, world size {setup.comm.world_size}"


def check_uneven_engine(
    comm, device: torch.device, rel_tol: float, near_even: bool = False
) -> list[str]:
    """gpt-tiny (fp32, dropout 0.1) on an uneven plan over `comm` (batches 5, 3, 1, ...,
    state fractions ~ 6 : 3 : 1 : ..., micro-batching) for `ENGINE_STEPS` steps: the losses
    and gradient norms of one process training the whole batch, within `rel_tol`.
    `near_even`: fractions ~ 11 : 10 : 10 : ..., which a comm with `even_gather` (NCCL) runs
    padded-even (runtime/collectives/padded.py)."""
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    world, rank, seq = comm.world_size, comm.rank, 16
    batches = [5, 3] + [1] * (world - 2)
    weights = [11, 10] + [10] * (world - 2) if near_even else [6, 3] + [1] * (world - 2)
    fractions = [w / sum(weights) for w in weights]
    micro = [2, 3] + [1] * (world - 2)
    plan = manual_plan("gpt-tiny", seq, batches, micro, fractions)
    whole = manual_plan("gpt-tiny", seq, [sum(batches)], [2], [1.0])
    cfg = EngineConfig(device=str(device), seed=0, grad_clip=1.0)
    ours = Engine(build_model("gpt-tiny", dropout=0.1), plan, comm, cfg)
    alone = Engine(build_model("gpt-tiny", dropout=0.1), whole, LocalComm(), cfg)
    gen = torch.Generator().manual_seed(0)
    first = sum(batches[:rank])
    failures = []
    padded = sum(us.padded is not None for us in ours.shards)
    if near_even and comm.even_gather and padded != len(ours.shards):
        failures.append(f"near-even split: {padded} of {len(ours.shards)} units padded-even")
    for step in range(ENGINE_STEPS):
        x = torch.randint(0, 256, (sum(batches), seq), generator=gen)
        y = torch.roll(x, -1, dims=1)
        mine = slice(first, first + batches[rank])
        got = ours.train_step(x[mine], y[mine], lr=1e-3)
        ref = alone.train_step(x, y, lr=1e-3)
        for name in ("loss", "grad_norm"):
            a, b = getattr(got, name), getattr(ref, name)
            if not abs(a - b) <= rel_tol * abs(b):
                failures.append(f"engine step {step} {name}: {a} vs one process {b}")
    return failures


def _models(name: str) -> Callable[[Setup], tuple[list[str], str]]:
    """A check of scripts/gpu_check_models.py, imported when it runs (this file is also loaded
    by path, without scripts/ on sys.path: tests/test_comm.py)."""

    def run(setup: Setup) -> tuple[list[str], str]:
        import gpu_check_models

        return getattr(gpu_check_models, name)(setup)

    return run


def _sibling(module: str, name: str) -> Callable[[Setup], tuple[list[str], str]]:
    """A check of a sibling script (`gpu_check_syncs`, `gpu_check_host`), imported when it
    runs (as `_models`)."""

    def run(setup: Setup) -> tuple[list[str], str]:
        import importlib

        return getattr(importlib.import_module(module), name)(setup)

    return run


def _syncs(name: str) -> Callable[[Setup], tuple[list[str], str]]:
    return _sibling("gpu_check_syncs", name)


def _host(name: str) -> Callable[[Setup], tuple[list[str], str]]:
    return _sibling("gpu_check_host", name)


def plain_step(setup: Setup, model_name: str, data, recompute: bool) -> Callable[[], None]:
    """One step of plain PyTorch on the same model and batch: the model in the compute dtype,
    `torch.optim.AdamW` (fused on CUDA) with weight decay on matrices, norm clipping; with
    `recompute`, every block under activation checkpointing, as the engine recomputes it."""
    from cephalo.modeling.registry import build_model
    from cephalo.runtime.state.param_groups import adamw_param_groups

    dtype = torch.bfloat16 if setup.cuda else torch.float32
    model = build_model(model_name).materialize(setup.device, torch.Generator().manual_seed(0))
    model.to(dtype)
    named = [(f"{u}.{n}", p) for u, n, p in model.named_unit_parameters()]
    opt = torch.optim.AdamW(adamw_param_groups(named, 0.1), lr=1e-4, fused=setup.cuda or None)
    x, y = data[0].to(setup.device), data[1].to(setup.device)
    n_tokens = y.numel()

    def loss() -> torch.Tensor:
        if not recompute:
            return model(x, y)
        h = model.units[0].module(x)
        for u in model.units[1:-1]:
            h = torch.utils.checkpoint.checkpoint(u.module, h, use_reentrant=False)
        return model.units[-1].module(h, y) / n_tokens

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step


def check_throughput(setup: Setup) -> tuple[list[str], str]:
    """Tokens/s and MFU: the engine against plain PyTorch on the same model and batch, with
    and without recomputing the blocks (the engine recomputes every block)."""
    batch, micro, steps = (16, 16, 10) if setup.cuda else (4, 4, 3)
    model_name = setup.big_model
    data = _data(_vocab(setup), batch, setup.seq, steps=1)[0]
    tokens = batch * setup.seq

    def timed(step: Callable[[], None]) -> float:
        step()  # warm-up
        step()
        _sync(setup)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(setup)
        return (time.perf_counter() - t0) / steps

    engine = _engine(setup, model_name, batch, micro, setup.low)
    params = engine.model.spec.total_params
    ours = timed(lambda: engine.train_step(*data, lr=1e-4))
    engine = None  # free its memory before the plain model's
    _free(setup)
    theirs = {}
    for recompute in (False, True):
        theirs[recompute] = timed(plain_step(setup, model_name, data, recompute))
        _free(setup)
    flops = 6 * params * tokens  # forward + backward, matmul-dominated (no attention term)
    peak = _peak_flops(setup)
    tps = {k: tokens / v for k, v in theirs.items()}
    ours_tps = tokens / ours
    note = (
        f"{model_name} b{batch}x{setup.seq}: engine {ours_tps:,.0f} tok/s; plain PyTorch "
        f"{tps[False]:,.0f} ({ours_tps / tps[False]:.2f}x), with recompute {tps[True]:,.0f} "
        f"({ours_tps / tps[True]:.2f}x)"
    )
    if peak:
        note += f"; MFU {flops / ours / peak:.1%} vs {flops / theirs[False] / peak:.1%}"
    return [], note


def _replan_check() -> Callable[[Setup], tuple[list[str], str]]:
    """scripts/gpu_check_replan.py, imported when the check runs (this file is also loaded by
    path, without scripts/ on sys.path: tests/test_comm.py)."""
    from gpu_check_replan import check_replan_staging

    return check_replan_staging


def _peak_flops(setup: Setup) -> float | None:
    """Dense bf16 tensor-core peak of known GPUs (vendor data sheets), FLOP/s."""
    if not setup.cuda:
        return None
    name = torch.cuda.get_device_name(setup.device).lower()
    for key, tflops in (("h200", 989), ("h100", 989), ("a100", 312), ("l40s", 362), ("l4", 121)):
        if key in name:
            return tflops * 1e12
    return None


CHECKS: list[tuple[str, Callable[[Setup], tuple[list[str], str]]]] = [
    ("bf16_train", check_bf16_train),
    ("fp16_scaling", check_fp16_scaling),
    ("offload_bitwise", check_offload_bitwise),
    ("staging_race", check_staging_race),
    ("host_link", lambda s: (check_host_link(s.device), "pinned copies exact")),
    ("host_state", check_host_state),
    ("host_threads", _host("check_host_threads")),
    ("dropout", check_dropout),
    ("standard_eval", check_standard_eval),
    ("collectives", check_collectives),
    ("pipeline_p2p", _sibling("gpu_check_pipeline", "check_pipeline_p2p")),
    ("hf_models", _models("check_hf")),
    ("adapters", _models("check_adapters")),
    ("chat_packed", _models("check_chat_packed")),
    ("replan_staging", lambda s: _replan_check()(s)),
    ("local_host_memory", _host("check_local_host_memory")),
    ("step_syncs", _syncs("check_step_syncs")),
    ("adamw_split", _syncs("check_adamw_split")),
    ("step_split", _syncs("check_step_split")),
    ("dpo_steps", _syncs("check_dpo_steps")),
    ("device_reserve", _host("check_device_reserve")),
    ("profiler_memory", _host("check_profiler_memory")),
    ("throughput", check_throughput),
    ("comm_wait_events", check_comm_wait_events),
    ("boundary_overlap", check_boundary_overlap),
    ("input_prefetch", check_input_prefetch),
    ("compile", _sibling("gpu_check_compile", "check_compile")),
]


def run_checks(
    setup: Setup, only: set[str] | None = None, budget_s: float = TIME_LIMIT_S
) -> list[Result]:
    results = []
    started = time.perf_counter()
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        if time.perf_counter() - started > budget_s:
            results.append(Result(name, "SKIP", 0.0, f"over the {budget_s:.0f} s budget"))
            continue
        t0 = time.perf_counter()
        try:
            failures, note = fn(setup)
            status = "PASS" if not failures else "FAIL"
        except Exception as err:  # a broken check is a failure, and the others still run
            failures = [f"{type(err).__name__}: {err}"]
            note, status = "", "FAIL"
            traceback.print_exc()
        results.append(Result(name, status, time.perf_counter() - t0, note))
        for f in failures:
            print(f"gpu_check: {name}: FAIL - {f}", flush=True)
        print(f"gpu_check: {name}: {status} ({time.perf_counter() - t0:.1f}s) {note}", flush=True)
        _free(setup)
    return results


def print_table(results: list[Result], title: str) -> None:
    print(f"\n{title}")
    width = max(len(r.name) for r in results)
    print(f"{'check':<{width}}  result  seconds  note")
    for r in results:
        print(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.note}")
    failed = [r.name for r in results if r.status == "FAIL"]
    print("gpu_check: " + ("PASS" if not failed else f"FAIL ({', '.join(failed)})"), flush=True)


def _versions() -> str:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "absent"
    return f"torch {torch.__version__}, transformers {tf}, Python {sys.version.split()[0]}"


def cpu_main(only: set[str] | None, budget_s: float) -> int:
    from cephalo.runtime.collectives.comm import LocalComm

    setup = Setup(torch.device("cpu"), LocalComm(), "gpt-tiny", 32, cuda=False)
    results = run_checks(setup, only, budget_s)
    print_table(results, f"gpu_check --cpu ({_versions()})")
    return 1 if any(r.status == "FAIL" for r in results) else 0


def main(only: set[str] | None, budget_s: float) -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: SKIPPED - no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "run scripts/gpu_check.sh on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
        return SKIP
    import torch.distributed as dist

    from cephalo.runtime.collectives.dist import init_distributed

    comm = init_distributed(backend="nccl", comm_impl="nccl", timeout_s=120)
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu_check: {torch.cuda.get_device_name(device)}; {_versions()}", flush=True)
    setup = Setup(device, comm, "gpt2-124m", 512, cuda=True)
    results = run_checks(setup, only, budget_s)
    print_table(results, f"gpu_check on {torch.cuda.get_device_name(device)} ({_versions()})")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if any(r.status == "FAIL" for r in results) else 0


def collectives_main() -> int:
    """World size >= 2 under torchrun, one GPU per process (see the module docstring)."""
    if not torch.cuda.is_available():
        print("gpu_check --collectives: SKIPPED - no CUDA GPU is visible")
        return SKIP
    import torch.distributed as dist

    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.collectives.dist import init_distributed

    comm = init_distributed(backend="nccl", comm_impl="nccl", timeout_s=120)
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    failures = check_uneven_collectives(comm, device)
    failures += check_uneven_collectives(make_comm("padded"), device)
    # fp32 on GPUs: cuBLAS may sum in another order per batch size; 1e-4 over 3 steps
    failures += check_uneven_engine(comm, device, rel_tol=1e-4)
    failures += check_uneven_engine(comm, device, rel_tol=1e-4, near_even=True)
    failures += check_bf16_cross_reduce(comm, device)
    from gpu_check_pipeline import check_pipeline_engine

    failures += check_pipeline_engine(comm, device, rel_tol=1e-4)
    for f in failures:
        print(f"gpu_check: rank {comm.rank}: FAIL - {f}", flush=True)
    count = torch.tensor([len(failures)], device=device)
    dist.all_reduce(count)
    if comm.rank == 0:
        verdict = "PASS" if count.item() == 0 else f"FAIL ({count.item()} failure(s))"
        print(
            f"gpu_check: world size {comm.world_size} uneven NCCL collectives and engine "
            f"({torch.cuda.get_device_name(device)}): {verdict} in {time.perf_counter() - t0:.0f}s"
        )
    dist.destroy_process_group()
    return 0 if count.item() == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="the world-size >= 2 checks (one process per GPU under torchrun)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="every check's CPU part (no GPU needed; CI runs it)"
    )
    parser.add_argument("--only", default="", help="comma-separated check names to run")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=TIME_LIMIT_S,
        help="seconds after which the remaining checks are skipped (and said so)",
    )
    args = parser.parse_args()
    only = {n for n in args.only.split(",") if n} or None
    if args.cpu:
        sys.exit(cpu_main(only, args.budget_s))
    sys.exit(collectives_main() if args.collectives else main(only, args.budget_s))
