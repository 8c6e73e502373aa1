"""The engine in one process (world size 1, LocalComm): equivalence with a single-process
reference, LGA == standard, precision modes, state access, errors."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import compiled_suites
from cephalo.errors import CephaloError
from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.emulation import ComputeEmulator
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from cephalo.runtime.state.param_groups import adamw_param_groups
from engine_common import (
    LR,
    TEST_EPS,
    make_data,
    make_plan,
    one_thread,
    reference_floor,
)
from equivalence import NoiseFloor, Trajectory
from procs import run_tagged

STEPS = 5
__all__ = ["one_thread"]  # module-wide fixture (single intra-op thread)


def _train(plan, cfg, data, overrides, model="gpt-tiny"):
    engine = Engine(build_model(model, **overrides), plan, LocalComm(), cfg)
    stats = [engine.train_step(x, y, lr=LR) for x, y in data]
    return engine, stats


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("micro", [1, 2, 5])
def test_single_rank_matches_reference(dropout, micro):
    cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    data = make_data(STEPS, 5)
    engine, stats = _train(make_plan([5], [1.0], [micro]), cfg, data, {"dropout": dropout})
    floor = reference_floor("gpt-tiny", {"dropout": dropout}, data, cfg)
    floor.check(
        f"micro={micro} dropout={dropout}",
        params=engine.full_state_dict(),
        losses=[s.loss for s in stats],
        norms=[s.grad_norm for s in stats],
    )
    assert any(n > 0.5 for n in floor.truth.grad_norms), "clipping must have been active"


def test_dropout_changes_training_and_recompute_replays_it():
    """Dropout on gives a different trajectory than off (it is really applied), and the
    recompute in backward sees the forward's masks: otherwise the reference match above
    could not hold. Here: the loss reported by the engine (from the no-graph forward) equals
    the reference's (from a graph forward), step after step."""
    cfg = EngineConfig(adamw=AdamWHyper(eps=TEST_EPS))
    data = make_data(3, 4)
    engine, on = _train(make_plan([4], [1.0], [2]), cfg, data, {"dropout": 0.3})
    _, off = _train(make_plan([4], [1.0], [2]), cfg, data, {"dropout": 0.0})
    assert on[0].loss != pytest.approx(off[0].loss, rel=1e-4)
    reference_floor("gpt-tiny", {"dropout": 0.3}, data, cfg).check(
        "dropout 0.3",
        params=engine.full_state_dict(),
        losses=[s.loss for s in on],
        norms=[s.grad_norm for s in on],
    )


def test_lga_equals_standard_mode():
    data = make_data(3, 6)
    plan = make_plan([6], [1.0], [2])
    floor = reference_floor(
        "gpt-tiny", {"dropout": 0.1}, data, EngineConfig(adamw=AdamWHyper(eps=TEST_EPS))
    )
    for mode in ("lga", "standard"):
        cfg = EngineConfig(mode=mode, adamw=AdamWHyper(eps=TEST_EPS))
        engine, stats = _train(plan, cfg, data, {"dropout": 0.1})
        floor.check(mode, params=engine.full_state_dict(), losses=[s.loss for s in stats])


