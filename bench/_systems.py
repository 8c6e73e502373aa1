"""The two systems the engine benchmarks run side by side on every rank, and how they are
measured the same way.

- `OursTrainer`: `cephalo.runtime.engine.engine.Engine` under a plan.
- `Fsdp2Trainer`: PyTorch FSDP2 (`fully_shard` per unit, then the root), gradient
  accumulation with `set_requires_gradient_sync(False)` on all but the last micro-batch,
  optionally per-unit activation checkpointing (`checkpoint_wrapper`, the like-for-like
  baseline: the engine always recomputes each unit in backward), and the same emulated
  slowdown as the engine (`SlowdownUnit`).

Both use the same model (from the registry, untied embeddings: FSDP2 cannot shard one
parameter in two groups), fp32, AdamW with the same hyper-parameters and global-norm
clipping, and the same loss (token-loss sum over the global token count).

Measurements shared by both:
- `tracked_peak_bytes`: peak of live CPU tensor storage during one step (`LiveTensorBytes`,
  a TorchDispatchMode that follows every storage an op creates until it is freed, FSDP2's
  `resize_` frees included), with the persistent state registered first. (torch's own
  `MemTracker` cannot be used: its module hooks fail on the engine's `functional_call`.)
- `CollectiveCounter`: calls and bytes of FSDP2's all-gathers and reduce-scatters, counted by
  wrapping `torch.distributed.all_gather_single` / `reduce_scatter_single` (what FSDP2 calls
  in torch 2.13; `CommDebugMode` crashes in its module tracker here), with the bytes in the
  engine's `comm.counters` convention: an all-gather counts the bytes this rank receives,
  a reduce-scatter the bytes it sends, i.e. (world - 1) / world of the full buffer.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cephalo.modeling.registry import build_model
from cephalo.modeling.units import IGNORE_INDEX
from cephalo.planner.plan import Plan
from cephalo.runtime.emulation import ComputeEmulator, thread_cpu_measures_work
from cephalo.runtime.state.param_groups import adamw_param_groups

# SlowdownUnit's identity marks return views of the unit's output; nothing downstream
# modifies them in place, which is what FSDP2 warns about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
LR = 1e-4


def bench_model(name: str, seed: int = 0, **overrides: Any):
    """A materialised CPU model with untied embeddings and no dropout (no randomness, so
    neither system pays for replaying it)."""
    overrides = {"tie_embeddings": False, "dropout": 0.0, **overrides}
    return build_model(name, **overrides).materialize("cpu", torch.Generator().manual_seed(seed))


def make_data(
    global_batch: int, seq_len: int, vocab: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (global_batch, seq_len), generator=g)
    y = torch.randint(0, vocab, (global_batch, seq_len), generator=g)
    return x, y


# ====================================================================== ours
class OursTrainer:
    """The engine, built on this rank for `plan`."""

    def __init__(
        self,
        model_name: str,
        overrides: dict,
        plan: Plan,
        mode: str = "lga",
        slowdown: float = 1.0,
        memory_budget_bytes: int | None = None,
        comm_impl: str = "auto",
        prefetch: bool = True,
        host_copy_bytes_per_s: float | None = None,
        overlap_reduce: bool = True,
        inter_node_bytes_per_s: float | None = None,
        cluster=None,
    ):
        """`cluster`: the emulated cluster it runs on (its links: the faithful emulated comm,
        runtime/collectives/emulated.py, as `cephalo run` runs it)."""
        from cephalo.runtime.collectives.comm import make_comm
        from cephalo.runtime.collectives.shard_groups import emulate_links
        from cephalo.runtime.engine.engine import Engine, EngineConfig
        from cephalo.runtime.state.adamw import AdamWHyper

        overrides = {"tie_embeddings": False, "dropout": 0.0, **overrides}
        model = build_model(model_name, **overrides)  # on meta: the engine materialises its shards
        self.comm = make_comm(comm_impl, validate=False)
        cfg = EngineConfig(
            mode=mode,
            compute_dtype="fp32",
            adamw=AdamWHyper(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
            grad_clip=GRAD_CLIP,
            seed=0,
            slowdown=slowdown,
            memory_budget_bytes=memory_budget_bytes,
            validate_collectives=False,
            per_sample_dropout=False,
            prefetch=prefetch,
            host_copy_bytes_per_s=host_copy_bytes_per_s,
            overlap_reduce=overlap_reduce,
            inter_node_bytes_per_s=inter_node_bytes_per_s,
        )
        if cluster is not None:
            cfg = emulate_links(cfg, cluster, True)
        self.engine = Engine(model, plan, self.comm, cfg)
        self.plan = plan

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch: one run in a flat plan, one per micro-batch in
        a staged one (`sample_ranges`, in the order its micro-batches take them)."""
        from cephalo.runtime.pipeline.stage_step import sample_ranges

        runs = [x[a : a + n] for a, n in sample_ranges(self.plan, self.comm.rank)]
        if not runs:
            return x[0:0]
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def step(self, x: torch.Tensor, y: torch.Tensor):
        return self.engine.train_step(self.rows(x), self.rows(y), LR)

    def persistent_tensors(self) -> list[torch.Tensor]:
        """The engine's state on the device (the host-held part is host memory, not counted)."""
        out = []
        for us in self.engine.shards:
            params = us.param_buf if us.param_buf is not None else us.master
            out += [params, us.grad, us.exp_avg, us.exp_avg_sq]
            if us.param_buf is None and us.host is not None:
                out.append(us.host_copy)
        return out


