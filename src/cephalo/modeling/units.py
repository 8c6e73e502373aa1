"""The contract between a model and the engine: a model is a list of units.

    units[0]        kind "embedding": module(input_ids: LongTensor[b, s]) -> hidden [b, s, h]
    units[1:-1]     kind "block":     module(hidden) -> hidden
    units[-1]       kind "head":      module(hidden, labels: LongTensor[b, s]) -> loss_sum

Packed samples (several documents in one row, `data.packing`) add one optional input:
`position_ids: LongTensor[b, s]`, each document's positions restarting at 0, passed as a
keyword to the embedding and to every block (`embedding(input_ids, position_ids=...)`,
`block(h, position_ids=...)`); a model that takes it says so with `supports_position_ids`
(the HF adapter: transformers' own packed-sequence masks follow from the positions). Without
it a row is one sequence, positions 0, 1, ...

`loss_sum` is the SUM of the per-token cross-entropy over the labels that are not
`IGNORE_INDEX` (a 0-dim fp32 tensor). The engine divides by the global token count, so the
gradient is that of the mean over all tokens of the global batch, whatever the plan.
`labels` are already shifted: labels[:, t] is the target of position t.

Tied weights (GPT-2's wte / lm_head) are the same `nn.Parameter` object in two units; the
engine detects them by identity (the first unit owns the parameter; later units borrow it).

Units are built on the `meta` device by default and materialised by the engine (or by
`UnitModel.materialize`) with `reset_parameters` semantics: `init_weights(generator)`
initialises every parameter deterministically from the generator (unit by unit, in
`named_unit_parameters` order; `init_unit_weights` does one unit), so that the
single-process reference and every rank of a sharded run start from the same weights.
Random draws happen on the CPU (`fill_normal_`), so the values do not depend on the device.
`initial_values(unit, params, generator)` is the one place a unit's starting values come
from (the engine materialises through it, one unit at a time); a model with pretrained
weights returns those instead of drawing.

Buffers are not state: a unit may hold only CONSTANT buffers, real (never meta) tensors
computed when the model is built (Gemma's embedding scale), which are not trained, sharded
or checkpointed; the engine moves them to the compute device and `materialize` keeps them.
Anything that varies with the input (rotary tables, masks) is computed in `forward` or held
outside the units (the HF adapter's `LayerInputs`). The built-in GPT holds none. Modules
draw random numbers only inside `forward` (dropout, from the global generator), so
restoring the RNG state replays them.

`nn.Module.to_empty` replaces each parameter by a new object when moving off `meta`, which
would untie tied weights; `UnitModel.materialize` re-ties them. An engine that materialises
by other means must do the same (see `tied_parameter_slots`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cephalo.errors import CephaloError
from cephalo.specs.adapter import Linear
from cephalo.specs.model import ModelSpec

IGNORE_INDEX = -100


class LMHead(nn.Module):
    """The head unit of a causal LM, shared by every family: `logits(h)` (the family's final
    norm and output projection, defined by the subclass) and the loss every head returns,
    the SUM of the token cross-entropies in fp32 whatever the compute dtype (the engine sums
    these across micro-batches and ranks, then divides by the global token count)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        h: torch.Tensor,
        labels: torch.Tensor,
        row_weights: torch.Tensor | None = None,
        per_row: bool = False,
    ) -> torch.Tensor:
        """The token cross-entropy SUM (fp32). `row_weights` ([rows, 1], fp32): each row's
        token losses weighted by its row's weight before the sum (the DPO objective's
        gradient, preference/objective.py: its loss is not linear in the token losses, but
        its gradient is a per-row weight on them). `per_row`: each row's sum ([rows]),
        without a weight (the completions' log-probabilities, negated)."""
        logits = self.logits(h)
        flat = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(
            -1, logits.shape[-1]
        )
        if row_weights is None and not per_row:
            return torch.nn.functional.cross_entropy(
                flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        token = torch.nn.functional.cross_entropy(
            flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)  # 0 where ignored
        if per_row:
            return token.sum(dim=1)
        return (token * row_weights).sum()


@dataclass
class Unit:
    """One schedulable piece of the model."""

    name: str
    """Stable, unique name, used as the prefix of its parameters in checkpoints (e.g. `blocks.3`)."""
    kind: str
    """`embedding`, `block` or `head`."""
    module: nn.Module


class UnitModel(nn.Module):
    """A model as units. Subclasses pass their units to `__init__` (an nn.ModuleDict mirror
    is kept for `parameters()` / `state_dict()`) and implement `init_parameter`."""

    adapter = None
    """`modeling.lora.Adapter` once `apply_adapter` gave the model LoRA adapters (the only
    trainable parameters then; the rest has `requires_grad` False: the frozen base)."""
    quantized_parameters: frozenset[str] = frozenset()
    """`<unit>.<param>` of frozen parameters the engine stores in NF4 (QLoRA)."""
    supports_position_ids = False
    """True if the embedding and blocks take `position_ids` (packed samples); see the module
    docstring."""

    def __init__(self, spec: ModelSpec, units: list[Unit]):
        super().__init__()
        self.spec = spec
        self.unit_list = units
        # register so that .to(), .parameters(), state_dict() see everything once
        self.unit_modules = nn.ModuleDict({u.name.replace(".", "_"): u.module for u in units})

    @property
    def units(self) -> list[Unit]:
        return self.unit_list

    def init_parameter(
        self, unit_name: str, param_name: str, param: nn.Parameter, generator: torch.Generator
    ) -> None:  # pragma: no cover - abstract
        """Initialise one parameter in place (under no_grad), drawing only from `generator`."""
        raise NotImplementedError

    @torch.no_grad()
    def initial_values(
        self,
        unit_name: str,
        named_params: Sequence[tuple[str, nn.Parameter]],
        generator: torch.Generator,
    ) -> dict[str, torch.Tensor]:
        """The starting values of the parameters `unit_name` owns (`named_params`, in
        `named_unit_parameters` order), as new fp32 CPU tensors: what an engine materialises
        for one unit at a time. The default draws them with `init_parameter`, in order, from
        `generator` (so calling it for every unit in order equals `init_weights`); a model
        with pretrained weights returns those instead (and need not draw)."""
        values = {}
        for name, p in named_params:
            values[name] = torch.empty(p.shape, dtype=torch.float32)
            self.init_parameter(unit_name, name, values[name], generator)
        return values

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Initialise every parameter, unit by unit, in `named_unit_parameters` order."""
        for unit in self.units:
            self.init_unit_weights(unit.name, generator)

    @torch.no_grad()
    def init_unit_weights(self, unit_name: str, generator: torch.Generator) -> None:
        """Initialise the parameters `unit_name` owns (not the tied ones it borrows). Calling
        it for every unit in order, with one generator, equals `init_weights`: an engine can
        materialise and initialise one unit at a time and get the same values."""
        for owner, pname, p in self.named_unit_parameters():
            if owner == unit_name:
                self.init_parameter(owner, pname, p, generator)

    def named_unit_parameters(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(unit name, parameter name within the unit, parameter), each parameter once
        (a tied parameter is reported under the first unit that holds it)."""
        seen: set[int] = set()
        for u in self.units:
            for pname, p in u.module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield u.name, pname, p

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Single-process reference: the MEAN token loss over the batch (the engine's target)."""
        extra = position_kwargs(self, position_ids)
        h = self.units[0].module(input_ids, **extra)
        for u in self.units[1:-1]:
            h = u.module(h, **extra)
        loss_sum = self.units[-1].module(h, labels)
        n_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
        return loss_sum / n_tokens

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise CephaloError(f"no unit named {name!r}; units are {[u.name for u in self.units]}")

    def materialize(self, device: torch.device | str, generator: torch.Generator) -> UnitModel:
        """Allocate real storage for a meta-built model and initialise it from `generator`.
        Tied parameters stay one Parameter object."""
        slots = tied_parameter_slots(self)
        constants = [
            (module, name, buf)
            for module in self.modules()
            for name, buf in module._buffers.items()
            if buf is not None and not buf.is_meta
        ]
        self.to_empty(device=device)
        retie(slots)
        for module, name, buf in constants:  # to_empty left them uninitialised
            module._buffers[name] = buf.to(device)
        self.init_weights(generator)
        return self

    @torch.no_grad()
    def materialize_units(
        self, device: torch.device | str, generator: torch.Generator, indices: Sequence[int]
    ) -> UnitModel:
        """Allocate real storage on `device` and initial values for the units at `indices`
        only (of a meta-built model); every other unit stays on the meta device, holding
        nothing. What the profiler measures (the embedding, one block, the head) without
        holding the whole model.

        Tied parameters stay one Parameter object: a parameter a chosen unit holds is
        materialised once and put in every slot holding it, an unchosen unit's included.
        Constant buffers of the chosen units move to `device`. Values: each chosen unit's own
        parameters from `init_unit_weights`, in unit order, from `generator`; a parameter it
        borrows from an unchosen owner from `initial_values` under the owner's name. The
        skipped units draw nothing, so these values are not those `materialize` gives the
        same units (a model with pretrained weights reads its own): for measuring time and
        memory, not for training."""
        count = len(self.units)
        chosen = sorted({range(count)[i] for i in indices})  # IndexError when out of range
        real: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialised one
        for i in chosen:
            for module in self.units[i].module.modules():
                for p in module._parameters.values():
                    if p is not None and p.is_meta and id(p) not in real:
                        real[id(p)] = nn.Parameter(
                            torch.empty_like(p, device=device), requires_grad=p.requires_grad
                        )
                for name, buf in list(module._buffers.items()):
                    if buf is not None:  # constants (see the module docstring)
                        module._buffers[name] = (
                            torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
                        )
        names = {self.units[i].name for i in chosen}
        borrowed: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for owner, pname, p in self.named_unit_parameters():
            if owner not in names and id(p) in real:
                borrowed.setdefault(owner, []).append((pname, real[id(p)]))
        for module in self.modules():  # every slot, so tied parameters stay tied
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in real:
                    module._parameters[name] = real[id(p)]
        for unit in self.units:
            if unit.name in names:
                self.init_unit_weights(unit.name, generator)
            elif unit.name in borrowed:
                named = borrowed[unit.name]
                values = self.initial_values(unit.name, named, generator)
                for pname, p in named:
                    p.copy_(values[pname])
        return self


def position_kwargs(model: UnitModel, position_ids: torch.Tensor | None) -> dict:
    """The keyword arguments carrying `position_ids` to the embedding and blocks: none without
    them; a model that cannot take them is refused with the reason."""
    if position_ids is None:
        return {}
    if not model.supports_position_ids:
        raise CephaloError(
            f"model {model.spec.name} does not take per-document position ids, so it cannot "
            f"train on packed samples: set data.packing = false, or use a transformers model "
            f"(a model directory or an hf-* preset)"
        )
    return {"position_ids": position_ids}


def tied_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) slots that hold the same Parameter object, for every
    parameter held in more than one place. Take them before `to_empty` / `_apply`, and give
    them to `retie` afterwards."""
    slots_by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                slots_by_id.setdefault(id(p), []).append((module, attr))
    groups = []
    for group in slots_by_id.values():
        if len(group) > 1:
            groups.append(group)
    return groups


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make every slot of each group hold the first slot's Parameter."""
    for group in groups:
        first_module, first_attr = group[0]
        shared = first_module._parameters[first_attr]
        for module, attr in group[1:]:
            module._parameters[attr] = shared


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
)


