"""Helpers shared by the engine tests: plans, data, the reference trainers of
tests/reference.py driven by an engine config, and the parameter comparison."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from cephalo.modeling.units import IGNORE_INDEX
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan
from cephalo.runtime.engine.config import StepStats
from cephalo.runtime.engine.engine import Engine, EngineConfig
from equivalence import NoiseFloor, ReorderedGemm, perturb_one_gradient
from reference import OptimConfig, model_factory, train_reference

# AdamW eps for the equivalence tests. Some gradients are exactly zero in exact arithmetic
# (the attention key bias: softmax is shift-invariant) and come out as ~1e-10 rounding noise
# whose sign depends on summation order; with eps=1e-8 Adam's normalisation turns that noise
# into lr-sized steps, so two correct implementations drift apart by ~lr on those elements.
# eps=1e-6 keeps real gradients (>= 1e-4 here) dominant and the noise harmless.
TEST_EPS = 1e-6
LR = 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (a
    step takes 50x longer with 2 threads under load). Import this into a test module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_plan(
    batches, fractions, micro, seq_len=16, dtype="fp32", offload=False, model="gpt-tiny"
) -> Plan:
    return manual_plan(model, seq_len, batches, micro, fractions, offload=offload, dtype=dtype)


def make_data(steps: int, batch: int, seq_len: int = 16, vocab: int = 256, seed: int = 1):
    """`steps` global batches (input_ids, labels) with some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y[:, :3] = IGNORE_INDEX
        data.append((x, y))
    return data


