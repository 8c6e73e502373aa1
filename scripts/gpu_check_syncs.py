"""scripts/gpu_check.py's checks of issue 38's findings 10, 11 and 13 on the GPU.

step_syncs    the engine's steps after the first make no host sync but the update's one
              read (`ShardUpdate`'s `_read`): on CUDA every step after the first runs under
              `torch.cuda.set_sync_debug_mode("error")` (the read itself let through), for
              GPT and for a tiny Qwen3-MoE directory with the router loss on; on the CPU the
              same steps under the counter of runtime/host_syncs.py
adamw_split   the shard groups keep the fused AdamW on CUDA (runtime/engine/setup.py
              `shard_group_kernel`): its result for an element does not depend on where a
              shard boundary falls, bit for bit, over 3 steps (on the CPU the single-tensor
              kernel, which hierarchical plans take there, the same way)
dpo_steps     the DPO objective (issue 42) on the device: full fine-tuning (the reference
              precomputed by `Engine.reference_logps`) on gpt-tiny and LoRA (the reference
              the adapters-off forward) on a tiny Qwen2 directory, each step after the first
              under the same sync check, the first loss log 2 where the policy is the
              reference, and the device's losses those of the CPU (rel 1e-4, fp32)
step_split    the step clock's CUDA events (runtime/engine/step_clock.py): compute,
              communication and optimizer are disjoint parts of the compute stream's span of
              the step, and that span is the host's step (the step ends in its one read);
              on the CPU the host-timed parts fit in the step
"""

from __future__ import annotations

import tempfile

import torch

STEPS = 3


