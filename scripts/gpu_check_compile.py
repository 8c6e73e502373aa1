"""scripts/gpu_check.py's `compile` check: the engine's blocks compiled (`parallel.compile`,
src/cephalo/runtime/capture/) against the eager engine, on the GPU the check runs on.

On CUDA: GPT-2 124M in bf16, 2 micro-batches of 4 x seq, dropout 0.1 (per-sample masks given
to the compiled code), every block but the fused tail's recomputed, 5 steps, for `off`,
`graphs` (CUDA graphs per block type and shape) and `inductor` (torch.compile per block type):
- `graphs` replays the eager kernels: its losses within 1e-3 relative of eager (bf16; the note
  says whether they are bitwise), its graphs captured once per signature, not per block;
- `inductor` fuses in fp32 where eager rounds every op to bf16: within 2e-2 relative (a few
  bf16 ulps, 3.9e-3 each, over 5 steps);
- both lower the loss, and the note gives each mode's median step (steps 3-5: the first two
  compile / capture), the numbers `runtime/capture/apply.py`'s `AUTO` is set from.
On the CPU (`--cpu`, CI): "graphs" is refused with its one message, and the capture's
plumbing (one callable per block type, masks drawn outside and given in) with the compile
step left out is bitwise the eager engine (an inductor compile is minutes of CI on 2 cores:
tests/test_engine_dist.py compiles once)."""

from __future__ import annotations

import statistics
import time

import torch

STEPS = 5
TIMED_FROM = 2
"""Steps before this index compile or capture: not timed."""


def _engine(setup, model: str, batch: int, micro: int, dtype: str, compile_mode: str):
    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.capture.blocks import CompiledBlocks
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    seq = 32 if model == "gpt-tiny" else setup.seq
    rank = RankPlan(0, "gpu", batch, micro, -(-batch // micro), 1.0)
    plan = Plan("manual", model, seq, batch, dtype, [rank])
    mode = "off" if compile_mode == "plumbing" else compile_mode
    cfg = EngineConfig(device=str(setup.device), seed=0, compile=mode)
    engine = Engine(build_model(model, dropout=0.1), plan, setup.comm, cfg)
    if compile_mode == "plumbing":  # the capture without a compiler (the CPU part)
        engine.runner.compiled = CompiledBlocks("plumbing", engine.device, lambda fn: fn)
    return engine, seq


def _run(setup, mode: str, model: str, batch: int, micro: int, dtype: str):
    """(losses, median timed step s, the engine's CompiledBlocks) of STEPS steps."""
    engine, seq = _engine(setup, model, batch, micro, dtype, mode)
    vocab = engine.model.spec.vocab_size
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses, times = [], []
    for _ in range(STEPS if setup.cuda else 2):  # the CPU part checks plumbing: 2 steps
        if setup.cuda:
            torch.cuda.synchronize(setup.device)
        t0 = time.perf_counter()
        losses.append(engine.train_step(x, y, lr=3e-4).loss)  # reads the loss: synchronised
        times.append(time.perf_counter() - t0)
    compiled = engine.runner.compiled
    del engine
    if setup.cuda:
        torch.cuda.empty_cache()
    return losses, statistics.median(times[TIMED_FROM:] or times), compiled


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def check_compile(setup) -> tuple[list[str], str]:
    from cephalo.errors import CephaloError

    failures: list[str] = []
    if not setup.cuda:
        try:
            _engine(setup, "gpt-tiny", 4, 2, "fp32", "graphs")
            failures.append('"graphs" was not refused on the CPU')
        except CephaloError as err:
            if "captures CUDA graphs" not in str(err):
                failures.append(f'"graphs" refused with another message: {err}')
        eager, _, _ = _run(setup, "off", "gpt-tiny", 4, 2, "fp32")
        plain, _, blocks = _run(setup, "plumbing", "gpt-tiny", 4, 2, "fp32")
        if plain != eager:
            failures.append(f"the capture's plumbing changed the losses: {plain} vs {eager}")
        if blocks.calls == 0 or blocks.block_types != 1:
            failures.append(f"blocks did not run through one shared callable ({blocks.calls})")
        return failures, "graphs refused; capture plumbing bitwise eager"

    model, batch, micro = setup.big_model, 8, 4
    runs = {
        m: _run(setup, m, model, batch, micro, setup.low) for m in ("off", "graphs", "inductor")
    }
    eager = runs["off"][0]
    for mode, bound in (("graphs", 1e-3), ("inductor", 2e-2)):
        losses, _, blocks = runs[mode]
        worst = _worst(losses, eager)
        if worst > bound:
            failures.append(f"{mode}: losses {losses} vs eager {eager} (worst {worst:.1e})")
        if not losses[-1] < losses[0]:
            failures.append(f"{mode}: the loss did not fall: {losses}")
        if blocks is None or blocks.calls == 0:
            failures.append(f"{mode}: no block ran compiled")
    graphs = runs["graphs"][2]
    captures = sum(getattr(fn, "captures", 0) for fn in graphs._callables.values()) if graphs else 0
    if captures > 4:  # forward and recompute + backward of the one micro-batch shape (+ slack)
        failures.append(f"graphs: {captures} captures for one block type and shape")
    times = {m: r[1] for m, r in runs.items()}
    best = min(times, key=times.get)
    note = (
        f"{model} {setup.low} {batch // micro}x{micro}x{setup.seq}, dropout 0.1: step "
        + ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in times.items())
        + f"; graphs {'bitwise' if runs['graphs'][0] == eager else 'within rounding'} "
        f"({_worst(runs['graphs'][0], eager):.0e}), inductor {_worst(runs['inductor'][0], eager):.0e}"
        f"; fastest: {best} ({captures} graph captures)"
    )
    return failures, note
