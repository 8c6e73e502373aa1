"""Reference trainers the engine is checked against.

- `train_reference`: one process, the WHOLE global batch per step, plain `torch.optim.AdamW`
  (weight decay where `wants_weight_decay` says), `clip_grad_norm_`, loss = the model's mean
  token loss. What every plan must reproduce (DESIGN "Plan invariance").
- `train_fsdp2`: PyTorch FSDP2 (`fully_shard` per unit, then the root) on the same global
  batches split by rank, run on every rank of a `dist_harness.DistributedPool`. FSDP2 only
  shards evenly, so it is the reference for even fractions.

Both run every unit under `SampleDropout(seed, step, unit index, global sample offset)` (the
engine's plan-invariant dropout), so they agree with each other and with the engine with
dropout on. Parameters come back by `<unit>.<param>` (the engine's `full_state_dict` names;
a tied parameter once, under its first unit).

Models are built by a picklable factory (`model_factory(name, seed, **overrides)`), so the
same factory crosses into pool workers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from cephalo.modeling.registry import build_model
from cephalo.modeling.units import IGNORE_INDEX, UnitModel
from cephalo.runtime.dropout import SampleDropout
from cephalo.runtime.state.param_groups import adamw_param_groups

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids [B, s], labels [B, s]), labels pre-shifted


@dataclass
class OptimConfig:
    """AdamW and clipping settings shared by the references and the engine under test."""

    lr: float | Sequence[float] = 1e-3
    """Learning rate, or one per step."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW eps."""
    weight_decay: float = 0.1
    """Decoupled weight decay on the parameters `wants_weight_decay` selects."""
    grad_clip: float | None = 1.0
    """Global gradient-norm clip (None or 0: no clipping; the norm is still reported)."""
    seed: int = 0
    """Dropout seed (`SampleDropout`); the engine's `EngineConfig.seed`."""

    def lr_at(self, step: int) -> float:
        return float(self.lr if isinstance(self.lr, int | float) else self.lr[step])


@dataclass
class ReferenceRun:
    """What a reference training run produced."""

    losses: list[float] = field(default_factory=list)
    """Global mean token loss per step (before the update)."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm per step (before clipping)."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Final parameters by `<unit>.<param>` (whole tensors, CPU, fp32)."""
    grad_clip: float | None = None
    """The clipping threshold used (`train_transformers(clip_to_first_norm=...)` sets it)."""
    aux_losses: list[float] = field(default_factory=list)
    """MoE with `output_router_logits`: transformers' `aux_loss` per step."""


def _build(name: str, seed: int, overrides: dict) -> UnitModel:
    return build_model(name, **overrides).materialize("cpu", torch.Generator().manual_seed(seed))


def model_factory(name: str, seed: int = 0, **overrides) -> Callable[[], UnitModel]:
    """A picklable zero-argument factory for a materialised CPU model (same init everywhere)."""
    return functools.partial(_build, name, seed, overrides)


def named_unit_params(model: UnitModel) -> list[tuple[str, nn.Parameter]]:
    """(`<unit>.<param>`, parameter), each parameter once."""
    return [(f"{unit}.{pname}", p) for unit, pname, p in model.named_unit_parameters()]


class _UnitDropoutHooks:
    """Runs each unit's forward under `SampleDropout(seed, step, unit index, sample_offset)`
    through module hooks, so the model (or FSDP2's root) is called as a whole."""

    def __init__(self, model: UnitModel, seed: int, sample_offset: int):
        self.seed, self.sample_offset, self.step = seed, sample_offset, 0
        self._active: list[SampleDropout] = []
        self._handles = []
        for index, unit in enumerate(model.units):
            self._handles.append(
                unit.module.register_forward_pre_hook(functools.partial(self._enter, index))
            )
            self._handles.append(unit.module.register_forward_hook(self._exit))

    def _enter(self, index: int, module: nn.Module, args: tuple) -> None:
        mode = SampleDropout(self.seed, self.step, index, self.sample_offset)
        mode.__enter__()
        self._active.append(mode)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._active.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _optimizer(named: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        adamw_param_groups(named, cfg.weight_decay), lr=cfg.lr_at(0), betas=cfg.betas, eps=cfg.eps
    )


