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
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
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
    val_losses: list[float] = field(default_factory=list)
    """`train_reference(evaluations=...)`: the validation loss of each evaluation, in order."""


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

    def __init__(
        self,
        model: UnitModel | None,
        seed: int,
        sample_offset: int,
        modules: Sequence[tuple[int, nn.Module]] | None = None,
    ):
        """Hooks on the model's units, or on `modules` ((unit index, module) pairs: a
        transformers model's decoder layers are units 1..L of the engine's model)."""
        self.seed, self.sample_offset, self.step = seed, sample_offset, 0
        self._active: list[SampleDropout] = []
        self._handles = []
        if modules is None:
            modules = [(index, unit.module) for index, unit in enumerate(model.units)]
        for index, module in modules:
            self._handles.append(
                module.register_forward_pre_hook(functools.partial(self._enter, index))
            )
            self._handles.append(module.register_forward_hook(self._exit))

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
    dtype: torch.dtype = torch.float32,
    micro_batches: Sequence[int] | None = None,
    evaluations: Mapping[int, Sequence[tuple[Batch, float]]] | None = None,
) -> ReferenceRun:
    """Train one process on the whole global batch of each step (`batches[step]`).

    `dtype`: the parameters', activations' and optimizer state's dtype (fp64: the ground
    truth `tests/equivalence.py` measures fp32 noise against). `micro_batches`: row counts
    that split each global batch into gradient-accumulated pieces, each piece's token-loss
    sum over the global token count (the same gradient in exact arithmetic, another fp32
    summation order: what reordering alone moves). `evaluations`: after step s (1-based),
    the validation loss of the batches `evaluations[s]` as the trainer computes it (each
    batch's mean token loss, weighted; dropout off), in `run.val_losses`."""
    steps = len(batches) if steps is None else steps
    evaluations = evaluations or {}
    model = factory().to(dtype)
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

            def loss_of(rows: slice, x=input_ids, y=labels) -> torch.Tensor:
                if not isinstance(rows, slice):
                    raise ValueError("reordered rows would change the samples' dropout masks")
                hooks.sample_offset = rows.start or 0  # the rows' global sample offset
                return model(x[rows], y[rows])  # mean over the rows' tokens

            loss = backward_in_pieces(loss_of, labels, micro_batches)
            run.grad_norms.append(_clip(params, cfg))
            opt.step()
            run.losses.append(loss.item())
            if step + 1 in evaluations:
                run.val_losses.append(validation_loss(model, evaluations[step + 1]))
    finally:
        hooks.remove()
    run.params = {name: p.detach().clone() for name, p in named}
    return run


@torch.no_grad()
def validation_loss(model: UnitModel, batches: Sequence[tuple[Batch, float]]) -> float:
    """The trainer's validation loss: each batch's mean token loss, weighted (its rows
    holding labels), in eval mode (no dropout)."""
    model.eval()
    try:
        total = sum(weight * float(model(x, y)) for (x, y), weight in batches)
        return total / max(sum(weight for _, weight in batches), 1.0)
    finally:
        model.train()


