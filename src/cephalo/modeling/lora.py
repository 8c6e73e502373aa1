"""LoRA and QLoRA adapters on a Hugging Face unit model, with peft's own layers.

`apply_adapter(model, settings)` injects peft's `lora.Linear` layers (`inject_adapter_in_model`)
into the units' transformers modules, so a unit computes exactly what a `get_peft_model`
model computes: y = W x + (alpha / r) B A dropout(x) (alpha / sqrt(r) with rsLoRA), A drawn
as peft draws it (kaiming-uniform, a = sqrt(5)) and B zero, or both read from an existing
PEFT adapter directory (`model.adapter_path`, whose `adapter_config.json` sets r, alpha and
the targets). Afterwards every parameter but the adapters' has `requires_grad` False: the
engine keeps those in its frozen base (runtime/state/frozen.py) and trains only the adapters.

Targets are resolved the way peft resolves them, against transformers' module names
(`model.layers.0.self_attn.q_proj`): `all-linear` is every `nn.Linear` / GPT-2 `Conv1D` but
the output head, a list or a regex is matched by peft's own `check_target_module_exists`.
Each unit then gets the exact names of its targeted modules, relative to the unit.

QLoRA: the same adapters, and the frozen weights of every linear layer of the base but the
output head (what bitsandbytes' `load_in_4bit` quantizes) are listed in
`UnitModel.quantized_parameters`, which the engine stores in NF4 (runtime/nf4.py).

Names. A unit parameter `blocks.0.layer.self_attn.q_proj.lora_A.default.weight` is saved by
peft as `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (`peft_key`); the
frozen `...q_proj.base_layer.weight` stands for transformers' `...q_proj.weight`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cephalo.errors import CephaloError
from cephalo.modeling.nf4 import nf4_backend, quiet_torchao

ADAPTERS = ("none", "lora", "qlora")
ADAPTER_NAME = "default"
"""peft's adapter name inside the layers (`lora_A.default`); saved files leave it out."""
PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter keys put before transformers' module names."""
_LORA_MARKERS = (".lora_A.", ".lora_B.")
_SUPPORTED_CONFIG = {"bias": "none", "use_dora": False}


@dataclass
class AdapterSettings:
    """What `model.adapter` and the `model.lora_*` keys ask for (train/config.py)."""

    kind: str = "lora"
    """`lora` or `qlora`."""
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    adapter_path: str | None = None

    def validate(self) -> None:
        if self.kind not in ADAPTERS[1:]:
            raise CephaloError(
                f"model.adapter must be one of {', '.join(ADAPTERS)}, got {self.kind!r}"
            )
        if not isinstance(self.r, int) or self.r <= 0:
            raise CephaloError(f"model.lora_r must be an integer >= 1, got {self.r!r}")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha)):
            raise CephaloError(f"model.lora_alpha must be a finite number, got {self.alpha!r}")
        if not (0.0 <= self.dropout < 1.0):
            raise CephaloError(f"model.lora_dropout must be in [0, 1), got {self.dropout!r}")
        t = self.target_modules
        if not (
            (isinstance(t, str) and t)
            or (isinstance(t, list) and t and all(isinstance(x, str) and x for x in t))
        ):
            raise CephaloError(
                'model.lora_target_modules must be "all-linear", a regex, or a non-empty list '
                f"of module names, got {t!r}"
            )


@dataclass
class Adapter:
    """What `apply_adapter` did to a model (`model.adapter`): export and checkpoints read it."""

    settings: AdapterSettings
    peft_config: Any
    """The `peft.LoraConfig` of the run (target_modules: transformers' full module names)."""
    modules: dict[str, str] = field(default_factory=dict)
    """`<unit>.<module path>` of each adapted module -> transformers' module name."""
    initial: dict[str, torch.Tensor] | None = None
    """adapter_path: its tensors by `<unit>.<param>` (else None: peft's init)."""

    @property
    def kind(self) -> str:
        return self.settings.kind

    def summary(self, model) -> str:
        """The one line a run logs of its adapter: kind, rank, alpha, targets (as asked, and how
        many modules got adapters), trainable parameters and their share of the model's (each
        tied parameter counted once): what a peft user reads off `print_trainable_parameters`."""
        seen: set[int] = set()
        trainable = total = 0
        for unit in model.units:
            for p in unit.module.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                total += p.numel()
                trainable += p.numel() if p.requires_grad else 0
        cfg = self.peft_config
        targets = self.settings.target_modules
        asked = targets if isinstance(targets, str) else ",".join(targets)
        share = 100.0 * trainable / total if total else 0.0
        return (
            f"{self.kind} r={cfg.r}, alpha={cfg.lora_alpha:g} (scale {cfg.lora_alpha / cfg.r:g}), "
            f"targets {asked} ({len(self.modules)} modules): {trainable:,} trainable parameters "
            f"({share:.2f}% of {total:,})"
        )

    def peft_key(self, name: str) -> str:
        """peft's saved key of the adapter parameter `<unit>.<param>`."""
        for marker in _LORA_MARKERS:
            if marker in name:
                module, rest = name.split(marker, 1)
                param = rest.split(".", 1)[1]  # drop the adapter name
                return f"{PEFT_PREFIX}{self.modules[module]}{marker}{param}"
        raise CephaloError(f"{name} is not an adapter parameter")