@contextlib.contextmanager
def skip_init_on_meta(device: torch.device | str) -> Iterator[None]:
    """Building on the meta device: make `torch.nn.init`'s fillers no-ops inside, as modules'
    `reset_parameters` call them. Meta tensors hold no values (`materialize` initialises the
    real ones), and the first call of a filler imports torch's compiler stack (about a second
    and a half), which a command that only reads the model's shape never needs."""
    if torch.device(device).type != "meta":
        yield
        return
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


@torch.no_grad()
def fill_normal_(
    param: torch.Tensor, std: float, generator: torch.Generator, mean: float = 0.0
) -> None:
    """Fill `param` with N(mean, std^2) drawn in fp32 on the CPU from `generator`, so that the
    values are the same whatever the parameter's device and dtype."""
    if generator.device.type != "cpu":
        raise CephaloError(
            "init_weights needs a CPU torch.Generator (values must not depend on the device)"
        )
    values = torch.empty(param.shape, dtype=torch.float32).normal_(mean, std, generator=generator)
    param.copy_(values)


def unit_param_counts(units: Sequence[Unit]) -> list[int]:
    """Parameters owned by each unit, a tied parameter counted once, in the first unit holding it."""
    seen: set[int] = set()
    counts = []
    for u in units:
        n = 0
        for p in u.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts.append(n)
    return counts