@pytest.mark.parametrize("mode", ["lga", "standard"])
def test_offload_and_prefetch_do_not_change_results(mode):
    data = make_data(2, 4)
    plan = make_plan([4], [1.0], [2])
    base, _ = _train(plan, EngineConfig(mode=mode, adamw=AdamWHyper(eps=TEST_EPS)), data, {})
    other, _ = _train(
        plan,
        EngineConfig(mode=mode, offload=True, prefetch=False, adamw=AdamWHyper(eps=TEST_EPS)),
        data,
        {},
    )
    a, b = base.full_state_dict(), other.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains_and_stays_close_to_fp32(dtype):
    x, y = make_data(1, 4)[0]
    data = [(x, y)] * 20
    plan32 = make_plan([4], [1.0], [2])
    plan_lp = make_plan([4], [1.0], [2], dtype=dtype)
    cfg = EngineConfig(adamw=AdamWHyper(weight_decay=0.0))
    e32 = Engine(build_model("gpt-tiny"), plan32, LocalComm(), cfg)
    elp = Engine(build_model("gpt-tiny"), plan_lp, LocalComm(), cfg)
    l32 = [e32.train_step(a, b, lr=3e-3).loss for a, b in data]
    stats = [elp.train_step(a, b, lr=3e-3) for a, b in data]
    llp = [s.loss for s in stats]
    assert llp[-1] < llp[0] - 1.0, f"{dtype} loss did not fall: {llp[0]:.3f} -> {llp[-1]:.3f}"
    assert abs(llp[0] - l32[0]) < 0.02  # same weights, rounding only
    assert abs(llp[-1] - l32[-1]) < 0.1 * l32[0]
    if dtype == "fp16":
        assert stats[0].loss_scale == 2.0**16 and not any(s.skipped for s in stats)
        assert elp.extra_state()["loss_scaler"]["scale"] == 2.0**16


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    x, y = make_data(1, 2)[0]
    plan = make_plan([2], [1.0], [1], dtype="fp16")
    engine = Engine(
        build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(loss_scale_init=2.0**40)
    )
    before = engine.full_state_dict()
    stats = engine.train_step(x, y, lr=1e-3)
    assert stats.skipped and engine.scaler.scale == 2.0**39
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.optimizer.step_count == 0


def test_eval_loss_state_views_and_extra_state():
    cfg = EngineConfig(adamw=AdamWHyper(eps=TEST_EPS))
    data = make_data(2, 3)
    engine, stats = _train(make_plan([3], [1.0], [2]), cfg, data, {"dropout": 0.2})
    x, y = data[0]
    ref = build_model("gpt-tiny").materialize("cpu", torch.Generator().manual_seed(0))
    _load(ref, engine.full_state_dict())
    ref.eval()
    with torch.no_grad():
        expect = ref(x, y).item()
    assert engine.eval_loss(x, y) == pytest.approx(expect, rel=1e-6)
    assert engine.model.training  # eval_loss restores the mode
    # sharded_state: live views covering every element once
    shards = engine.sharded_state()
    params = {s.name: s for s in shards if not s.name.startswith("optim.")}
    assert set(params) == set(engine.full_state_dict())
    assert sum(s.local.numel() for s in params.values()) == sum(u.size for u in engine.shards)
    shard = params["head.ln_f.bias"]
    shard.local.fill_(0.25)
    assert torch.all(engine.full_state_dict()["head.ln_f.bias"] == 0.25)
    assert any(s.name.startswith("optim.exp_avg_sq.") and s.local.abs().sum() > 0 for s in shards)
    extra = engine.extra_state()
    assert extra["optimizer_step"] == 2 and extra["train_step"] == 2
    fresh = Engine(build_model("gpt-tiny"), make_plan([3], [1.0], [2]), LocalComm(), cfg)
    fresh.load_extra_state(extra)
    assert fresh.optimizer.step_count == 2


def _load(model, full):
    named = {f"{u}.{n}": p for u, n, p in model.named_unit_parameters()}
    with torch.no_grad():
        for k, v in full.items():
            named[k].copy_(v)


def test_bad_input_is_a_clear_error():
    plan = make_plan([3], [1.0], [2])
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig())
    x, y = make_data(1, 2)[0]
    with pytest.raises(CephaloError, match="batch_size 3"):
        engine.train_step(x, y, lr=LR)
    with pytest.raises(CephaloError, match="must both be"):
        engine.train_step(x[0], y[0], lr=LR)
    with pytest.raises(CephaloError, match="plan is for 2 ranks"):
        Engine(
            build_model("gpt-tiny"),
            make_plan([1, 2], [0.5, 0.5], [1, 1]),
            LocalComm(),
            EngineConfig(),
        )
    with pytest.raises(CephaloError, match="mode"):
        Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(mode="pipeline"))
    with pytest.raises(CephaloError, match="betas"):
        Engine(
            build_model("gpt-tiny"),
            plan,
            LocalComm(),
            EngineConfig(adamw=AdamWHyper(betas=(0.9, 1.0))),
        )
    with pytest.raises(CephaloError, match="grad_clip"):
        Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(grad_clip=-1.0))


