"""Hugging Face decoder LMs as units: transformers' own modules, split where the model splits.

One adapter serves every family in `hf_families.FAMILIES` (Llama, Mistral, Qwen2/3, Gemma,
Gemma 2, Phi-3, GPT-NeoX, GPT-2, OLMo 2, Granite, SmolLM3, ...). The causal LM is built by
`AutoModelForCausalLM.from_config` (on the meta device: no weights), and its modules become

    embedding = the base model's token embedding (+ GPT-2's learned positions, embedding
                dropout, Granite's embedding multiplier: what the base model's forward adds)
    blocks    = the decoder layers, each called the way the base model's forward calls it
    head      = final norm + LM head (+ the logit multiplier / divisor / tanh soft-capping
                of the causal-LM wrapper's forward), loss in fp32 (`units.LMHead`)

so the arithmetic is exactly transformers'. A decoder layer needs more than hidden states:
the base model's forward computes position ids, the rotary (cos, sin) from its rotary module,
and the attention mask of each layer type (causal, or sliding-window for the layers that have
one) once per call and hands them to every layer. `LayerInputs` does the same, with
transformers' own `masking_utils` and the model's own rotary module, and caches them per
(batch, length, dtype, device) for the micro-batches of a step. The rotary module is held by
`LayerInputs` (a plain object shared by the blocks, not a unit's submodule), so its
`inv_freq` buffer is no unit state: nothing for the engine to shard, gather or checkpoint.

Buffers. A meta build leaves buffers on meta; `build_hf_model` fills the non-persistent ones
(rotary `inv_freq`, Gemma's embedding scale) on the CPU the way `from_pretrained` does: the
model's own `_init_weights` for the modules that hold them. Gemma's scale stays inside its
embedding module: a constant unit buffer, which the engine moves to the compute device.

Initial values, one unit at a time (`initial_values`, what the engine materialises through):
pretrained weights read from the directory's safetensors (`hf_weights.PretrainedWeights`),
or transformers' own random init scheme (`_init_weights` of each module: normal(0,
initializer_range), GPT-2's scaled residual projections, Gemma's zero-centred norms, zero
padding rows), its draws seeded per unit from the engine's generator so that every rank and
the single-process reference start alike.

Export back to transformers is `hf_export.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cephalo.errors import CephaloError, first_line
from cephalo.modeling.hf.config import (
    HF_PRESETS,
    directory_config,
    preset_config,
    transformers_module,
)
from cephalo.modeling.hf.families import Family, config_value, family_of
from cephalo.modeling.hf.weights import PretrainedWeights
from cephalo.modeling.moe import RouterAux, log_without_aux, router_recorder, router_settings
from cephalo.modeling.nf4 import quiet_torchao
from cephalo.modeling.units import LMHead, Unit, UnitModel, spec_from_units

INIT_CHOICES = ("auto", "pretrained", "random")


# ----------------------------------------------------------------------------- building
def build_hf_model(config, device: torch.device | str = "meta") -> nn.Module:
    """`AutoModelForCausalLM.from_config(config)` in fp32 on `device`; on meta, the
    non-persistent buffers are then computed on the CPU (`_materialize_buffers`). The global
    RNG is left as it was (a non-meta build runs transformers' random init)."""
    tf = transformers_module()
    with torch.random.fork_rng(devices=[]), torch.device(device), quiet_torchao():
        # (transformers imports torchao, when installed, on its first model)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if torch.device(device).type == "meta":
        _materialize_buffers(model)
    return model


@torch.no_grad()
def _materialize_buffers(model: nn.Module) -> None:
    """Real CPU values for the buffers of a meta-built transformers model, as from_pretrained
    makes them: placeholders, then `model._init_weights(module)` for each module holding
    one, with that module's parameters flagged as initialised so only buffers are written.
    A placeholder starts as NaN, so a buffer the family's init does not compute is caught."""
    owners: list[nn.Module] = []
    for mname, module in model.named_modules():
        holds = False
        for bname, buf in module._buffers.items():
            if buf is None or not buf.is_meta:
                continue
            if bname not in module._non_persistent_buffers_set:
                raise CephaloError(
                    f"{type(model).__name__}: {mname}.{bname} is a persistent buffer; cephalo "
                    "trains parameters only (this layout is not supported)"
                )
            module._buffers[bname] = torch.full(buf.shape, math.nan, dtype=buf.dtype)
            holds = True
        if holds:
            owners.append(module)
    for module in owners:
        params = list(module.parameters())
        for p in params:
            p._is_hf_initialized = True
        try:
            model._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized
        for bname, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
                raise CephaloError(
                    f"{type(model).__name__}: cannot compute buffer {bname} of "
                    f"{type(module).__name__} (its init left it unset); this layout is not supported"
                )


# ----------------------------------------------------------------------------- units
class LayerInputs:
    """What the base model's forward computes once and passes to every decoder layer:
    `position_ids`, the rotary `position_embeddings` (the model's own rotary module) and the
    attention mask of each layer type (`masking_utils.create_causal_mask` /
    `create_sliding_window_causal_mask`; None where SDPA's `is_causal` does the masking).
    Without padding every sample's mask is the same, so they are made for a batch of one
    and broadcast over the batch (eager and SDPA attention add / apply them that way; a
    [1, 1, s, s] mask instead of [b, 1, s, s]). Cached per (length, dtype, device): every
    block and micro-batch of a step reuses them. A plain object, not a module (see the
    module docstring)."""

    MAX_CACHED = 4
    MAX_CACHED_PACKED = 4
    """Entries for given position ids (packed samples): one per micro-batch, which every block
    reuses. Few, since each holds a [b, 1, s, s] mask (SDPA: bool, eager: the compute dtype;
    flash-attention: none) outside the memory ledger; with more micro-batches than this the
    masks are made again per block (cheap next to the attention they mask)."""

    def __init__(self, config, rotary: nn.Module | None):
        import inspect

        from transformers import masking_utils

        self.config = config
        self.rotary = rotary
        # Gemma 3 and a few others: one rotary table per layer type (local / global bases),
        # `rotary(x, position_ids, layer_type)`, as the base model's forward calls it
        self.rotary_per_kind = rotary is not None and (
            "layer_type" in inspect.signature(rotary.forward).parameters
        )
        self.mask_functions = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        }
        self._cache: dict[tuple, dict[str, Any]] = {}

    def __call__(
        self, h: torch.Tensor, kind: str, position_ids: torch.Tensor | None = None
    ) -> dict[str, Any]:
        if position_ids is None:
            key: tuple = (h.shape[1], h.dtype, h.device)
            rows = h[:1]  # the same for every sample: made once, broadcast
        else:
            # packed samples: each row has its own documents, so its own mask. Keyed by the
            # tensor (the engine passes one object per micro-batch to every block), which the
            # entry holds, so its id cannot be reused while cached.
            key = ("packed", id(position_ids), h.dtype, h.device)
            rows = h
        entry = self._cache.get(key)
        if entry is None:
            packed = [k for k in self._cache if k[0] == "packed"]
            if position_ids is None and len(self._cache) - len(packed) >= self.MAX_CACHED:
                self._cache = {k: self._cache[k] for k in packed}
            if position_ids is not None and len(packed) >= self.MAX_CACHED_PACKED:
                del self._cache[packed[0]]  # the oldest
            with torch.no_grad():
                if position_ids is None:
                    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                else:
                    positions = position_ids.to(h.device)
                entry = {"position_ids": positions, "masks": {}, "source": position_ids}
                if self.rotary is not None and not self.rotary_per_kind:
                    entry["position_embeddings"] = self.rotary(rows, positions)
            self._cache[key] = entry
        masks = entry["masks"]
        if self.rotary_per_kind and ("rotary", kind) not in entry:
            with torch.no_grad():
                entry["rotary", kind] = self.rotary(rows, entry["position_ids"], kind)
        if kind not in masks:
            with torch.no_grad():
                # (config, inputs_embeds, attention_mask, cache): positional across versions.
                # Position ids that restart inside a row are transformers' packed-sequence
                # format: its masks keep each document to itself (SDPA / eager masks,
                # flash-attention varlen from the position ids).
                masks[kind] = self.mask_functions[kind](
                    self.config, rows, None, None, position_ids=entry["position_ids"]
                )
        out = {"attention_mask": masks[kind], "position_ids": entry["position_ids"]}
        if "position_embeddings" in entry:
            out["position_embeddings"] = entry["position_embeddings"]
        elif ("rotary", kind) in entry:
            out["position_embeddings"] = entry["rotary", kind]
        return out