# ====================================================================== FSDP2
class _StretchMark(torch.autograd.Function):
    """Identity whose backward marks a time: at a unit's OUTPUT it records when the unit's
    backward starts (after FSDP2's pre-backward unshard, which hooks the same tensor first);
    at its INPUT it stretches the time since then by the slowdown."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, clock: dict, is_output: bool, emulator: ComputeEmulator
    ) -> torch.Tensor:
        ctx.clock, ctx.is_output, ctx.emulator = clock, is_output, emulator
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.is_output:
            ctx.clock["bwd_start"] = ctx.emulator.start()
        elif "bwd_start" in ctx.clock:
            ctx.emulator.finish(ctx.clock.pop("bwd_start"))
        return grad, None, None, None


class SlowdownUnit(nn.Module):
    """Runs `inner` with its compute stretched by `slowdown`, the way the engine's emulation
    does (runtime/emulation.py): forward is timed around the call; backward
    from the moment the output's gradient arrives to the moment the input's gradient leaves
    (recompute included under activation checkpointing). A unit whose input needs no
    gradient (the embedding: token ids) has its backward, a scatter-add of the embedding
    gradient, left unstretched."""

    def __init__(self, inner: nn.Module, slowdown: float):
        super().__init__()
        self.inner = inner
        # CPU-only autograd runs the backward on the calling thread, so its CPU time is
        # the unit's work as in the engine
        self.emulator = ComputeEmulator(
            slowdown, use_cpu_time=thread_cpu_measures_work(torch.device("cpu"))
        )
        self._clock: dict = {}

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x = _StretchMark.apply(x, self._clock, False, self.emulator)
        mark = self.emulator.start()
        out = self.inner(x, *rest)
        self.emulator.finish(mark)
        if out.requires_grad:
            out = _StretchMark.apply(out, self._clock, True, self.emulator)
        return out


class _Chain(nn.Module):
    """The units in order: embedding(ids) -> blocks -> head(h, labels) = token-loss sum."""

    def __init__(self, units: list[nn.Module]):
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.units[0](input_ids)
        for unit in self.units[1:-1]:
            h = unit(h)
        return self.units[-1](h, labels)


class Fsdp2Trainer:
    """FSDP2 on the default process group: even shards, this rank's rows of the batch."""

    def __init__(
        self,
        model_name: str,
        overrides: dict,
        batch_sizes: list[int],
        micro_batch_size: int,
        checkpointing: bool,
        slowdown: float = 1.0,
    ):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.rank, world = dist.get_rank(), dist.get_world_size()
        model = bench_model(model_name, **overrides)
        units: list[nn.Module] = []
        for u in model.units:
            m = checkpoint_wrapper(u.module) if checkpointing else u.module
            units.append(SlowdownUnit(m, slowdown) if slowdown != 1.0 else m)
        self.root = _Chain(units)
        mesh = init_device_mesh("cpu", (world,))
        for unit in self.root.units:
            fully_shard(unit, mesh=mesh)
        fully_shard(self.root, mesh=mesh)
        for module in self.root.modules():  # gloo has no AVG / PREMUL_SUM: plain sums
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        named = [(n, p) for n, p in self.root.named_parameters()]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(
            adamw_param_groups(named, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS
        )
        start = sum(batch_sizes[: self.rank])
        self.rows = slice(start, start + batch_sizes[self.rank])
        self.micro = micro_batch_size
        self.batch = batch_sizes[self.rank]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x[self.rows], y[self.rows]
        tokens = torch.tensor([float((y != IGNORE_INDEX).sum())])
        dist.all_reduce(tokens)  # the global token count, as the engine does
        self.opt.zero_grad(set_to_none=True)
        starts = list(range(0, self.batch, self.micro))
        loss_sum = 0.0
        for j, a in enumerate(starts):
            self.root.set_requires_gradient_sync(j == len(starts) - 1)
            loss = self.root(x[a : a + self.micro], y[a : a + self.micro]) / tokens
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
        self.opt.step()
        return loss_sum

    def persistent(self) -> list[Any]:
        return [self.root, self.opt]


# ====================================================================== measuring
class CollectiveCounter:
    """Counts FSDP2's all-gathers and reduce-scatters on this rank while `active`."""

    def __init__(self):
        self.active = False
        self.calls = {"all_gather": 0, "reduce_scatter": 0}
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}
        world = dist.get_world_size()
        share = (world - 1) / world
        self._install(
            "all_gather_single",
            "all_gather",
            lambda a, k: k.get("output_tensor", a[0] if a else None),
            share,
        )
        self._install(
            "reduce_scatter_single",
            "reduce_scatter",
            lambda a, k: k.get("input", a[1] if len(a) > 1 else None),
            share,
        )

    def _install(self, fn_name: str, key: str, full_of: Callable, share: float) -> None:
        original = getattr(dist, fn_name)
        if getattr(original, "_bench_counted", False):
            original = original._bench_original

        def counted(*args, **kwargs):
            if self.active:
                full = full_of(args, kwargs)
                self.calls[key] += 1
                self.bytes[key] += int(full.numel() * full.element_size() * share)
            return original(*args, **kwargs)

        counted._bench_counted = True
        counted._bench_original = original
        setattr(dist, fn_name, counted)

    def reset(self) -> None:
        for d in (self.calls, self.bytes):
            for k in d:
                d[k] = 0