def backward_in_pieces(
    loss_of: Callable[[slice | torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    micro_batches: Sequence[int] | str | None,
) -> torch.Tensor:
    """Backward of the global batch's mean token loss; returns that loss (detached).

    `loss_of(rows)`: the mean token loss of the batch rows `rows`. `micro_batches=None`: one
    backward of the whole batch. `"reversed"`: the whole batch with its rows in reverse order
    (another summation order of every batch reduction; for objectives of the whole batch,
    as MoE's aux loss, that a split would change). Else row counts: each piece's mean times
    its share of the batch's tokens, backward piece by piece (gradient accumulation: the
    same gradient in exact arithmetic, another fp32 summation order)."""
    total = None
    for rows, share in batch_pieces(labels, micro_batches):
        piece = loss_of(rows) * share if share != 1.0 else loss_of(rows)
        piece.backward()
        total = piece.detach() if total is None else total + piece.detach()
    return total


def batch_pieces(
    labels: torch.Tensor, micro_batches: Sequence[int] | str | None
) -> list[tuple[slice | torch.Tensor, float]]:
    """The rows of each piece `backward_in_pieces` runs (see there) and the piece's share of
    the batch's loss tokens (its mean token loss times that share sums to the batch's)."""
    rows = labels.shape[0]
    if micro_batches is None:
        return [(slice(0, rows), 1.0)]
    if micro_batches == "reversed":
        return [(torch.arange(rows - 1, -1, -1), 1.0)]
    if sum(micro_batches) != rows or min(micro_batches) < 1:
        raise ValueError(f"micro_batches {micro_batches} must split {rows} rows")
    global_tokens = int((labels != IGNORE_INDEX).sum().clamp(min=1))
    edges = [0, *itertools.accumulate(micro_batches)]
    pieces = [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]
    return [(p, int((labels[p] != IGNORE_INDEX).sum()) / global_tokens) for p in pieces]


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, or in the logits' dtype where that is wider (fp64)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    return torch.nn.functional.cross_entropy(
        logits.to(wide).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )


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
    dtype: torch.dtype = torch.float32,
    micro_batches: Sequence[int] | None = None,
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
    `grad_clip` for the system under test to use. `dtype` and `micro_batches` as for
    `train_reference` (MoE: see `_moe_loss_backward`)."""
    import transformers

    steps = len(batches) if steps is None else steps
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        model = model.to(dtype)
    if dtype == torch.float64 and hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
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

        if getattr(model.config, "output_router_logits", False):
            loss, aux = _moe_loss_backward(model, input_ids, labels, position_ids, micro_batches)
            run.aux_losses.append(aux)
        else:

            def loss_of(rows, x=input_ids, y=labels, pos=position_ids) -> torch.Tensor:
                pos = None if pos is None else pos[rows]
                out = model(input_ids=x[rows], position_ids=pos, use_cache=False)
                return _token_loss(out.logits, y[rows])

            loss = backward_in_pieces(loss_of, labels, micro_batches)
        if clip_to_first_norm is not None and step == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
            cfg = dataclasses.replace(cfg, grad_clip=clip_to_first_norm * norm)
        run.grad_norms.append(_clip(params, cfg))
        opt.step()
        run.losses.append(loss.item())
    run.params = {name: p.detach().clone() for name, p in named}
    run.grad_clip = cfg.grad_clip
    return run


def _moe_loss_backward(model, input_ids, labels, position_ids, micro_batches):
    """MoE with `output_router_logits`: backward of transformers' `outputs.loss` of the whole
    batch (mean token cross-entropy + coef x the router's aux loss of all its tokens); returns
    (loss, aux). With `micro_batches` (row counts), each piece runs its own forward (its own
    GEMM shapes and gradient sums) and the aux loss is transformers' `load_balancing_loss_func`
    over every piece's router logits together: the same objective, another summation order.
    `"reversed"`: the whole batch with its rows reversed."""
    import sys

    ce, router = None, []
    for piece, share in batch_pieces(labels, micro_batches):
        pos = None if position_ids is None else position_ids[piece]
        out = model(input_ids=input_ids[piece], position_ids=pos, use_cache=False)
        part = _token_loss(out.logits, labels[piece]) * share
        ce = part if ce is None else ce + part
        router.append(out.router_logits)
    per_layer = tuple(torch.cat(layer) for layer in zip(*router, strict=True))
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    # the model's own reading of its config (families name the expert count differently)
    experts, top_k = model.num_experts, model.num_experts_per_tok
    aux = balance(per_layer, experts, top_k, None)
    if per_layer[0].dtype == torch.float64:
        # transformers sums in fp32 whatever the logits' dtype; the fp64 truth must not
        wide = _switch_balance(per_layer, experts, top_k)
        assert abs(wide.item() - aux.item()) <= 1e-5 * abs(aux.item()), (wide, aux)
        aux = wide
    loss = ce + model.router_aux_loss_coef * aux
    loss.backward()
    return loss.detach(), aux.item()


def _switch_balance(per_layer, num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch Transformer load-balancing loss as transformers' `load_balancing_loss_func`
    defines it (no mask), in the logits' own dtype: num_experts x sum over experts of (the
    fraction of top-k assignments, over every layer's tokens) x (the mean routing
    probability). Checked against transformers' (fp32) where it is used."""
    probs = torch.cat([torch.softmax(g, dim=-1) for g in per_layer])
    chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=num_experts).to(probs.dtype)
    return num_experts * torch.sum(counts / probs.shape[0] * probs.mean(dim=0))


def train_peft(
    directory: str,
    batches: Sequence[Batch],
    cfg: OptimConfig,
    lora_config=None,
    adapters: dict[str, torch.Tensor] | None = None,
    adapter_dir: str | None = None,
    nf4_base: bool = False,
    dtype: torch.dtype = torch.float32,
    micro_batches: Sequence[int] | None = None,
    dropout_seed: int | None = None,
) -> ReferenceRun:
    """peft on plain transformers, one process, the WHOLE global batch per step:
    `from_pretrained(directory)` in fp32, then `get_peft_model(model, lora_config)` with the
    adapters set to `adapters` (peft's saved keys), or `PeftModel.from_pretrained(model,
    adapter_dir, is_trainable=True)`; `torch.optim.AdamW` on the adapters (weight decay on
    matrices), `clip_grad_norm_`, loss = the mean token cross-entropy. `nf4_base`: every
    linear weight but the output head replaced by its NF4 round trip first (QLoRA's base).
    Parameters come back under peft's saved keys (the adapter name left out). `dtype` and
    `micro_batches` as for `train_reference` (the NF4 round trip is taken in fp32 first).
    `dropout_seed`: every decoder layer i runs as the engine's unit i + 1 under
    `SampleDropout(dropout_seed, step, i + 1, the rows' sample offset)`, so the adapters'
    `lora_dropout` draws the engine's per-sample masks."""
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
        model = model.to(dtype)
        if adapter_dir is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
        else:
            model = peft.get_peft_model(model, lora_config)
        model = model.to(dtype)
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
    hooks = None
    if dropout_seed is not None:
        layers = model.get_base_model().model.layers
        hooks = _UnitDropoutHooks(None, dropout_seed, 0, list(enumerate(layers, start=1)))
    for step in range(steps):
        input_ids, labels = batches[step]
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        if hooks is not None:
            hooks.step = step

        def loss_of(rows: slice, x=input_ids, y=labels) -> torch.Tensor:
            if hooks is not None:
                hooks.sample_offset = rows.start or 0
            return _token_loss(model(input_ids=x[rows], use_cache=False).logits, y[rows])

        loss = backward_in_pieces(loss_of, labels, micro_batches)
        run.grad_norms.append(_clip(params, cfg))
        opt.step()
        run.losses.append(loss.item())
    run.params = {name: p.detach().clone() for name, p in named}
    return run


def make_pairs(steps: int, pairs: int, seq_len: int, vocab: int, seed: int = 5) -> list[Batch]:
    """`steps` global batches of preference pairs as `preference.data` lays them out: rows
    2i / 2i + 1 one prompt with a chosen / a rejected completion of their own lengths,
    right-padded (token 0); labels[j] = ids[j + 1] where that is a completion token, else
    ignored (prompt, padding)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        ids = torch.zeros(2 * pairs, seq_len, dtype=torch.int64)
        labels = torch.full((2 * pairs, seq_len), IGNORE_INDEX, dtype=torch.int64)
        for i in range(pairs):
            p = int(torch.randint(2, seq_len // 2, (1,), generator=g))
            prompt = torch.randint(1, vocab, (p,), generator=g)
            for row in (2 * i, 2 * i + 1):
                c = int(torch.randint(1, seq_len - p + 1, (1,), generator=g))
                completion = torch.randint(1, vocab, (c,), generator=g)
                ids[row, :p] = prompt
                ids[row, p : p + c] = completion
                labels[row, p - 1 : p + c - 1] = completion
        data.append((ids, labels))
    return data


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's sum over its labelled tokens of log softmax at the label (the DPO paper's
    log pi(y | x)), fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    mask = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(dim=1)


def dpo_loss(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, loss: str = "sigmoid"
) -> torch.Tensor:
    """Mean over pairs (rows 2i chosen, 2i + 1 rejected) of the DPO paper's eq. 7
    (`sigmoid`), or of IPO as TRL's `DPOTrainer` computes it (`ipo`: (h - 1 / (2 beta))^2,
    its log-probabilities averaged over the completion's tokens by the caller)."""
    chosen = policy[0::2] - reference[0::2]
    rejected = policy[1::2] - reference[1::2]
    if loss == "ipo":
        return ((chosen - rejected - 1 / (2 * beta)) ** 2).mean()
    return -torch.nn.functional.logsigmoid(beta * (chosen - rejected)).mean()


def train_dpo(
    directory: str,
    batches: Sequence[Batch],
    cfg: OptimConfig,
    beta: float,
    lora_config=None,
    adapters: dict[str, torch.Tensor] | None = None,
    loss: str = "sigmoid",
) -> ReferenceRun:
    """DPO on plain transformers, one process, the whole global batch of pairs per step:
    with `lora_config`, peft's `get_peft_model` with the adapters set to `adapters` (peft's
    saved keys) and the reference = the same model under peft's `disable_adapter()`;
    without, full fine-tuning against a frozen deep copy of the starting model. torch AdamW
    (weight decay on matrices), `clip_grad_norm_`. Parameters come back under peft's saved
    keys (LoRA) or transformers' names. `loss="ipo"`: TRL's IPO (log-probabilities averaged
    over the completion's tokens). The run's `dpo_metrics`: TRL's metrics per step."""
    import copy

    import peft
    import transformers

    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        frozen = None
        if lora_config is not None:
            model = peft.get_peft_model(model, lora_config)
        else:
            frozen = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    named = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    if adapters is not None:
        with torch.no_grad():
            for n, p in named:
                p.copy_(adapters[n])
    params = [p for _, p in named]
    opt = _optimizer(named, cfg)
    run = ReferenceRun()
    run.dpo_metrics = []  # type: ignore[attr-defined]
    for step, (input_ids, labels) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        tokens = (labels != IGNORE_INDEX).sum(dim=1) if loss == "ipo" else 1
        with torch.no_grad():
            if frozen is not None:
                ref_logits = frozen(input_ids=input_ids, use_cache=False).logits
            else:
                with model.disable_adapter():
                    ref_logits = model(input_ids=input_ids, use_cache=False).logits
            reference = completion_logps(ref_logits, labels) / tokens
        logits = model(input_ids=input_ids, use_cache=False).logits
        policy = completion_logps(logits, labels) / tokens
        value = dpo_loss(policy, reference, beta, loss)
        value.backward()
        run.grad_norms.append(_clip(params, cfg))
        opt.step()
        run.losses.append(value.item())
        p, r = policy.detach(), reference
        chosen, rejected = beta * (p[0::2] - r[0::2]), beta * (p[1::2] - r[1::2])
        run.dpo_metrics.append(  # type: ignore[attr-defined]
            {
                "rewards/chosen": chosen.mean().item(),
                "rewards/rejected": rejected.mean().item(),
                "rewards/accuracies": (chosen > rejected).float().mean().item(),
                "rewards/margins": (chosen - rejected).mean().item(),
                "logps/chosen": p[0::2].mean().item(),
                "logps/rejected": p[1::2].mean().item(),
            }
        )
    run.params = {name: p.detach().clone() for name, p in named}
    return run