def block_linears(module: nn.Module) -> tuple[Linear, ...]:
    """The Linear layers of a block (and transformers' Conv1D, GPT-2's, which peft's
    `all-linear` adapts too: its weight is stored (in, out)), in module order."""
    out = []
    for name, sub in module.named_modules():
        # a block already wrapped by peft: its LoRA matrices are not base layers, and the base
        # Linear `q_proj.base_layer` stands for `q_proj`
        if ".lora_" in f".{name}":
            continue
        name = name.removesuffix(".base_layer")
        if isinstance(sub, nn.Linear):
            out.append(Linear(name, sub.in_features, sub.out_features))
        elif type(sub).__name__ == "Conv1D" and getattr(sub, "weight", None) is not None:
            fan_in, fan_out = sub.weight.shape
            out.append(Linear(name, int(fan_in), int(fan_out)))
    return tuple(out)


def spec_from_units(
    units: Sequence[Unit],
    *,
    name: str,
    arch: str,
    hidden_size: int,
    num_heads: int,
    vocab_size: int,
    ffn_hidden_size: int,
    tied_embeddings: bool,
    max_seq_len: int,
    active_params_per_block: int = 0,
    num_experts: int = 0,
    experts_per_token: int = 0,
) -> ModelSpec:
    """A `ModelSpec` whose parameter counts come from the real modules (so the cost model
    plans exactly the model that will run); MoE: the active parameters per block too."""
    kinds = [u.kind for u in units]
    num_layers = len(units) - 2
    if kinds != ["embedding"] + ["block"] * num_layers + ["head"]:
        raise CephaloError(f"units must be embedding, blocks..., head; got kinds {kinds}")
    counts = unit_param_counts(units)
    block_counts = set(counts[1:-1])
    if len(block_counts) > 1:
        raise CephaloError(
            f"model {name}: blocks differ in size ({sorted(block_counts)}); the cost model assumes equal blocks"
        )
    return ModelSpec(
        name=name,
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        vocab_size=vocab_size,
        ffn_hidden_size=ffn_hidden_size,
        params_per_block=counts[1] if num_layers else 0,
        embedding_params=counts[0],
        head_params=counts[-1],
        tied_embeddings=tied_embeddings,
        max_seq_len=max_seq_len,
        block_linears=block_linears(units[1].module) if num_layers else (),
        active_params_per_block=active_params_per_block,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
    )