def adapter_settings(model_config) -> AdapterSettings:
    """The settings of a job config's `[model]` section (train/config.py `ModelConfig`)."""
    targets = list(model_config.lora_target_modules)
    return AdapterSettings(
        kind=model_config.adapter,
        r=model_config.lora_r,
        alpha=model_config.lora_alpha,
        dropout=model_config.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        adapter_path=model_config.adapter_path,
    )


def is_adapter_parameter(name: str) -> bool:
    return any(m in name for m in _LORA_MARKERS)


def base_name(name: str) -> str:
    """The unwrapped module's parameter name of a frozen parameter (`.base_layer.` removed)."""
    return name.replace(".base_layer.", ".")


def peft_module() -> Any:
    try:
        with quiet_torchao():  # peft imports torchao when it is installed
            import peft
    except ImportError:
        raise CephaloError(
            "model.adapter = lora/qlora needs peft: pip install 'cephalo[lora]'"
        ) from None
    return peft


def _linear_classes() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _linear_modules(model) -> dict[str, tuple[str, str]]:
    """transformers' name of every linear module in the units -> (unit name, path in unit)."""
    out: dict[str, tuple[str, str]] = {}
    for unit in model.units:
        for path, module in unit.module.named_modules():
            if path and isinstance(module, _linear_classes()):
                hf = model.hf_names.get(f"{unit.name}.{path}.weight")
                if hf:
                    out[hf[-1].removesuffix(".weight")] = (unit.name, path)
    return out


def _output_head_name(model) -> str:
    """transformers' name of the output head (never a target of `all-linear`, never NF4)."""
    names = model.hf_names.get(f"{model.units[-1].name}.lm_head.weight")
    return names[-1].removesuffix(".weight") if names else ""


def _read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    directory = Path(path)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise CephaloError(
            f"model.adapter_path {path}: no adapter_config.json there (a PEFT adapter directory, "
            "as PeftModel.save_pretrained writes it, is expected)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CephaloError(
            f"model.adapter_path {path}: cannot read adapter_config.json: {e}"
        ) from None
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise CephaloError(f"model.adapter_path {path}: no adapter_model.safetensors there")
    from safetensors.torch import load_file

    return config, load_file(str(weights))


def _peft_config(settings: AdapterSettings, stored: dict | None) -> Any:
    """The run's `LoraConfig`: the settings, or an adapter directory's own config."""
    peft = peft_module()
    if stored is None:
        return peft.LoraConfig(
            r=settings.r,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=settings.target_modules,
            bias="none",
        )
    where = f"model.adapter_path {settings.adapter_path}"
    if stored.get("peft_type", "LORA") != "LORA":
        raise CephaloError(f"{where}: a {stored.get('peft_type')} adapter; only LoRA is supported")
    for key, want in _SUPPORTED_CONFIG.items():
        if stored.get(key, want) not in (want, None):
            raise CephaloError(f"{where}: {key} = {stored[key]!r} is not supported ({want!r} is)")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters"):
        if stored.get(key):
            raise CephaloError(f"{where}: {key} is not supported (it is {stored[key]!r})")
    known = set(peft.LoraConfig.__dataclass_fields__)
    config = peft.LoraConfig(**{k: v for k, v in stored.items() if k in known})
    settings.r, settings.alpha = int(config.r), float(config.lora_alpha)
    settings.dropout = float(config.lora_dropout)
    return config