class HFEmbedding(nn.Module):
    """The token embedding and what the base model's forward does to it before the layers.
    Submodules keep the base model's attribute names (`embed_tokens`, GPT-2's `wte` / `wpe`
    / `drop`), so unit parameter names are transformers' own without the prefix."""

    def __init__(
        self,
        tokens: tuple[str, nn.Module],
        max_seq_len: int | None,
        positions: tuple[str, nn.Module] | None = None,
        dropout: tuple[str, nn.Module] | None = None,
        dropout_p: float = 0.0,
        multiplier: float | None = None,
    ):
        super().__init__()
        self.names = {}
        for role, named in (("tokens", tokens), ("positions", positions), ("dropout", dropout)):
            if named is not None:
                self.add_module(named[0], named[1])
                self.names[role] = named[0]
        self.dropout_p = dropout_p
        self.multiplier = multiplier
        self.max_seq_len = max_seq_len

    def part(self, role: str) -> nn.Module | None:
        name = self.names.get(role)
        return None if name is None else getattr(self, name)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq = input_ids.shape[1]
        if self.max_seq_len is not None and seq > self.max_seq_len:
            raise CephaloError(
                f"sequence length {seq} exceeds the model's maximum {self.max_seq_len}; shorten "
                "the data's sequences or build the model with a larger seq_len"
            )
        h = self.part("tokens")(input_ids)
        if self.multiplier is not None:
            h = h * self.multiplier
        positions = self.part("positions")
        if positions is not None:
            if position_ids is None:
                position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0)
            h = h + positions(position_ids.to(input_ids.device))
        dropout = self.part("dropout")
        if dropout is not None:
            h = dropout(h)
        if self.dropout_p:
            h = nn.functional.dropout(h, p=self.dropout_p, training=self.training)
        return h


