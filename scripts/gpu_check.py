"""GPU check of the engine on CUDA GPUs with NCCL; run through scripts/gpu_check.sh.

Default (torchrun, one process, world size 1, bf16):
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
  6. Hugging Face models through the engine on CUDA (`check_hf_models`): tiny Qwen2
     (sliding-window layers, tied embeddings) and Gemma 2 (eager attention, soft-capping,
     embedding-scale buffer) directories read as pretrained: the first step's loss equals
     transformers' own on the GPU (fp32), and bf16 training lowers the loss.
`--collectives` (torchrun, one process per GPU, world size >= 2; gpu_check.sh runs it at
world size 2 where two GPUs exist): `check_uneven_collectives` (NcclComm and PaddedComm:
uneven and zero shards, sync and async, fp32/bf16/fp16, all_reduce, and a cross-rank
size mismatch raising on every rank) and `check_uneven_engine` (gpt-tiny on an uneven plan
against one process on the whole batch). Both checks take any `Comm`: tests/test_comm.py
runs them on gloo ranks, so the checks themselves are tested without a GPU.
Exit status: 0 all checks pass, 1 a check failed, 77 no CUDA GPU (nothing was run).
`python scripts/gpu_check.py --hf-on-cpu` runs check 6 alone on the CPU (a smoke test of
the check itself on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

SKIP = 77
ENGINE_STEPS = 3


def _shard_values(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s shard of `n` elements: small halves, exact in fp32, bf16 and fp16."""
    return (rank + 1) * 0.5 + (torch.arange(n) % 7).float()