def apply_adapter(model, settings: AdapterSettings) -> Adapter:
    """Inject peft's LoRA layers into `model`'s units (built on meta), freeze the rest, and
    record the adapter on `model.adapter` (see the module docstring)."""
    settings.validate()
    if getattr(model, "hf_names", None) is None:  # (an HFUnitModel; hf.py imports this module)
        raise CephaloError(
            f"model.adapter = {settings.kind} needs a transformers model (a model directory or "
            "an hf-* preset); the built-in GPT trains fully"
        )
    if any(not p.is_meta for p in model.parameters()):
        raise CephaloError("apply_adapter needs a model built on the meta device")
    stored, tensors = (None, None)
    if settings.adapter_path:
        stored, tensors = _read_adapter_dir(settings.adapter_path)
    if settings.kind == "qlora":
        nf4_backend()  # the extra's message now, not at the engine
    peft = peft_module()
    from peft.tuners.tuners_utils import check_target_module_exists

    config = _peft_config(settings, stored)
    linear = _linear_modules(model)
    head = _output_head_name(model)
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        chosen = [n for n in linear if n != head]
    else:
        chosen = [n for n in linear if check_target_module_exists(config, n)]
        if settings.adapter_path and not chosen:
            # a saved config's targets may be full names of another model: the tensors say
            chosen = [n for n in linear if f"{PEFT_PREFIX}{n}.lora_A.weight" in (tensors or {})]
    names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    asked = config.target_modules
    asked = asked if isinstance(asked, str) else sorted(asked)
    if not chosen and settings.adapter_path:
        raise CephaloError(
            f"model.adapter_path {settings.adapter_path} was made for another base: its target "
            f"modules {asked!r} match no linear layer of model "
            f"{model.spec.name} (whose linear layers are: {', '.join(names)})"
        )
    if not chosen:
        raise CephaloError(
            f"model.lora_target_modules {asked!r} matches no linear layer of "
            f"model {model.spec.name}; its linear layers are: {', '.join(names)} (or "
            '"all-linear")'
        )
    _check_untied(model, [linear[n] for n in chosen])
    from transformers.pytorch_utils import Conv1D

    modules = [model.unit(linear[n][0]).module.get_submodule(linear[n][1]) for n in chosen]
    if all(isinstance(m, Conv1D) for m in modules):
        config.fan_in_fan_out = True  # GPT-2's [in, out] weights: what peft sets, with a warning
    by_unit: dict[str, list[str]] = {}
    for n in chosen:
        unit_name, path = linear[n]
        by_unit.setdefault(unit_name, []).append(path)
    adapter = Adapter(settings, _saved_config(config, chosen, model), {})
    for unit in model.units:
        paths = by_unit.get(unit.name)
        if not paths:
            continue
        unit_config = _saved_config(config, paths, model)
        unit_config.inference_mode = False
        with quiet_torchao():  # peft's layer dispatch imports torchao when it is installed
            peft.inject_adapter_in_model(
                unit_config, unit.module, ADAPTER_NAME, low_cpu_mem_usage=True
            )
        for path in paths:
            hf_name = next(n for n in chosen if linear[n] == (unit.name, path))
            adapter.modules[f"{unit.name}.{path}"] = hf_name
    for _, name, p in model.named_unit_parameters():
        p.requires_grad_(is_adapter_parameter(name))
    _to_meta(model)
    if tensors is not None:
        adapter.initial = _adapter_tensors(model, adapter, tensors)
    if settings.kind == "qlora":
        model.quantized_parameters = frozenset(_quantizable(model, head))
    model.adapter = adapter
    return adapter


def _check_untied(model, targets: Sequence[tuple[str, str]]) -> None:
    seen: dict[int, int] = {}
    for u in model.units:
        for p in u.module.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    for unit_name, path in targets:
        module = model.unit(unit_name).module.get_submodule(path)
        if seen.get(id(module.weight), 0) > 1:
            raise CephaloError(
                f"{unit_name}.{path}: its weight is tied to another unit's; a tied weight cannot "
                "take a LoRA adapter here (leave it out of model.lora_target_modules)"
            )


def _saved_config(config, targets: Sequence[str], model) -> Any:
    """A copy of `config` whose targets are exactly `targets` (module names)."""
    import copy

    out = copy.deepcopy(config)
    out.target_modules = set(targets)
    out.layers_to_transform = None
    out.layers_pattern = None
    out.exclude_modules = None
    if model.directory is not None:
        out.base_model_name_or_path = str(model.directory)
    return out