class HFBlock(nn.Module):
    """One decoder layer, given what the base model's forward gives it (`LayerInputs`).
    An MoE layer's router logits (the output transformers records as `router_logits`) go to
    the model's `moe.RouterAux` while it is active (the engine's step)."""

    def __init__(
        self,
        layer: nn.Module,
        inputs: LayerInputs,
        mask_kind: str,
        aux: RouterAux | None = None,
        router: tuple[type, int] | None = None,
    ):
        super().__init__()
        self.layer = layer
        self.mask_kind = mask_kind
        self.__dict__["inputs"] = inputs  # plain attribute: shared by the blocks, not a submodule
        self.__dict__["aux"] = aux
        self._captured: list[torch.Tensor] | None = None
        if aux is not None and router is not None:
            self.router_index = router[1]
            for module in layer.modules():
                if isinstance(module, router[0]):
                    module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._captured is not None:
            value = output[self.router_index] if isinstance(output, tuple) else output
            self._captured.append(value)

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        aux = self.__dict__["aux"]
        if aux is None or not aux.active:
            out = self.layer(h, **self.inputs(h, self.mask_kind, position_ids))
            return out[0] if isinstance(out, tuple) else out
        self._captured = []
        try:
            out = self.layer(h, **self.inputs(h, self.mask_kind, position_ids))
            captured = self._captured
        finally:
            self._captured = None
        return aux.after_layer(out[0] if isinstance(out, tuple) else out, captured)


class HFHead(LMHead):
    """Final norm + LM head, and what the causal-LM wrapper does to the logits."""

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        multiplier: float | None = None,
        divisor: float | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.multiplier, self.divisor, self.softcap = multiplier, divisor, softcap

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h))
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _mask_kinds(family: Family, config, num_layers: int) -> list[str]:
    if family.masks == "causal":
        return ["full_attention"] * num_layers
    if family.masks == "sliding_window":
        sliding = getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
    kinds = list(config.layer_types[:num_layers])
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise CephaloError(
            f"{family.label}: layer types {unknown} are not supported (full_attention and "
            "sliding_attention are)"
        )
    return kinds