def test_compiled_blocks_plumbing_is_bitwise_eager():
    """runtime/capture/ without the compiler (its compile step the identity): every block of a
    type through one shared callable (`functional_call` on the type's first module), the
    dropout masks drawn outside and given back in, the first call of a shape eager to record
    them. Bitwise the eager engine's losses and weights over two steps of two micro-batches
    with recompute: the masks of the forward, the recompute and the eager engine are one.
    `compile` values: one message for a bad one; "graphs" refused off CUDA. The same under an
    emulated device's byte-by-byte memory accounting (runtime/capture/counted.py)."""
    from cephalo.runtime.capture.blocks import CompiledBlocks
    from cephalo.runtime.device_memory import EmulatedDeviceMemory

    if compiled_suites.mode():
        pytest.skip("compares the capture with eager blocks: run without CEPHALO_TEST_COMPILE")
    plan, data = make_plan([4], [1.0], [2]), make_data(2, 4)
    cfg = EngineConfig(fuse_tail=False)  # both blocks recomputed
    eager, eager_stats = _train(plan, cfg, data, {"dropout": 0.1})
    engine = Engine(build_model("gpt-tiny", dropout=0.1), plan, LocalComm(), cfg)
    engine.runner.compiled = blocks = CompiledBlocks("test", engine.device, lambda fn: fn)
    stats = [engine.train_step(x, y, lr=LR) for x, y in data]
    assert [s.loss for s in stats] == [s.loss for s in eager_stats]
    for name, value in eager.full_state_dict().items():
        assert torch.equal(engine.full_state_dict()[name], value), name
    assert blocks.block_types == 1 and blocks.eager_calls == 1
    assert blocks.calls == 2 * 2 * 2 * 2 - 1  # steps x micro-batches x blocks x (fwd, recompute)
    # on an emulated device whose memory is counted (runtime/capture/counted.py): the first
    # call of each grad mode runs eagerly, measured; the others are charged that before they
    # run. Still bitwise, and the counted peak is not below the eager engine's
    peaks = []
    for capture in (False, True):
        with EmulatedDeviceMemory(0, budget_bytes=1 << 40) as memory:
            engine = Engine(build_model("gpt-tiny", dropout=0.1), plan, LocalComm(), cfg)
            if capture:
                engine.runner.compiled = blocks = CompiledBlocks("test", engine.device, lambda f: f)
            losses = [engine.train_step(x, y, lr=LR).loss for x, y in data]
        assert losses == [s.loss for s in eager_stats]
        peaks.append(memory.peak_bytes)
    assert blocks.eager_calls == 2 and peaks[1] >= peaks[0] > 0
    with pytest.raises(CephaloError, match="parallel.compile must be one of"):
        EngineConfig(compile="fast").validate()
    with pytest.raises(CephaloError, match='"graphs" captures CUDA graphs.*"inductor"'):
        Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(compile="graphs"))


def _cpu_make_graphed_callables(fn, sample, num_warmup_iters=3, allow_unused_input=False):
    """A CPU stand-in of `torch.cuda.make_graphed_callables` with its buffers' semantics: the
    sample arguments ARE the static inputs (each call copies its inputs into them), the output
    and the input gradients are static buffers the next call overwrites."""
    with torch.enable_grad():
        static_out = torch.empty_like(fn(*sample))
    static_grads = [torch.empty_like(s) if s.requires_grad else None for s in sample]

    class Graphed(torch.autograd.Function):  # torch's name: its node is "GraphedBackward"
        @staticmethod
        def forward(ctx, *inputs):
            for static, a in zip(sample, inputs, strict=True):
                if static.data_ptr() != a.data_ptr():
                    static.detach().copy_(a)
            with torch.enable_grad():
                ctx.out = fn(*sample)
            static_out.copy_(ctx.out.detach())
            return static_out.detach()

        @staticmethod
        def backward(ctx, grad):
            wanted = [s for s in sample if s.requires_grad]
            got = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
            out = []
            for g in static_grads:
                if g is not None:
                    v = next(got)
                    g.copy_(v) if v is not None else g.zero_()
                out.append(None if g is None else g.detach())
            return tuple(out)

    return lambda *args: Graphed.apply(*args)