def _engine(
    setup, model, batch: int, micro: int, dtype: str, seq: int | None = None, dpo=None, lora=False
):
    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    seq = seq or (32 if model == "gpt-tiny" else setup.seq)
    rank = RankPlan(0, "gpu", batch, micro, -(-batch // micro), 1.0)
    plan = Plan("manual", model, seq, batch, dtype, [rank])
    overrides = {"dropout": 0.0} if not model.startswith("/") else {}
    cfg = EngineConfig(device=str(setup.device), seed=0, grad_clip=1.0, dpo=dpo)
    unit_model = build_model(model, **overrides)
    if lora:
        from cephalo.modeling.lora import AdapterSettings, apply_adapter

        apply_adapter(unit_model, AdapterSettings("lora", r=4, alpha=8))
    return Engine(unit_model, plan, setup.comm, cfg), seq


def _data(vocab: int, batch: int, seq: int, steps: int = STEPS):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _steps_without_sync(setup, engine, data, refs=None, losses=None) -> list[str]:
    """The steps after the first under the sync check; the failures. `refs`: each step's
    DPO reference log-probabilities (full fine-tuning); `losses` receives the steps' losses."""
    import cephalo.runtime.engine.shard_update as shard_update
    from cephalo.runtime.host_syncs import HostSyncs

    refs = refs or [None] * len(data)
    losses = [] if losses is None else losses
    losses.append(engine.train_step(*data[0], lr=1e-3, ref_logps=refs[0]).loss)  # validates
    if not setup.cuda:
        failures = []
        for (x, y), ref in zip(data[1:], refs[1:], strict=True):
            with HostSyncs() as syncs:
                losses.append(engine.train_step(x, y, lr=1e-3, ref_logps=ref).loss)
            other = [s for s in syncs.summary() if "(_read)" not in s]
            reads = len(syncs.events) - len(other)
            if other or reads != 1:
                failures.append(f"host syncs in a step: {reads} reads, others {other}")
        return failures
    read = shard_update._read

    def allowed_read(*args):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(*args)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    shard_update._read = allowed_read
    try:
        for (x, y), ref in zip(data[1:], refs[1:], strict=True):
            torch.cuda.set_sync_debug_mode("error")
            try:
                losses.append(engine.train_step(x, y, lr=1e-3, ref_logps=ref).loss)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    except RuntimeError as err:
        import traceback

        frame = traceback.extract_tb(err.__traceback__)[-1]  # the Python line that synced
        at = f"{frame.filename}:{frame.lineno} ({frame.name})"
        return [f"a host sync in a step after the first, at {at}: {str(err).splitlines()[0]}"]
    finally:
        shard_update._read = read
    return []


def check_step_syncs(setup) -> tuple[list[str], str]:
    import gpu_check_models

    failures: list[str] = []
    batch, micro = 4, 2
    engine, seq = _engine(setup, "gpt-tiny", batch, micro, setup.low)
    steps = STEPS if setup.cuda else 2  # (the CPU suite runs this part: one counted step)
    data = _data(256, 4, seq, steps)
    failures += [f"gpt-tiny: {f}" for f in _steps_without_sync(setup, engine, data)]
    del engine
    if not setup.cuda:  # (tests/test_hf_dist.py counts the MoE steps' syncs on the CPU)
        return failures, "a step of GPT without a host sync (runtime/host_syncs.py)"
    with tempfile.TemporaryDirectory() as tmp:
        directory = gpu_check_models._tiny_hf_dir(tmp, "qwen3_moe")
        engine, _ = _engine(setup, directory, batch, micro, setup.low, seq=32)
        if getattr(engine.model, "router_aux", None) is None:
            failures.append("qwen3_moe: the router loss is off (the check needs it on)")
        data = _data(512, 4, 32)  # the tiny directory's vocabulary
        failures += [f"qwen3_moe: {f}" for f in _steps_without_sync(setup, engine, data)]
        del engine
    return failures, f"{STEPS - 1} steps each of GPT and Qwen3-MoE under set_sync_debug_mode"


def check_adamw_split(setup) -> tuple[list[str], str]:
    from cephalo.runtime.engine.setup import shard_group_kernel
    from cephalo.runtime.state.adamw import AdamWHyper, ShardedAdamW, ShardGroup

    kernel = shard_group_kernel(setup.device, hierarchical=True)
    failures = []
    if setup.cuda and kernel is not None:
        failures.append(f"hierarchical plans on CUDA take the {kernel!r} AdamW kernel, not fused")
    if not setup.cuda and kernel != "single":
        failures.append(f"hierarchical plans on the CPU take {kernel!r}, not 'single'")
    n = 100_003
    gen = torch.Generator().manual_seed(0)
    param0 = (torch.randn(n, generator=gen) * 0.02).to(setup.device)
    grads = [torch.randn(n, generator=gen).to(setup.device) for _ in range(3)]

    def run(cuts: list[int]) -> torch.Tensor:
        param = param0.clone()
        m, v, g = torch.zeros_like(param), torch.zeros_like(param), torch.zeros_like(param)
        bounds = list(zip([0, *cuts], [*cuts, n], strict=True))
        decay = n // 2  # elements [0, n/2) have weight decay, wherever the cuts fall
        groups = [
            ShardGroup(param[a:b], g[a:b], m[a:b], v[a:b], [(0, max(0, min(b, decay) - a))])
            for a, b in bounds
        ]
        opt = ShardedAdamW(groups, AdamWHyper(weight_decay=0.1), kernel)
        for grad in grads:
            g.copy_(grad)
            opt.step(1e-3, torch.tensor(0.7, device=setup.device) if setup.cuda else 0.7)
        return param

    whole, split = run([]), run([1001, 50_017, 77_777])
    if not torch.equal(whole, split):
        differ = int((whole != split).sum())
        failures.append(f"{differ} of {n} elements differ once the shards are cut elsewhere")
    return failures, f"kernel {kernel or 'fused'}: bitwise equal under other shard cuts"


def check_step_split(setup) -> tuple[list[str], str]:
    batch, micro = (8, 4) if setup.cuda else (4, 2)
    engine, seq = _engine(setup, setup.big_model, batch, micro, setup.low)
    vocab = 50257 if setup.cuda else 256
    failures, notes = [], []
    for i, (x, y) in enumerate(_data(vocab, batch, seq, STEPS if setup.cuda else 2)):
        s = engine.train_step(x, y, lr=3e-4)
        if i == 0:
            continue  # warm-up
        parts = s.busy_s + s.comm_wait_s + s.optimizer_s
        if setup.cuda:
            span = s.device_step_s
            if span is None:
                failures.append("no device_step_s on CUDA")
                continue
            idle = span - parts
            notes.append(
                f"step {s.step_s * 1e3:.1f} ms: device {span * 1e3:.1f} = compute "
                f"{s.busy_s * 1e3:.1f} + comm {s.comm_wait_s * 1e3:.2f} + optimizer "
                f"{s.optimizer_s * 1e3:.1f} + idle {idle * 1e3:.1f}"
            )
            if idle < -1e-3 or min(s.busy_s, s.comm_wait_s, s.optimizer_s) < 0:
                failures.append(f"the parts overlap: {notes[-1]}")
            if not 0.8 * s.step_s <= span <= s.step_s + 1e-3:
                failures.append(f"the device's span is not the host's step: {notes[-1]}")
        else:
            if s.device_step_s is not None:
                failures.append("device_step_s on the CPU")
            if parts > s.step_s * 1.05:
                failures.append(f"parts {parts:.4f} s exceed the step {s.step_s:.4f} s")
            notes.append(f"step {s.step_s * 1e3:.1f} ms, parts {parts * 1e3:.1f} ms")
    del engine
    return failures, notes[-1] if notes else ""


def _pairs(vocab: int, pairs: int, seq: int, steps: int = STEPS):
    """DPO batches: rows 2i / 2i + 1 one prompt, two completions of their own lengths."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, vocab, (2 * pairs, seq), generator=gen)
        ids[1::2, : seq // 2] = ids[0::2, : seq // 2]  # the shared prompt
        labels = torch.roll(ids, -1, dims=1)
        labels[:, : seq // 2 - 1] = -100
        cut = torch.randint(seq // 2 + 1, seq, (2 * pairs,), generator=gen)
        for r in range(2 * pairs):
            labels[r, int(cut[r]) :] = -100
        out.append((ids, labels))
    return out


def check_dpo_steps(setup) -> tuple[list[str], str]:
    import math

    import gpu_check_models
    from cephalo.preference.objective import DpoSettings

    failures: list[str] = []
    dpo = DpoSettings(beta=0.5)
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        qwen2 = gpu_check_models._tiny_hf_dir(tmp, "qwen2") if setup.cuda else None
        cases = [("gpt-tiny full", "gpt-tiny", False, 256, 32)]
        if qwen2 is not None:
            cases.append(("qwen2 LoRA", qwen2, True, 512, 32))
        for label, model, lora, vocab, seq in cases:
            data = _pairs(vocab, 2, seq, STEPS if setup.cuda else 2)
            runs = {}
            for where in ("device", "cpu") if setup.cuda else ("device",):
                on = setup if where == "device" else _cpu_setup(setup)
                engine, _ = _engine(on, model, 2, 1, "fp32", seq=seq, dpo=dpo, lora=lora)
                refs = None if lora else [engine.reference_logps(x, y) for x, y in data]
                losses: list[float] = []
                if where == "device":
                    failures += [
                        f"{label}: {f}" for f in _steps_without_sync(on, engine, data, refs, losses)
                    ]
                else:
                    losses = [
                        engine.train_step(x, y, 1e-3, ref_logps=r).loss
                        for (x, y), r in zip(data, refs or [None] * len(data), strict=True)
                    ]
                runs[where] = losses
                del engine
            first = runs["device"][0]
            if not lora and abs(first - math.log(2)) > 1e-5:
                failures.append(f"{label}: first loss {first:.6f}, not log 2 (policy = reference)")
            if "cpu" in runs:
                for a, b in zip(runs["device"], runs["cpu"], strict=True):
                    if not abs(a - b) <= 1e-4 * abs(b):
                        failures.append(f"{label}: device loss {a:.6f} vs CPU {b:.6f}")
            notes.append(f"{label} {runs['device'][0]:.4f} -> {runs['device'][-1]:.4f}")
    return failures, "; ".join(notes) + " (steps after the first without a host sync)"


def _cpu_setup(setup):
    """`setup` on the CPU (a single-rank comm), for the device-vs-CPU comparison."""
    import dataclasses

    from cephalo.runtime.collectives.comm import LocalComm

    return dataclasses.replace(setup, device=torch.device("cpu"), cuda=False, comm=LocalComm())