def _split(
    hf_model: nn.Module, family: Family, name: str, aux: RouterAux | None = None
) -> tuple[list[Unit], nn.Module | None]:
    """The units of a causal LM with the common layout, and its rotary module; anything else
    in the model is an error (the adapter would silently drop it). `aux`: the MoE router
    loss the blocks report their router logits to."""
    config = hf_model.config
    base = hf_model.base_model
    children = dict(base.named_children())
    tokens = base.get_input_embeddings()
    used = {n for n, c in children.items() if c is tokens}
    lists = [n for n, c in children.items() if isinstance(c, nn.ModuleList)]
    rotary_names = [n for n, c in children.items() if type(c).__name__.endswith("RotaryEmbedding")]
    extras = {a for a in (family.position_embedding, family.embedding_dropout) if a}
    rest = [n for n in children if n not in used | set(lists) | set(rotary_names) | extras]
    lm_head = hf_model.get_output_embeddings()
    top = [n for n, c in hf_model.named_children() if c is not base and c is not lm_head]
    if len(lists) != 1 or len(rotary_names) > 1 or len(rest) != 1 or not used or top:
        raise CephaloError(
            f"model {name}: {type(hf_model).__name__} does not have the layout the adapter "
            f"knows (base model children {sorted(children)}, other modules {top}); see "
            "docs/models.md"
        )
    layers = children[lists[0]]
    if len(layers) != config.num_hidden_layers:
        raise CephaloError(
            f"model {name}: {len(layers)} layers but num_hidden_layers = {config.num_hidden_layers}"
        )
    rotary = children[rotary_names[0]] if rotary_names else None
    inputs = LayerInputs(config, rotary)

    def named(attr: str | None) -> tuple[str, nn.Module] | None:
        return None if attr is None else (attr, children[attr])

    if family.position_embedding:
        max_seq = children[family.position_embedding].num_embeddings
    else:
        max_seq = getattr(config, "max_position_embeddings", None)
    embedding = HFEmbedding(
        (next(iter(used)), tokens),
        max_seq,
        positions=named(family.position_embedding),
        dropout=named(family.embedding_dropout),
        dropout_p=float(config_value(config, family.embedding_dropout_p) or 0.0),
        multiplier=config_value(config, family.embedding_multiplier),
    )
    kinds = _mask_kinds(family, config, len(layers))
    router = router_recorder(hf_model) if aux is not None else None
    if aux is not None and router is None:
        raise CephaloError(
            f"model {name}: {type(hf_model).__name__} has experts but no router output the "
            "adapter can read (transformers' router_logits); its router loss is not supported"
        )
    units = [Unit("embedding", "embedding", embedding)]
    units += [
        Unit(f"blocks.{i}", "block", HFBlock(layer, inputs, kinds[i], aux, router))
        for i, layer in enumerate(layers)
    ]
    head = HFHead(
        children[rest[0]],
        lm_head,
        multiplier=config_value(config, family.logit_multiplier),
        divisor=config_value(config, family.logit_divisor),
        softcap=config_value(config, family.logit_softcapping),
    )
    units.append(Unit("head", "head", head))
    return units, rotary


_SAID_NO_AUX: set[str] = set()  # models whose missing router loss was logged (once each)


