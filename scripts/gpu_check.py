"""GPU check of the engine: one CUDA GPU, NCCL process group of world size 1, bf16.

Run through scripts/gpu_check.sh (it launches this under torchrun). Checks:
  1. GPT-2 124M trains: the loss on a repeated batch falls over the steps;
  2. the memory ledger's device peak of a step is within 10% of
     torch.cuda.max_memory_allocated() over the same step;
  3. host offload of boundary activations (pinned buffers, side-stream copies) gives the
     same losses as keeping them on the device, with a lower device peak;
  4. the host link on its own (runtime/host_state.py `HostLink`): downward copies into pinned
     memory on its side stream, direct and accumulated (pinned staging), `sync` (events),
     uploads, `wait_uploads` ordering the compute stream: exact values;
  5. host state (`host_state_fraction` 0.5, and 1.0 on a rank marked memory-tight: no reduce
     overlap, lean gradient shards): the same losses as all state on the device (bf16: 1e-3),
     pinned host buffers, the ledger's device `state` lower by exactly (16 - 2) bytes per
     host-held element, its peak still within 10% of max_memory_allocated, and GPT-2's tied
     head reducing into the host-held embedding gradient (the accumulate path).
Exit status: 0 all checks pass, 1 a check failed, 77 no CUDA GPU (nothing was run).
"""

from __future__ import annotations

import sys
import time

import torch

SKIP = 77


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: SKIPPED - no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "run scripts/gpu_check.sh on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
        return SKIP

    from cephalo.modeling.registry import build_model
    from cephalo.planning.plan import Plan, RankPlan
    from cephalo.runtime.dist import init_distributed
    from cephalo.runtime.engine import Engine, EngineConfig

    comm = init_distributed(backend="nccl", comm_impl="nccl", timeout_s=120)
    device = torch.device("cuda", torch.cuda.current_device())
    model_name, seq, batch, micro, steps = "gpt2-124m", 512, 8, 4, 8
    print(
        f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"comm {type(comm).__name__} (world size {comm.world_size}), {model_name}, bf16, "
        f"batch {batch} x {seq} tokens in micro-batches of {micro}"
    )
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 50257, (batch, seq), generator=gen)
    labels = torch.roll(input_ids, -1, dims=1)
    failures: list[str] = []

    engines: dict[str, Engine] = {}

    def run(
        offload: bool, n_steps: int, host: float = 0.0, overlap: bool = True, keep: str = ""
    ) -> tuple[list[float], list[float], list[int]]:
        rank = RankPlan(0, "gpu", batch, micro, batch // micro, 1.0, offload_activations=offload)
        rank.host_state_fraction, rank.overlap_reduce = host, overlap
        plan = Plan("manual", model_name, seq, batch, "bf16", [rank])
        engine = Engine(
            build_model(model_name), plan, comm, EngineConfig(device=str(device), seed=0)
        )
        losses, ratios, peaks = [], [], []
        for step in range(n_steps):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            stats = engine.train_step(input_ids, labels, lr=3e-4)
            torch.cuda.synchronize(device)
            real = torch.cuda.max_memory_allocated(device)
            losses.append(stats.loss)
            ratios.append(stats.peak_bytes / real)
            peaks.append(stats.peak_bytes)
            print(
                f"  offload={offload} host={host} step {step}: loss {stats.loss:.4f}  grad_norm {stats.grad_norm:.3f}  "
                f"{time.perf_counter() - t0:.2f}s  ledger peak {stats.peak_bytes / 2**20:.0f} MiB  "
                f"max_memory_allocated {real / 2**20:.0f} MiB  ratio {ratios[-1]:.3f}"
            )
        if keep:
            engines[keep] = engine
        del engine
        torch.cuda.empty_cache()
        return losses, ratios, peaks

    t_start = time.perf_counter()
    losses, ratios, peaks = run(offload=False, n_steps=steps)
    if not losses[-1] < losses[0] - 0.5:
        failures.append(f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    worst = max(abs(1 - r) for r in ratios[1:])  # step 0 includes one-off allocations
    if worst > 0.10:
        failures.append(f"ledger peak differs from max_memory_allocated by {worst:.1%} (> 10%)")
    off_losses, _, off_peaks = run(offload=True, n_steps=3)
    if max(abs(a - b) for a, b in zip(off_losses, losses, strict=False)) > 1e-3:
        failures.append(f"offload changed the losses: {off_losses} vs {losses[:3]}")
    if not off_peaks[-1] < peaks[-1]:
        failures.append(
            f"offload did not lower the device peak ({off_peaks[-1]} vs {peaks[-1]} bytes)"
        )
    failures += check_host_link(device)
    _, _, dev_peaks = run(offload=False, n_steps=3, keep="device")
    for host, overlap in ((0.5, True), (1.0, False)):
        h_losses, h_ratios, h_peaks = run(
            offload=False, n_steps=3, host=host, overlap=overlap, keep="host"
        )
        tag = f"host_state_fraction {host} (overlap_reduce {overlap})"
        if max(abs(a - b) for a, b in zip(h_losses, losses, strict=False)) > 1e-3:
            failures.append(f"{tag} changed the losses: {h_losses} vs {losses[:3]}")
        if max(abs(1 - r) for r in h_ratios[1:]) > 0.10:
            failures.append(f"{tag}: ledger peak vs max_memory_allocated off by more than 10%")
        eng, ref = engines.pop("host"), engines["device"]
        hosted = sum(us.host_n for us in eng.shards)
        drop = ref.ledger.current_by_category["state"] - eng.ledger.current_by_category["state"]
        if drop != (16 - 2) * hosted:
            failures.append(f"{tag}: device state fell by {drop} bytes, not 14 x {hosted}")
        if not all(us.host.param.is_pinned() for us in eng.shards if us.host is not None):
            failures.append(f"{tag}: host state is not in pinned memory")
        if not h_peaks[-1] < dev_peaks[-1]:
            failures.append(
                f"{tag} did not lower the device peak ({h_peaks[-1]} vs {dev_peaks[-1]})"
            )
        print(f"  {tag}: {hosted} elements on the host, device state -{drop / 2**20:.0f} MiB")
        del eng
        torch.cuda.empty_cache()
    engines.clear()
    elapsed = time.perf_counter() - t_start
    print(f"gpu_check: {elapsed:.0f}s")
    if elapsed > 300:
        failures.append(f"took {elapsed:.0f}s (> 5 minutes)")
    for f in failures:
        print(f"gpu_check: FAIL - {f}")
    if not failures:
        print("gpu_check: PASS")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failures else 0


def check_host_link(device: torch.device) -> list[str]:
    """HostLink's CUDA path on its own: exact values through pinned memory and the side stream."""
    from cephalo.runtime.host_state import HostLink
    from cephalo.runtime.memory import MemoryLedger

    failures = []
    ledger = MemoryLedger(0, device)
    link = HostLink(ledger, device)
    n = 1 << 22
    src = torch.arange(n, dtype=torch.float32, device=device)
    host = ledger.alloc("host/state", n, torch.float32, pin=True).zero_()
    if not host.is_pinned():
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
    print(f"  host link: {link.copied_bytes / 2**20:.0f} MiB copied, {len(failures)} problem(s)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