def test_cuda_graph_blocks_on_a_cpu_stand_in_are_bitwise_eager(monkeypatch):
    """runtime/capture/graphs.py's buffer handling, on the CPU: the graph APIs replaced by
    stand-ins with their static-buffer semantics (a replay recomputes into the same output
    and gradient buffers; the grad-free forward's capture replaced, its replay path kept).
    The engine's blocks through `GraphedBlock` (dropout, two micro-batches, the first block
    recomputed, the second in the fused tail) are bitwise eager, with one capture per
    signature: the masks reach the replays, and the engine's tensors are never the static
    inputs (passing them as the sample fails this test); the graph's backward returns the
    block's parameter gradients together, and the ledger charges them so. Cloning outputs and the input
    gradient out of the static buffers is defensive here: the engine's boundary store copies
    them before the next replay. The real graphs: gpu_check's `compile` check."""
    from types import SimpleNamespace

    from cephalo.runtime.capture import graphs
    from cephalo.runtime.capture.blocks import CompiledBlocks

    if compiled_suites.mode():
        pytest.skip("compares graphed blocks with eager ones: run without CEPHALO_TEST_COMPILE")

    def capture(self, fn, args):
        self.static_in = tuple(a.clone() for a in args)
        self.static_out = fn(*self.static_in).clone()
        self.graph = SimpleNamespace(replay=lambda: self.static_out.copy_(fn(*self.static_in)))

    monkeypatch.setattr(graphs._ForwardGraph, "__init__", capture)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _cpu_make_graphed_callables)
    plan, data = make_plan([4], [1.0], [2]), make_data(2, 4)
    eager, eager_stats = _train(plan, EngineConfig(), data, {"dropout": 0.1})
    engine = Engine(build_model("gpt-tiny", dropout=0.1), plan, LocalComm(), EngineConfig())
    engine.runner.compiled = blocks = CompiledBlocks("graphs", engine.device, graphs.GraphedBlock)
    stats = [engine.train_step(x, y, lr=LR) for x, y in data]
    assert [s.loss for s in stats] == [s.loss for s in eager_stats]
    assert [s.grad_norm for s in stats] == [s.grad_norm for s in eager_stats]
    for name, value in eager.full_state_dict().items():
        assert torch.equal(engine.full_state_dict()[name], value), name
    (graphed,) = blocks._callables.values()
    assert graphed.captures == 2  # the grad-free forward, the forward + backward with a graph
    # the graph's backward returns the block's parameter gradients together: charged so
    block = sum(p.numel() * 4 for p in engine.model.units[1].module.parameters())
    assert engine.ledger.peak_by_category["grad_transient"] >= block


def test_slowdown_stretches_compute(monkeypatch):
    slept = []
    monkeypatch.setattr("cephalo.runtime.emulation.time.sleep", slept.append)
    emu = ComputeEmulator(3.0)
    # by the wall clock: 3 x the wall time
    assert emu.stretch(0.5) == pytest.approx(1.5)
    assert slept == [pytest.approx(1.0)]
    # by the CPU time: 3 x the piece's own work, whatever contention added to its wall time
    assert emu.stretch(0.5, cpu_s=0.4) == pytest.approx(1.2)
    assert slept[-1] == pytest.approx(0.7)
    # contention already made it longer than the target: no sleep
    assert emu.stretch(0.5, cpu_s=0.1) == pytest.approx(0.5)
    assert len(slept) == 2
    # what contention took beyond slowdown x the CPU time is counted: 0.5 - 3 x 0.1
    assert emu.contended_s == pytest.approx(0.2)
    host = ComputeEmulator(1.0)
    assert host.stretch(0.5, cpu_s=0.2) == pytest.approx(0.5)
    assert host.contended_s == pytest.approx(0.3)  # the host-speed rank absorbs none
    with pytest.raises(CephaloError, match="slowdown must be >= 1"):
        ComputeEmulator(0.5)