class HFUnitModel(UnitModel):
    """A `transformers` causal LM as units. `hf_config` rebuilds the transformers model;
    `hf_names` maps each `<unit>.<param>` to the transformers parameter names it stands for;
    `weights` (pretrained) or transformers' init scheme give the initial values."""

    supports_position_ids = True

    def __init__(
        self,
        name: str,
        hf_config,
        device: torch.device | str = "meta",
        directory: Path | None = None,
        pretrained: bool = False,
        multimodal: bool = False,
    ):
        family = family_of(hf_config)
        settings = router_settings(hf_config, f"model {name}")
        router_aux = RouterAux(settings) if settings and settings.enabled else None
        hf_model = build_hf_model(hf_config, device)
        units, rotary = _split(hf_model, family, name, router_aux)
        config = hf_model.config
        hidden = config.hidden_size
        tied = hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
        moe = _moe_shape(units, settings, config) if settings is not None else {}
        spec = spec_from_units(
            units,
            name=name,
            arch=config.model_type,
            hidden_size=hidden,
            num_heads=config.num_attention_heads,
            vocab_size=config.vocab_size,
            ffn_hidden_size=moe.pop("ffn_hidden_size", None)
            or getattr(config, "intermediate_size", None)
            or getattr(config, "n_inner", None)
            or 4 * hidden,
            tied_embeddings=tied,
            max_seq_len=units[0].module.max_seq_len or 0,
            **moe,
        )
        super().__init__(spec, units)
        self.router_aux = router_aux  # the MoE router loss (None: dense, or no aux term)
        if settings is not None and not settings.enabled and name not in _SAID_NO_AUX:
            _SAID_NO_AUX.add(name)
            log_without_aux(f"model {name}", settings)
        self.family = family
        self.hf_config = config
        self.directory = directory
        self.hf_names = _hf_name_map(hf_model, units)
        # kept as plain attributes (not submodules): the rotary module belongs to LayerInputs,
        # and the model's `_init_weights` is transformers' init scheme for any of its modules
        self.__dict__["rotary"] = rotary
        self.__dict__["_init_weights_of"] = hf_model._init_weights
        self.multimodal = None
        """The multimodal directory whose language model this is (`hf_multimodal`)."""
        if multimodal:
            from cephalo.modeling.hf.multimodal import MultimodalSource

            self.multimodal = MultimodalSource(directory)
        self.weights: PretrainedWeights | None = None
        if pretrained:
            if directory is None:
                raise CephaloError(f"model {name} has no directory to read pretrained weights from")
            shapes = {f"{u}.{n}": tuple(p.shape) for u, n, p in self.named_unit_parameters()}
            known = {n for hf_names in self.hf_names.values() for n in hf_names}
            self.weights = PretrainedWeights(
                directory,
                self.hf_names,
                shapes,
                rename=self.multimodal.renamer()
                if self.multimodal is not None
                else checkpoint_key_renamer(hf_model, known),
                ignored=list(getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []),
            )

    @torch.no_grad()
    def initial_values(
        self,
        unit_name: str,
        named_params: Sequence[tuple[str, nn.Parameter]],
        generator: torch.Generator,
    ) -> dict[str, torch.Tensor]:
        """Pretrained: the unit's tensors from the safetensors files (nothing drawn).
        Random: transformers' init of the unit's modules, seeded by one draw from `generator`.
        With LoRA adapters: the same for the base, and the adapters' own (modeling/lora.py)."""
        if self.adapter is not None:
            from cephalo.modeling.lora import adapter_initial_values

            return adapter_initial_values(
                self, unit_name, named_params, self._base_values, generator
            )
        return self._base_values(unit_name, named_params, generator)

    def _base_values(self, unit_name, named_params, generator) -> dict[str, torch.Tensor]:
        if self.weights is not None:
            return self.weights.read(unit_name, [n for n, _ in named_params])
        return self._random_values(unit_name, named_params, generator)

    def _random_values(self, unit_name, named_params, generator) -> dict[str, torch.Tensor]:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        values = {n: torch.empty(p.shape, dtype=torch.float32) for n, p in named_params}
        module = self.unit(unit_name).module
        swapped = []
        for mname, sub in module.named_modules():
            for pname, p in sub._parameters.items():
                if p is None:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                if full in values:
                    stand_in = nn.Parameter(values[full], requires_grad=False)
                else:  # borrowed from another unit (tied): that unit initialises it
                    stand_in = nn.Parameter(torch.empty(p.shape, device="meta"), False)
                    stand_in._is_hf_initialized = True
                swapped.append((sub, pname, p))
                sub._parameters[pname] = stand_in
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for sub in _children_first(module):  # transformers' `smart_apply` order
                    self._init_weights_of(sub)
        finally:
            for sub, pname, p in swapped:
                sub._parameters[pname] = p
        return values

    @torch.no_grad()
    def init_unit_weights(self, unit_name: str, generator: torch.Generator) -> None:
        owned = [(n, p) for u, n, p in self.named_unit_parameters() if u == unit_name]
        values = self.initial_values(unit_name, owned, generator)
        for n, p in owned:
            p.copy_(values[n])


def _moe_shape(units: list[Unit], settings, config) -> dict[str, int]:
    """What the cost model needs of an MoE model: the parameters a token uses per block (all
    but the routed experts, plus top-k of them: the routed experts' tensors are those under
    an `experts` module with one row per expert) and the FFN width a token's activations
    have (top-k experts + shared experts)."""
    block = units[1].module if len(units) > 2 else None
    if block is None:
        return {}
    total = routed = 0
    for pname, p in block.named_parameters():
        total += p.numel()
        parts = pname.split(".")
        if "experts" in parts[:-1] and p.dim() >= 2 and p.shape[0] == settings.num_experts:
            routed += p.numel()
    active = total - routed + routed * settings.top_k // settings.num_experts
    width = getattr(config, "moe_intermediate_size", None) or getattr(
        config, "intermediate_size", 0
    )
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    shared += (getattr(config, "n_shared_experts", None) or 0) * width
    return {
        "active_params_per_block": active,
        "num_experts": settings.num_experts,
        "experts_per_token": settings.top_k,
        "ffn_hidden_size": settings.top_k * width + shared,
    }


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """Every submodule after its children, the order transformers' `initialize_weights`
    visits them (a parent's init, e.g. GPT-2's scaled residual projections, comes last)."""
    for child in module.children():
        yield from _children_first(child)
    yield module