def _full_values(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s full reduce-scatter input: sums over a few ranks stay exact in bf16."""
    return (rank + 1) + (torch.arange(n) % 5).float()


def check_uneven_collectives(comm, device: torch.device) -> list[str]:
    """Uneven `all_gather_v` / `reduce_scatter_v` (zero shards included), sync and async, in
    fp32, bf16 and fp16, and `all_reduce` sum / max, against what each rank computes by
    itself; then a cross-rank size mismatch must raise `CephaloError` on every rank. Returns
    this rank's failures (every rank must call it: it runs collectives)."""
    from cephalo.errors import CephaloError

    world, rank = comm.world_size, comm.rank
    cases = [
        [(3 * k + 2) % 5 for k in range(world)],  # uneven, a zero on some world sizes
        [0] * (world - 1) + [5],  # only the last rank owns anything
        [0] * world,  # nothing at all
        [4099 if k == 0 else 17 * k for k in range(world)],  # large and odd
    ]
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for sizes in cases:
            for async_op in (False, True):
                what = f"{type(comm).__name__} {str(dtype)[6:]} sizes {sizes} async={async_op}"
                shard = _shard_values(rank, sizes[rank]).to(device, dtype)
                out = torch.full((sum(sizes),), -1.0, dtype=dtype, device=device)
                comm.all_gather_v(out, shard, sizes, async_op=async_op).wait()
                expect = torch.cat([_shard_values(k, n) for k, n in enumerate(sizes)])
                if not torch.equal(out.float().cpu(), expect):
                    failures.append(f"all_gather_v {what}: got {out[:8].tolist()}...")
                full = _full_values(rank, sum(sizes)).to(device, dtype)
                mine = torch.full((sizes[rank],), -1.0, dtype=dtype, device=device)
                comm.reduce_scatter_v(mine, full, sizes, async_op=async_op).wait()
                total = sum(_full_values(k, sum(sizes)) for k in range(world))
                start = sum(sizes[:rank])
                if not torch.equal(mine.float().cpu(), total[start : start + sizes[rank]]):
                    failures.append(f"reduce_scatter_v {what}: got {mine[:8].tolist()}...")
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


def check_uneven_engine(comm, device: torch.device, rel_tol: float) -> list[str]:
    """gpt-tiny (fp32, dropout 0.1) on an uneven plan over `comm` (batches 5, 3, 1, ...,
    state fractions ~ 6 : 3 : 1 : ..., micro-batching) for `ENGINE_STEPS` steps: the losses
    and gradient norms of one process training the whole batch, within `rel_tol`."""
    from cephalo.modeling.registry import build_model
    from cephalo.planning.planner import manual_plan
    from cephalo.runtime.comm import LocalComm
    from cephalo.runtime.engine import Engine, EngineConfig

    world, rank, seq = comm.world_size, comm.rank, 16
    batches = [5, 3] + [1] * (world - 2)
    weights = [6, 3] + [1] * (world - 2)
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


def collectives_main() -> int:
    """World size >= 2 under torchrun, one GPU per process (see the module docstring)."""
    if not torch.cuda.is_available():
        print("gpu_check --collectives: SKIPPED - no CUDA GPU is visible")
        return SKIP
    import torch.distributed as dist

    from cephalo.runtime.comm import make_comm
    from cephalo.runtime.dist import init_distributed

    comm = init_distributed(backend="nccl", comm_impl="nccl", timeout_s=120)
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    failures = check_uneven_collectives(comm, device)
    failures += check_uneven_collectives(make_comm("padded"), device)
    # fp32 on GPUs: cuBLAS may sum in another order per batch size; 1e-4 over 3 steps
    failures += check_uneven_engine(comm, device, rel_tol=1e-4)
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
    failures += check_hf_models(comm, device)
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


def check_hf_models(comm, device: torch.device) -> list[str]:
    """Check 6: transformers model directories through the engine on `device`."""
    import tempfile
    from pathlib import Path

    import transformers

    from cephalo.modeling.registry import build_model
    from cephalo.planning.plan import Plan, RankPlan
    from cephalo.runtime.engine import Engine, EngineConfig

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    failures = []
    tiny = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=32,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    configs = {
        "qwen2": dict(tiny, use_sliding_window=True, max_window_layers=2, tie_word_embeddings=True),
        "gemma2": dict(tiny, head_dim=32, final_logit_softcapping=30.0),
    }
    seq, batch = 128, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (batch, seq), generator=gen)
    y = torch.full_like(x, -100)
    y[:, :-1] = x[:, 1:]
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, kwargs in configs.items():
            directory = Path(tmp) / model_type
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).to(device)
            with torch.no_grad():
                expected = hf(input_ids=x.to(device), labels=x.to(device)).loss.item()
            del hf
            for dtype, steps in (("fp32", 1), ("bf16", 6)):
                plan = Plan(
                    "manual",
                    str(directory),
                    seq,
                    batch,
                    dtype,
                    [RankPlan(0, "gpu", batch, 2, batch // 2, 1.0)],
                )
                engine = Engine(
                    build_model(str(directory)),
                    plan,
                    comm,
                    EngineConfig(device=str(device), compute_dtype=dtype),
                )
                losses = [engine.train_step(x, y, lr=1e-3).loss for _ in range(steps)]
                print(f"  {model_type} {dtype}: losses {[round(v, 4) for v in losses]}")
                if dtype == "fp32" and abs(losses[0] / expected - 1) > 1e-4:
                    failures.append(
                        f"{model_type}: first-step loss {losses[0]:.6f} != transformers' "
                        f"{expected:.6f} on {device}"
                    )
                if dtype == "bf16" and not losses[-1] < losses[0]:
                    failures.append(f"{model_type} bf16: loss did not fall: {losses}")
                del engine
    print(f"  HF models on {device}: transformers' first loss reproduced, bf16 trains")


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="the world-size >= 2 checks (one process per GPU under torchrun)",
    )
    parser.add_argument(
        "--hf-on-cpu",
        action="store_true",
        help="check 6 (Hugging Face models through the engine) alone, on the CPU",
    )
    args = parser.parse_args()
    if args.hf_on_cpu:
        from cephalo.runtime.comm import LocalComm

        problems = check_hf_models(LocalComm(), torch.device("cpu"))
        for p in problems:
            print(f"gpu_check --hf-on-cpu: FAIL - {p}")
        print("gpu_check --hf-on-cpu: " + ("FAIL" if problems else "PASS"))
        sys.exit(1 if problems else 0)
    sys.exit(collectives_main() if args.collectives else main())