def _to_meta(model) -> None:
    """peft may create adapter weights off meta: put every parameter on meta (the engine
    materialises them through `initial_values`)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(p, device="meta"), p.requires_grad
                )


def _quantizable(model, head: str) -> list[str]:
    """Frozen linear weights stored in NF4: every linear layer's but the output head's."""
    out = []
    for unit in model.units:
        for path, module in unit.module.named_modules():
            if not isinstance(module, _linear_classes()):
                continue
            # (a tied output head's weight is the embedding's: no name here, not quantized)
            hf = model.hf_names.get(f"{unit.name}.{path.removesuffix('.base_layer')}.weight")
            if not hf or hf[-1].removesuffix(".weight") == head or module.weight.requires_grad:
                continue
            out.append(f"{unit.name}.{path}.weight")
    return out


def _adapter_tensors(model, adapter: Adapter, tensors: dict[str, torch.Tensor]) -> dict:
    """adapter_path's tensors by `<unit>.<param>`, checked against the model's adapters."""
    where = f"model.adapter_path {adapter.settings.adapter_path}"
    out: dict[str, torch.Tensor] = {}
    for unit, name, p in model.named_unit_parameters():
        if not is_adapter_parameter(name):
            continue
        key = adapter.peft_key(f"{unit}.{name}")
        t = tensors.get(key)
        if t is None:
            raise CephaloError(
                f"{where} was made for another base: it has no {key} (its targets are not this "
                "model's modules)"
            )
        if tuple(t.shape) != tuple(p.shape):
            raise CephaloError(
                f"{where} was made for another base: {key} is {tuple(t.shape)}, this model needs "
                f"{tuple(p.shape)}"
            )
        out[f"{unit}.{name}"] = t.float()
    extra = set(tensors) - {adapter.peft_key(n) for n in out}
    if extra:
        raise CephaloError(
            f"{where} was made for another base: {len(extra)} of its tensors match no module "
            f"here (e.g. {sorted(extra)[0]})"
        )
    return out


@contextlib.contextmanager
def unwrapped(module: nn.Module) -> Iterator[None]:
    """Inside: each peft LoRA layer of `module` replaced by its base layer (transformers'
    module as built), so transformers' init sees the unwrapped model."""
    from peft.tuners.lora import LoraLayer

    swaps = []
    for path, sub in list(module.named_modules()):
        if isinstance(sub, LoraLayer):
            parent_path, _, attr = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            swaps.append((parent, attr, sub))
    for parent, attr, sub in swaps:
        parent._modules[attr] = sub.get_base_layer()
    try:
        yield
    finally:
        for parent, attr, sub in swaps:
            parent._modules[attr] = sub


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """Inside: every peft LoRA layer of `module` computes its base layer alone (peft's
    `disable_adapter()`, without its `requires_grad` changes): the frozen base, the DPO
    reference under LoRA (preference/objective.py), with no second model in memory."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m._disable_adapters = was


@torch.no_grad()
def adapter_initial_values(
    model,
    unit_name: str,
    named_params: Sequence[tuple[str, nn.Parameter]],
    base_values,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Initial values of one wrapped unit: the base's from `base_values(unit, named, gen)`
    on the unwrapped unit (its pretrained tensors or transformers' init, as without
    adapters), the adapters' from adapter_path or peft's init (A kaiming-uniform with
    a = sqrt(5), B zero), seeded by one draw from `generator` per unit."""
    adapter: Adapter = model.adapter
    frozen = [(n, p) for n, p in named_params if not is_adapter_parameter(n)]
    trained = [(n, p) for n, p in named_params if is_adapter_parameter(n)]
    module = model.unit(unit_name).module
    with unwrapped(module):
        values = base_values(unit_name, [(base_name(n), p) for n, p in frozen], generator)
    out = {n: values[base_name(n)] for n, _ in frozen}
    if not trained:
        return out
    if adapter.initial is not None:
        for n, _ in trained:
            out[n] = adapter.initial[f"{unit_name}.{n}"].clone()
        return out
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    draw = torch.Generator().manual_seed(seed)
    for n, p in trained:  # named_unit_parameters order: lora_A before lora_B of a module
        value = torch.empty(p.shape, dtype=torch.float32)
        if ".lora_A." in n:
            # peft's init: nn.init.kaiming_uniform_(A, a=sqrt(5)), drawn from our generator
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=draw)
        else:
            value.zero_()
        out[n] = value
    return out


# ----------------------------------------------------------------------------- export
def save_peft_directory(model, out: Path, adapters: dict[str, torch.Tensor]) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` (peft's names and format)
    that `PeftModel.from_pretrained(base, out)` loads; `adapters`: fp32 by `<unit>.<param>`
    (`Engine.full_state_dict()` of a LoRA run)."""
    from safetensors.torch import save_file

    adapter: Adapter = model.adapter
    out.mkdir(parents=True, exist_ok=True)
    adapter.peft_config.save_pretrained(str(out))
    tensors = {adapter.peft_key(k): v.detach().contiguous() for k, v in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def merged_state(
    model, adapters: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base with the adapters merged in, by the unwrapped `<unit>.<param>` names
    (`hf_export` reads these): W + scaling * B A for each adapted layer, with peft's layer's
    own scaling and fan-in/fan-out convention (`frozen`: the base, QLoRA's dequantized)."""
    from peft.tuners.lora import LoraLayer

    out = {base_name(k): v.clone() for k, v in frozen.items()}
    for unit in model.units:
        for path, layer in unit.module.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            prefix = f"{unit.name}.{path}"
            a = adapters[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"]
            b = adapters[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"]
            delta = (b @ a) * layer.scaling[ADAPTER_NAME]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.t()
            out[f"{prefix}.weight"] += delta
    return out