def _clip(params: list[nn.Parameter], cfg: OptimConfig) -> float:
    max_norm = cfg.grad_clip if cfg.grad_clip else math.inf
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def train_reference(
    factory: Callable[[], UnitModel],
    batches: Sequence[Batch],
    cfg: OptimConfig,
    steps: int | None = None,
) -> ReferenceRun:
    """Train one process on the whole global batch of each step (`batches[step]`)."""
    steps = len(batches) if steps is None else steps
    model = factory()
    model.train()
    named = named_unit_params(model)
    params = [p for _, p in named]
    opt = _optimizer(named, cfg)
    hooks = _UnitDropoutHooks(model, cfg.seed, sample_offset=0)
    run = ReferenceRun()
    try:
        for step in range(steps):
            input_ids, labels = batches[step]
            hooks.step = step
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids, labels)  # mean over the global batch's tokens
            loss.backward()
            run.grad_norms.append(_clip(params, cfg))
            opt.step()
            run.losses.append(loss.item())
    finally:
        hooks.remove()
    run.params = {name: p.detach().clone() for name, p in named}
    return run


def _tied_groups(model: UnitModel) -> list[list[nn.Module]]:
    """Unit modules grouped so that units sharing a parameter (tied weights) form one FSDP
    group: FSDP2 cannot shard one parameter in two groups."""
    units = model.units
    owner: dict[int, int] = {}
    parent = list(range(len(units)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for index, unit in enumerate(units):
        for p in unit.module.parameters():
            if id(p) in owner:
                parent[find(index)] = find(owner[id(p)])
            else:
                owner[id(p)] = index
    groups: dict[int, list[nn.Module]] = {}
    for index, unit in enumerate(units):
        groups.setdefault(find(index), []).append(unit.module)
    return list(groups.values())


def train_fsdp2(
    factory: Callable[[], UnitModel],
    batches: Sequence[Batch],
    cfg: OptimConfig,
    batch_sizes: Sequence[int] | None = None,
    steps: int | None = None,
) -> ReferenceRun:
    """FSDP2 on the current process group (call on every rank, e.g. via `pool.run`).

    Rank r trains on rows [sum(batch_sizes[:r]), +batch_sizes[r]) of each global batch
    (default: an even split). The gradient is that of the mean over ALL tokens of the global
    batch: each rank's loss is its token-loss SUM over the global token count, and FSDP2
    reduce-scatters with a plain SUM (`set_gradient_divide_factor(1.0)` and
    `set_force_sum_reduction_for_comms(True)`: gloo has no AVG/PREMUL_SUM). Returns the same
    `ReferenceRun` on every rank, parameters gathered whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    steps = len(batches) if steps is None else steps
    global_batch = batches[0][0].shape[0]
    if batch_sizes is None:
        base, extra = divmod(global_batch, world)
        batch_sizes = [base + (1 if r < extra else 0) for r in range(world)]
    if len(batch_sizes) != world or sum(batch_sizes) != global_batch or min(batch_sizes) < 1:
        raise ValueError(
            f"batch_sizes {batch_sizes} must give each of {world} ranks >= 1 of {global_batch} rows"
        )
    start = sum(batch_sizes[:rank])
    rows = slice(start, start + batch_sizes[rank])

    model = factory()
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    for group in _tied_groups(model):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():  # the setters act on one FSDP state each, not recursively
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    named = named_unit_params(model)  # after wrapping: FSDP2 registers new (DTensor) parameters
    params = [p for _, p in named]
    opt = _optimizer(named, cfg)
    hooks = _UnitDropoutHooks(model, cfg.seed, sample_offset=start)
    run = ReferenceRun()
    try:
        for step in range(steps):
            input_ids, labels = (t[rows] for t in batches[step])
            hooks.step = step
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            opt.zero_grad(set_to_none=True)
            global_tokens = int((batches[step][1] != IGNORE_INDEX).sum())
            local_tokens = int((labels != IGNORE_INDEX).sum())
            # model() is the local token mean; turn it into this rank's share of the global mean
            loss = model(input_ids, labels) * (local_tokens / global_tokens)
            loss.backward()
            run.grad_norms.append(_clip(params, cfg))  # DTensor grads: a global norm
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            run.losses.append(total.item())
    finally:
        hooks.remove()
    run.params = {name: p.full_tensor().detach().clone() for name, p in named}
    return run


def train_transformers(
    directory: str,
    batches: Sequence[Batch],
    cfg: OptimConfig,
    steps: int | None = None,
    clip_to_first_norm: float | None = None,
) -> ReferenceRun:
    """Plain transformers, nothing of cephalo's model code: `AutoModelForCausalLM.
    from_pretrained(directory)` in fp32, the WHOLE global batch per step, loss = the mean
    token cross-entropy of its logits against the (pre-shifted) labels (MoE with
    `output_router_logits`: + `router_aux_loss_coef` x transformers' `aux_loss` of the whole
    batch, which is what its `outputs.loss` adds), `torch.optim.AdamW`
    (weight decay on matrices, `adamw_param_groups`), `clip_grad_norm_`. Parameters come
    back under transformers' names (a tied weight once). No dropout masks are replayed: give
    it dropout-free configs. `clip_to_first_norm=f`: clip at f x the first step's gradient
    norm instead of `cfg.grad_clip` (families' gradient scales differ), returned in
    `grad_clip` for the system under test to use."""
    import transformers

    steps = len(batches) if steps is None else steps
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = _optimizer(named, cfg)
    run = ReferenceRun()
    for step in range(steps):
        # a batch may carry position ids (packed chat samples): transformers' own packing path
        input_ids, labels, *positions = batches[step]
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        position_ids = positions[0] if positions else None
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        loss = torch.nn.functional.cross_entropy(
            out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            run.aux_losses.append(out.aux_loss.item())
        loss.backward()
        if clip_to_first_norm is not None and step == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
            cfg = dataclasses.replace(cfg, grad_clip=clip_to_first_norm * norm)
        run.grad_norms.append(_clip(params, cfg))
        opt.step()
        run.losses.append(loss.item())
    run.params = {name: p.detach().clone() for name, p in named}
    run.grad_clip = cfg.grad_clip
    return run


def train_peft(
    directory: str,
    batches: Sequence[Batch],
    cfg: OptimConfig,
    lora_config=None,
    adapters: dict[str, torch.Tensor] | None = None,
    adapter_dir: str | None = None,
    nf4_base: bool = False,
) -> ReferenceRun:
    """peft on plain transformers, one process, the WHOLE global batch per step:
    `from_pretrained(directory)` in fp32, then `get_peft_model(model, lora_config)` with the
    adapters set to `adapters` (peft's saved keys), or `PeftModel.from_pretrained(model,
    adapter_dir, is_trainable=True)`; `torch.optim.AdamW` on the adapters (weight decay on
    matrices), `clip_grad_norm_`, loss = the mean token cross-entropy. `nf4_base`: every
    linear weight but the output head replaced by its NF4 round trip first (QLoRA's base).
    Parameters come back under peft's saved keys (the adapter name left out)."""
    import peft
    import transformers

    from cephalo.modeling.nf4 import nf4_roundtrip

    steps = len(batches)
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if nf4_base:
            head = model.get_output_embeddings()
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, nn.Linear) and module is not head:
                        module.weight.copy_(nf4_roundtrip(module.weight))
        if adapter_dir is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
        else:
            model = peft.get_peft_model(model, lora_config)
    model.train()
    named = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    if adapters is not None:
        assert {n for n, _ in named} == set(adapters), {n for n, _ in named} ^ set(adapters)
        with torch.no_grad():
            for n, p in named:
                p.copy_(adapters[n])
    params = [p for _, p in named]
    opt = _optimizer(named, cfg)
    run = ReferenceRun()
    for step in range(steps):
        input_ids, labels = batches[step]
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        loss.backward()
        run.grad_norms.append(_clip(params, cfg))
        opt.step()
        run.losses.append(loss.item())
    run.params = {name: p.detach().clone() for name, p in named}
    return run