def checkpoint_key_renamer(hf_model: nn.Module, known: set[str]) -> Callable[[str], Any]:
    """A stored checkpoint name -> the model's parameter name, by transformers' own rules
    (`from_pretrained`'s weight renamings for the model and the legacy ones, and adding or
    removing the base-model prefix). A stored name that transformers merges into a fused
    parameter (MoE experts stored one tensor per expert: stacked, gate and up concatenated)
    becomes a `MergedPiece` (`hf_weights`), which the reader assembles one parameter at a
    time with transformers' own conversion operations. Any other conversion is an error."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from cephalo.modeling.hf.weights import MERGE_OPS, MergedPiece

    transforms = get_model_conversion_mapping(hf_model, add_legacy=True)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    present = dict.fromkeys(known, True)
    prefix = hf_model.base_model_prefix

    def rename(key: str):
        name, converted_by = rename_source_key(key, renamings, converters, prefix, present)
        if converted_by is None:
            return name
        converter = next((c for c in converters if converted_by in c.source_patterns), None)
        ops = [] if converter is None else list(converter.operations)
        if converter is None or not ops or any(type(op).__name__ not in MERGE_OPS for op in ops):
            raise CephaloError(
                f"pretrained weights: tensor {key!r} is stored in a layout transformers converts "
                f"on loading ({converted_by!r}); cephalo reads tensors as stored. Re-save the "
                'model with transformers\' save_pretrained, or set model.init = "random"'
            )
        return MergedPiece.of(key, name, converted_by, converter)

    return rename


def _hf_name_map(hf_model: nn.Module, units: list[Unit]) -> dict[str, list[str]]:
    hf_names_by_id: dict[int, list[str]] = {}
    for hf_name, p in hf_model.named_parameters(remove_duplicate=False):
        hf_names_by_id.setdefault(id(p), []).append(hf_name)
    mapping: dict[str, list[str]] = {}
    seen: set[int] = set()
    for u in units:
        for pname, p in u.module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                mapping[f"{u.name}.{pname}"] = hf_names_by_id[id(p)]
    return mapping


# ----------------------------------------------------------------------------- registry entries
def build_hf_unit_model(
    name: str, device: torch.device | str, overrides: dict[str, Any], init: str = "auto"
) -> HFUnitModel:
    """Registry entry of a preset: the tiny transformers config `name` as units (random init)."""
    if init == "pretrained":
        raise CephaloError(
            f"model {name} is a built-in config without pretrained weights: set model.init = "
            '"random" (or "auto"), or give a model directory'
        )
    return _build(name, preset_config(name, overrides), device, None, False, overrides)


def build_hf_directory_model(
    name: str,
    directory: Path,
    device: torch.device | str,
    overrides: dict[str, Any],
    init: str = "auto",
) -> HFUnitModel:
    """Registry entry of a model directory: its config.json as units; pretrained weights when
    `init` is `pretrained`, or `auto` and the directory holds weights."""
    from cephalo.modeling.hf.weights import weight_files_present

    if init not in INIT_CHOICES:
        raise CephaloError(f"model.init must be one of {', '.join(INIT_CHOICES)}, got {init!r}")
    from cephalo.modeling.hf.config import read_config_json
    from cephalo.modeling.hf.multimodal import multimodal_type

    config = directory_config(directory, overrides)
    pretrained = init == "pretrained" or (init == "auto" and bool(weight_files_present(directory)))
    multimodal = multimodal_type(read_config_json(directory)) is not None
    return _build(name, config, device, directory, pretrained, overrides, multimodal)


def _build(name, config, device, directory, pretrained, overrides, multimodal=False) -> HFUnitModel:
    settings = overrides or "of its config"
    try:
        model = HFUnitModel(
            name,
            config,
            device=device,
            directory=directory,
            pretrained=pretrained,
            multimodal=multimodal,
        )
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError, AttributeError) as e:
        # shapes the config allowed but the modules do not (e.g. heads not dividing the width)
        raise CephaloError(
            f"model {name}: cannot build it with the settings {settings}: {first_line(e)}"
        ) from None
    # a zero width or vocabulary builds empty modules torch accepts: a unit with no
    # parameters (but for the last layer's) cannot train
    empty = [u.name for u in model.units if not any(p.numel() for p in u.module.parameters())]
    if empty:
        raise CephaloError(
            f"model {name}: the settings {settings} leave unit(s) {', '.join(empty[:3])} without "
            "parameters (a size of 0?); every width, layer count and vocabulary must be >= 1"
        )
    return model


__all__ = [
    "HF_PRESETS",
    "HFUnitModel",
    "LayerInputs",
    "build_hf_directory_model",
    "build_hf_model",
    "build_hf_unit_model",
    "checkpoint_key_renamer",
]