def rank_slice(plan: Plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    start = plan.batch_offsets()[rank]
    return x[start : start + plan.ranks[rank].batch_size]


def optim_config(cfg: EngineConfig, lr: float = LR) -> OptimConfig:
    """The reference trainers' settings for an engine config."""
    return OptimConfig(
        lr=lr,
        betas=cfg.adamw.betas,
        eps=cfg.adamw.eps,
        weight_decay=cfg.adamw.weight_decay,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
    )


def run_reference(model: str, overrides: dict, data, cfg: EngineConfig):
    """`train_reference` (one process, whole global batch) for an engine config."""
    return train_reference(model_factory(model, cfg.seed, **overrides), data, optim_config(cfg))


def noise_splits(batch: int) -> list[list[int] | None]:
    """The equivalent fp32 orderings of one global batch that `reference_floor` measures:
    the whole batch at once, in two uneven gradient-accumulated halves, one row at a time."""
    splits: list[list[int] | None] = [None]
    if batch >= 2:
        splits.append([batch - batch // 2, batch // 2])
    if batch >= 3:
        splits.append([1] * batch)
    if len(splits) < 2:  # one row: the row's sequence cannot be split; take another thread count
        splits.append(None)
    return splits


def measure_floor(
    train: Callable[..., object],
    batch: int,
    fp64: bool = True,
    splits: list[list[int] | None] | None = None,
) -> NoiseFloor:
    """The `equivalence.NoiseFloor` of a reference trainer: `train(dtype=..., micro_batches=...)`
    returns a run (losses, grad_norms, params). Truth = its fp64 run (`fp64=False`: its fp32
    whole-batch run, where the model cannot run in fp64); variants = its fp32 runs in the
    `noise_splits(batch)` orderings (or `splits`; a repeated None: another thread count) and
    its whole-batch run with every GEMM summed in another order (`ReorderedGemm`)."""
    truth = train(dtype=torch.float64 if fp64 else torch.float32, micro_batches=None)
    with ReorderedGemm(chunks=2):  # another GEMM kernel's summation order
        variants = [train(dtype=torch.float32, micro_batches=None)]
    for k, split in enumerate(noise_splits(batch) if splits is None else splits):
        threads = torch.get_num_threads()
        if k and split is None:
            torch.set_num_threads(2 if threads == 1 else 1)
        try:
            variants.append(train(dtype=torch.float32, micro_batches=split))
        finally:
            torch.set_num_threads(threads)
    return NoiseFloor.measure(truth, variants)


def reference_floor(
    model: str, overrides: dict, data, cfg: EngineConfig, lr=LR, steps: int | None = None
) -> NoiseFloor:
    """`measure_floor` of `train_reference` (one process, the whole global batch) on `data`
    under an engine config; its `truth` is the fp64 run."""
    factory = model_factory(model, cfg.seed, **overrides)
    opt = optim_config(cfg, lr)
    return measure_floor(
        functools.partial(train_reference, factory, data, opt, steps=steps), data[0][0].shape[0]
    )


def transformers_floor(directory: str, data, cfg: EngineConfig, clip_to_first_norm: float = 0.8):
    """`measure_floor` of plain transformers (`reference.train_transformers`) on `data`,
    clipped at `clip_to_first_norm` x the fp32 run's first gradient norm (families' gradient
    scales differ: logit scaling). Truth: transformers in fp64 (its fp32 islands, RMSNorm and
    rotary tables, stay fp32). Returns (floor, `cfg` with that clip for the engine)."""
    from reference import train_transformers

    clip = train_transformers(directory, data, optim_config(cfg), 1, clip_to_first_norm).grad_clip
    cfg = dataclasses.replace(cfg, grad_clip=clip)
    train = functools.partial(train_transformers, directory, data, optim_config(cfg))
    return measure_floor(train, data[0][0].shape[0]), cfg


@contextlib.contextmanager
def gradient_mutation(enabled: bool = True):
    """While active, every optimizer step in this process first moves one gradient element
    (`equivalence.perturb_one_gradient`: 1e-3 of its shard's largest entry) of the first
    block shard it holds, on the device and on the host. The mutation the equivalence
    tests must catch."""
    if not enabled:
        yield
        return
    from cephalo.runtime.state.adamw import ShardedAdamW
    from cephalo.runtime.state.host_state import HostAdamW

    device_step, host_step = ShardedAdamW.step, HostAdamW.step_group

    def first_nonempty(groups):
        held = [g for g in groups if g.grad.numel()]
        return (held[1:] or held)[:1]

    def mutated_step(self, *args, **kwargs):
        for g in first_nonempty(self.groups):
            perturb_one_gradient(g.grad)
        return device_step(self, *args, **kwargs)

    def mutated_host_step(self, i, *args, **kwargs):
        if any(g is self.groups[i] for g in first_nonempty(self.groups)):
            perturb_one_gradient(self.groups[i].grad)
        return host_step(self, i, *args, **kwargs)

    ShardedAdamW.step, HostAdamW.step_group = mutated_step, mutated_host_step
    try:
        yield
    finally:
        ShardedAdamW.step, HostAdamW.step_group = device_step, host_step


def max_rel_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over tensors of max|a - b| / max|b| (and the worst tensor's name)."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst, name = 0.0, ""
    for k, b in ref.items():
        d = ((ours[k] - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
        if d > worst:
            worst, name = d, k
    return worst, name


def counted_steps(
    engine: Engine, plan: Plan, rank: int, data, counted: int = 2
) -> tuple[list[StepStats], list[list[tuple[str, str]]]]:
    """`engine`'s steps over `data` (this rank's slices), the first `counted` of them each
    under a `HostSyncs` counter (runtime/host_syncs.py; it costs ~40 ms a gpt-tiny step):
    every step's stats, and per counted step (op, where) of every operation that would make
    the host wait for a GPU."""
    from cephalo.runtime.host_syncs import HostSyncs

    stats, steps = [], []
    for i, (x, y) in enumerate(data):
        with HostSyncs() if i < counted else contextlib.nullcontext() as syncs:
            stats.append(
                engine.train_step(rank_slice(plan, rank, x), rank_slice(plan, rank, y), lr=LR)
            )
        if syncs is not None:
            steps.append([(e.op, e.where) for e in syncs.events])
    return stats, steps


def assert_one_read_per_step(results, label: str) -> None:
    """After the first step, each step's only host sync is the update's one read of norm,
    loss and token count (`ShardUpdate`'s `_read`; on CUDA scripts/gpu_check.py runs steps
    under `torch.cuda.set_sync_debug_mode("error")`). The first step's validated collectives
    read their fingerprints: the counter sees them (else this check could not fail)."""
    for rank, steps in enumerate(results):
        first, *later = steps
        assert later, "count at least two steps"
        assert any("_agreed_sizes" in where for _, where in first), (label, rank, first)
        for events in later:
            assert len(events) == 1, (label, rank, events)
            op, where = events[0]
            assert op == "tolist" and "shard_update.py" in where and "(_read)" in where, events