# ====================================================================== ideal bound
SOLO_MICRO_BATCH = 8
"""Largest micro-batch of the solo runs behind the ideal bound (CPU time per sample is flat beyond ~4)."""


class SoloTrainer:
    """One rank's term of the ideal bound: the engine training ALONE on this rank (world size
    1, no collectives, the whole model) at the rank's best micro-batch: the largest up to
    `SOLO_MICRO_BATCH` whose working memory without any training state (boundaries
    offloaded) fits the device, as planner_quality's ideal bound has it. Memory is otherwise
    ignored: the whole state would not fit a small device. Shared by hetero_throughput.py
    and calibration.py so that both benches bound a cluster the same way."""

    def __init__(self, model_name: str, overrides: dict, seq_len: int, cm: Any, device: Any):
        import numpy as np

        from cephalo.planner.makers import manual_plan

        ms = np.arange(1, SOLO_MICRO_BATCH + 1)
        fits = (
            cm.memory_without_state(device.type_key, device.memory_bytes, ms, ms, True)
            <= device.memory_bytes
        )
        self.micro_batch = int(ms[fits].max()) if fits.any() else 1
        self.batch = 2 * self.micro_batch  # two micro-batches: accumulation is part of a step
        plan = manual_plan(
            model_name, seq_len, [self.batch], [self.micro_batch], [1.0], [device.type_key]
        )
        self.trainer = OursTrainer(
            model_name, overrides, plan, slowdown=device.slowdown, comm_impl="local"
        )

    def samples_per_s(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One solo step on the first rows of (x, y): this rank's samples per compute second
        (`StepStats.busy_s`, without the optimizer step)."""
        out = self.trainer.engine.train_step(x[: self.batch], y[: self.batch], LR)
        return self.batch / out.busy_s


def ideal_tokens_per_s(solo: Sequence[Sequence[float]], seq_len: int) -> float:
    """The ideal bound from each rank's solo samples/s per round (`solo[rank][round]`, all
    ranks measured at the same time in a round, so they share the machine's cores as the
    ranks do in training): per round the ranks' sum, the median round, in tokens/s."""
    rounds = min(len(r) for r in solo)
    return statistics.median(sum(r[i] for r in solo) for i in range(rounds)) * seq_len