def test_engine_stretches_by_cpu_time(monkeypatch):
    """The engine stretches each unit pass to slowdown x its CPU time, and the optimizer
    step too (outside busy time). A fake thread clock running at half the wall clock makes
    every piece's target 4 x wall / 2 = 2 x wall: each sleep equals the piece's wall time."""
    import time as real_time
    from types import SimpleNamespace

    slept = []
    fake = SimpleNamespace(
        perf_counter=real_time.perf_counter,
        thread_time=lambda: real_time.perf_counter() / 2,
        sleep=slept.append,
    )
    monkeypatch.setattr("cephalo.runtime.emulation.time", fake)
    monkeypatch.setattr(
        "cephalo.runtime.engine.engine.thread_cpu_measures_work", lambda device: True
    )
    plan = make_plan([2], [1.0], [1])
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(slowdown=4.0))
    assert engine.emulator.use_cpu_time
    x, y = make_data(1, 2)[0]
    stats = engine.train_step(x, y, lr=LR)
    # forward and backward of 4 units (gpt-tiny: embedding, 2 blocks, head; the head's
    # backward runs within its forward, and the last block's forward and backward within the
    # head's pass: the fused tail), then the optimizer's two pieces (norm, step)
    units, optimizer = slept[:-2], slept[-2:]
    assert len(units) == 2 * 4 - 3
    assert stats.busy_s == pytest.approx(2 * sum(units), rel=1e-2)  # clocks read apart
    assert all(s > 0 for s in optimizer)
    # every piece reached 4 x its CPU time by sleeping: nothing lost to contention
    assert stats.contention_s == 0.0
    # at slowdown 1.5 a piece's target, 1.5 x wall / 2, is short of its wall time: the
    # emulated device lost a quarter of its compute to the host's other threads
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(slowdown=1.5))
    stats = engine.train_step(x, y, lr=LR)
    assert stats.contention_s == pytest.approx(stats.busy_s / 4, rel=1e-2)


GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_gpu_check_says_why_it_skips_without_cuda():
    """scripts/gpu_check.sh needs a CUDA GPU; without one (hidden here, on any machine) it
    exits 77 with a clear message."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PY=sys.executable)
    proc = run_tagged(["bash", str(GPU_CHECK)], timeout_s=120, env=env)
    assert proc.returncode == 77, proc.stdout + proc.stderr
    assert "SKIPPED - no CUDA GPU is visible" in proc.stdout


def test_gpu_check_cpu_parts_pass():
    """Every check of scripts/gpu_check.py runs its CPU part here (small models, one process):
    a check that lost its `return` or broke with the code it checks fails in CI, not on the
    first lent GPU."""
    script = GPU_CHECK.parent / "gpu_check.py"
    # the script's own budget ends it (later checks SKIP) before the test's timeout kills it
    proc = run_tagged([sys.executable, str(script), "--cpu", "--budget-s", "300"], timeout_s=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for name in (
        "bf16_train",
        "offload_bitwise",
        "staging_race",
        "host_state",
        "host_threads",
        "hf_models",
        "input_prefetch",
    ):
        assert re.search(rf"^{name}\s+PASS", proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    assert proc.stdout.rstrip().endswith("gpu_check: PASS")


def test_gpu_profile_runs_on_the_cpu(tmp_path):
    """scripts/gpu_profile.py (where a GPU step's time goes) runs its measurements on the CPU:
    the first lent GPU gets a script that works."""
    script = GPU_CHECK.parent / "gpu_profile.py"
    proc = run_tagged(
        [sys.executable, str(script), "--cpu", "--steps", "2", "--out", str(tmp_path)],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu_profile.md").read_text()
    for variant in ("engine", "engine, no prefetch", "plain", "plain + recompute"):
        assert re.search(rf"^\| {re.escape(variant)} \| [0-9.]+ \|", report, re.MULTILINE), variant
    assert "engine: cProfile, own time" in report


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU: scripts/gpu_check.sh not run"
)
def test_gpu_check_passes_on_this_gpu_machine():
    """On a machine with a GPU, the whole GPU check (scripts/gpu_check.sh: NCCL at world
    size 1, and the uneven collectives and engine at world size 2 where two GPUs exist)."""
    proc = run_tagged(
        ["bash", str(GPU_CHECK)], timeout_s=560, env=dict(os.environ, PY=sys.executable)
    )
    print(proc.stdout[-5000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "gpu_check: PASS" in proc.stdout
    if torch.cuda.device_count() >= 2:
        assert "world size 2 uneven NCCL collectives and engine" in proc.stdout


def test_non_finite_gradient_skips_the_update_in_fp32():
    x, y = make_data(1, 2)[0]
    engine = Engine(
        build_model("gpt-tiny"), make_plan([2], [1.0], [1]), LocalComm(), EngineConfig()
    )
    assert not engine.train_step(x, y, lr=1e30).skipped  # blows the weights up
    before = engine.full_state_dict()
    stats = engine.train_step(x, y, lr=LR)
    assert stats.skipped and not torch.isfinite(torch.tensor(stats.grad_norm))
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.optimizer.step_count == 1


def test_global_rng_dropout_is_replayed_in_recompute():
    """per_sample_dropout=False: dropout draws from the global generator. With one
    micro-batch, the engine's forward draws the masks in the same order as a plain model
    forward; the backward recompute restores the saved generator state, so the gradients
    match a reference seeded the same way only if every recompute replays its mask. (The
    engine's AdamW is torch's single-tensor arithmetic here, as the reference's: the subject is
    the masks, and the attention key biases' zero gradients are rounding noise that another
    kernel's rounding turns into lr-sized steps, see engine_common.TEST_EPS.)"""
    cfg = EngineConfig(
        grad_clip=0.0,
        per_sample_dropout=False,
        adamw=AdamWHyper(eps=TEST_EPS),
        adamw_kernel="single",
    )
    data = make_data(3, 3)
    engine = Engine(
        build_model("gpt-tiny", dropout=0.2), make_plan([3], [1.0], [3]), LocalComm(), cfg
    )
    stats = []
    for step, (x, y) in enumerate(data):
        torch.manual_seed(100 + step)
        stats.append(engine.train_step(x, y, lr=LR))
    truth = _global_rng_reference(cfg, data, torch.float64)
    variants = [_global_rng_reference(cfg, data, torch.float32, t) for t in (1, 2)]
    # the masks are the same draws in fp64: the losses agree before any update
    assert truth.losses[0] == pytest.approx(variants[0].losses[0], rel=1e-6)
    NoiseFloor.measure(truth, variants).check(
        "global-rng dropout", params=engine.full_state_dict(), losses=[s.loss for s in stats]
    )


def _global_rng_reference(cfg, data, dtype, threads: int = 1) -> Trajectory:
    """A plain model seeded as the engine's steps are, AdamW on the whole batch."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = build_model("gpt-tiny", dropout=0.2).materialize(
            "cpu", torch.Generator().manual_seed(cfg.seed)
        )
        ref = ref.to(dtype)
        named = [(f"{u}.{n}", p) for u, n, p in ref.named_unit_parameters()]
        opt = torch.optim.AdamW(
            adamw_param_groups(named, cfg.adamw.weight_decay),
            lr=LR,
            betas=cfg.adamw.betas,
            eps=cfg.adamw.eps,
        )
        ref.train()
        run = Trajectory()
        for step, (x, y) in enumerate(data):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            loss = ref(x, y)
            loss.backward()
            opt.step()
            run.losses.append(loss.item())
        run.params = {n: p.detach().clone() for n, p in named}
        return run
    finally:
        torch.set_num_threads(before)


def test_global_rng_continues_from_the_forward_across_steps():
    """per_sample_dropout=False, seeded ONCE: each step's forward must draw fresh numbers,
    continuing where the previous forward stopped, as a plain model does. (The recompute
    rewinds the generators unit by unit; without restoring them after the backward, step t+1
    drew the numbers step t's units had used.)"""
    cfg = EngineConfig(grad_clip=0.0, per_sample_dropout=False, adamw=AdamWHyper(eps=TEST_EPS))
    data = make_data(3, 3)
    engine = Engine(
        build_model("gpt-tiny", dropout=0.2), make_plan([3], [1.0], [3]), LocalComm(), cfg
    )
    torch.manual_seed(100)
    ours = [engine.train_step(x, y, lr=LR).loss for x, y in data]
    ref = build_model("gpt-tiny", dropout=0.2).materialize(
        "cpu", torch.Generator().manual_seed(cfg.seed)
    )
    named = [(f"{u}.{n}", p) for u, n, p in ref.named_unit_parameters()]
    opt = torch.optim.AdamW(
        adamw_param_groups(named, cfg.adamw.weight_decay),
        lr=LR,
        betas=cfg.adamw.betas,
        eps=cfg.adamw.eps,
    )
    ref.train()
    torch.manual_seed(100)
    expect = []
    for x, y in data:
        opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        opt.step()
        expect.append(loss.item())
    assert ours == pytest.approx(expect, rel=1e-6)


def test_token_counts_are_reduced_exactly():
    """The global token count goes through the all-reduce as int64 (training) and fp64
    (evaluation): an fp32 count is inexact above 2**24 tokens, which a large global batch of
    long sequences passes (e.g. 4096 x 8192)."""
    engine = Engine(
        build_model("gpt-tiny"), make_plan([2], [1.0], [1]), LocalComm(), EngineConfig()
    )
    seen = []
    real = engine.comm.all_reduce

    def spy(t, op="sum"):
        seen.append(t.dtype)
        return real(t, op)

    engine.comm.all_reduce = spy
    x, y = make_data(1, 2)[0]
    engine.train_step(x, y, lr=LR)
    assert seen[0] == torch.int64  # the step's token count, before anything else
    seen.clear()
    engine.eval_loss(x, y)
    assert seen == [torch.float64]


def test_unused_parameters_get_zero_gradients_from_unzeroed_buffers(monkeypatch):
    """The fp32 gradient buffers are not zeroed (each slot's first gradient is copied in,
    runtime/autograd.py `drain_first`): a parameter the forward does not use must still get an
    exact zero, not stale memory. Here the unzeroed buffers are poisoned with NaN, and one
    block skips its MLP (its `ln_2` and `mlp.*` get no gradient). The run equals one with
    zeroed buffers bit for bit, and the unused parameters (no weight decay) never move."""
    from cephalo.runtime.memory import MemoryLedger

    def train(poison: bool):
        model = build_model("gpt-tiny")
        block = model.units[1].module
        block.mlp.forward = lambda x: torch.zeros_like(x)  # ln_2 and the MLP: unused
        cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.0))
        original = MemoryLedger.alloc

        def alloc(self, category, numel, dtype, **kw):
            out = original(self, category, numel, dtype, **kw)
            if category == "grad_accum" and not kw.get("zero"):
                out.fill_(float("nan") if poison else 0.0)
            return out

        monkeypatch.setattr(MemoryLedger, "alloc", alloc)
        engine = Engine(model, make_plan([4], [1.0], [2]), LocalComm(), cfg)
        before = engine.full_state_dict()
        stats = [engine.train_step(x, y, lr=LR) for x, y in make_data(3, 4)]
        monkeypatch.setattr(MemoryLedger, "alloc", original)
        return before, engine.full_state_dict(), stats

    before, poisoned, stats = train(poison=True)
    _, zeroed, zeroed_stats = train(poison=False)
    unused = [k for k in poisoned if k.startswith("blocks.0.") and (".mlp." in k or ".ln_2." in k)]
    assert len(unused) == 6, unused
    assert all(
        not s.skipped and s.grad_norm == z.grad_norm
        for s, z in zip(stats, zeroed_stats, strict=True)
    )
    for name, t in poisoned.items():
        assert torch.equal(t, zeroed[name]), name
    for name in unused:
        assert torch.equal(poisoned[name], before[name]), name
    assert not torch.equal(
        poisoned["blocks.0.attn.c_proj.weight"], before["blocks.0.attn.c_proj.weight"]
    )


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_tail_equals_the_unfused_order_bitwise(micro, tied):
    """The fused tail (costmodel/rules.py: the last block's forward and backward in the
    head's pass, no recompute) computes what the unfused order computes, bit for bit: the
    same kernels on the same inputs. Dropout on (its masks per sample), tied and untied
    embeddings, one micro-batch and several with a smaller last one."""

    def train(fuse: bool):
        cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS), fuse_tail=fuse)
        model = build_model("gpt-tiny", dropout=0.1, tie_embeddings=tied)
        engine = Engine(model, make_plan([5], [1.0], [micro]), LocalComm(), cfg)
        stats = [engine.train_step(x, y, lr=LR) for x, y in make_data(3, 5)]
        return engine, stats

    fused, fused_stats = train(True)
    plain, plain_stats = train(False)
    assert fused.fuse_tail and not plain.fuse_tail
    assert [s.loss for s in fused_stats] == [s.loss for s in plain_stats]
    assert [s.grad_norm for s in fused_stats] == [s.grad_norm for s in plain_stats]
    a, b = fused.full_state_dict(), plain.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
