"""`transformers` GPT-2 and Llama as units (the optional `hf` extra).

The HF model is built from a config (never downloaded) on the requested device and split
into units that wrap its own submodules, so the arithmetic is exactly HF's:

    GPT-2  embedding = wte + wpe + drop        blocks = GPT2Block         head = ln_f + lm_head
    Llama  embedding = embed_tokens            blocks = LlamaDecoderLayer head = norm + lm_head

Units only pass hidden states, so each block builds what its layer needs from the sequence
length: attention uses SDPA with no mask (HF then runs it with `is_causal=True`), and the
Llama blocks compute rotary (cos, sin) from one shared `RotaryTable`, which is NOT a module
(its tables are plain CPU tensors, cached per device/dtype/length): the units therefore hold
no buffers at all, and a meta build needs nothing but parameters materialised.

`export_hf_state_dict` maps unit parameter names back to HF names, so trained weights load
into a fresh `transformers` model with `load_state_dict(strict=True)`; `to_hf_model` does it.
The built-in GPT exports too, as a `GPT2LMHeadModel` (exact GELU, Conv1D weights transposed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cephalo.errors import CephaloError
from cephalo.modeling.gpt import GPT, MAX_LAYERS
from cephalo.modeling.units import (
    LMHead,
    Unit,
    UnitModel,
    fill_normal_,
    spec_from_units,
)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CephaloError(
            "the hf-* models need the `transformers` package: pip install 'cephalo[hf]'"
        ) from exc
    return transformers


@dataclass(frozen=True)
class HFPreset:
    """A named `transformers` model: its family and the config fields we set."""

    family: str
    """`gpt2` or `llama`."""
    config: dict[str, Any]
    """Keyword arguments for `GPT2Config` / `LlamaConfig`."""


HF_PRESETS: dict[str, HFPreset] = {
    "hf-gpt2-tiny": HFPreset(
        "gpt2",
        dict(
            vocab_size=256,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "hf-llama-tiny": HFPreset(
        "llama",
        # 4 query heads over 2 key/value heads: exercises grouped-query attention.
        dict(
            vocab_size=256,
            max_position_embeddings=32,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "hf-gpt2-124m": HFPreset(
        "gpt2",
        dict(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "hf-llama-160m": HFPreset(
        "llama",
        dict(
            vocab_size=32000,
            max_position_embeddings=1024,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            tie_word_embeddings=False,
        ),
    ),
}

# Generic override names -> the config fields they set, per family.
_GENERIC_FIELDS = {
    "gpt2": {
        "seq_len": ("n_positions",),
        "dropout": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        "tie_embeddings": ("tie_word_embeddings",),
    },
    "llama": {
        "seq_len": ("max_position_embeddings",),
        "dropout": ("attention_dropout",),
        "tie_embeddings": ("tie_word_embeddings",),
    },
}


def make_hf_config(name: str, overrides: dict[str, Any]):
    """The `transformers` config of preset `name` with `overrides` applied (HF field names or
    the generic `seq_len`, `dropout`, `tie_embeddings`, `vocab_size`)."""
    tf = _transformers()
    preset = HF_PRESETS[name]
    kwargs = dict(preset.config)
    config_cls = tf.GPT2Config if preset.family == "gpt2" else tf.LlamaConfig
    known = set(config_cls().to_dict())
    _check_generic_settings(name, overrides)
    for key, value in overrides.items():
        targets = _GENERIC_FIELDS[preset.family].get(key, (key,))
        for target in targets:
            if target not in known:
                raise CephaloError(
                    f"model {name}: unknown setting {key!r}; use seq_len, dropout, tie_embeddings "
                    f"or a {config_cls.__name__} field"
                )
            kwargs[target] = value
    # Special tokens are irrelevant to training; GPT-2's defaults (50256) fall outside tiny vocabularies.
    kwargs.setdefault("bos_token_id", None)
    kwargs.setdefault("eos_token_id", None)
    try:
        return config_cls(**kwargs, attn_implementation="sdpa")
    except Exception as e:  # transformers' own validation (types, ranges): say which settings
        raise CephaloError(
            f"model {name}: transformers rejects the settings {overrides}: {_first_line(e)}"
        ) from None


def _check_generic_settings(name: str, overrides: dict[str, Any]) -> None:
    """Types and ranges of the settings every model family shares (transformers accepts some
    bad ones, e.g. dropout 2.0, and fails only when training starts)."""
    for key in ("seq_len", "vocab_size"):
        value = overrides.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise CephaloError(f"model {name}: {key} must be an integer >= 1, got {value!r}")
    for key in ("n_layer", "num_hidden_layers"):
        value = overrides.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LAYERS
        ):
            raise CephaloError(
                f"model {name}: {key} must be an integer from 1 to {MAX_LAYERS}, got {value!r}"
            )
    if "dropout" in overrides:
        value = overrides["dropout"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
            raise CephaloError(f"model {name}: dropout must be a number in [0, 1), got {value!r}")
    if "tie_embeddings" in overrides and not isinstance(overrides["tie_embeddings"], bool):
        raise CephaloError(
            f"model {name}: tie_embeddings must be true or false, got {overrides['tie_embeddings']!r}"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class HFGPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _check_seq_len(input_ids.shape[1], self.wpe.num_embeddings)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class HFGPT2Block(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # No mask + SDPA: HF passes is_causal=True to scaled_dot_product_attention.
        return self.layer(h, attention_mask=None, use_cache=False)


class HFLlamaEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding, max_seq_len: int):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.max_seq_len = max_seq_len

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _check_seq_len(input_ids.shape[1], self.max_seq_len)
        return self.embed_tokens(input_ids)


class RotaryTable:
    """Rotary (cos, sin) for positions 0..s-1, computed by HF's own `LlamaRotaryEmbedding`
    on the CPU once per length and cached per (device, dtype, length). A plain object, not a
    module: no buffers to materialise after a meta build, nothing for the engine to shard."""

    def __init__(self, config):
        tf = _transformers()
        with torch.device("cpu"):
            self.rotary = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        self.cache: dict[
            tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]
        ] = {}

    def __call__(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        key = (device, dtype, seq_len)
        if key not in self.cache:
            positions = torch.arange(seq_len).unsqueeze(0)
            cos, sin = self.rotary(torch.empty(0, dtype=torch.float32), positions)
            self.cache[key] = (
                cos.to(device=device, dtype=dtype),
                sin.to(device=device, dtype=dtype),
            )
        return self.cache[key]


class HFLlamaBlock(nn.Module):
    def __init__(self, layer: nn.Module, rotary: RotaryTable):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # plain attribute: shared by all blocks, not a submodule

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        position_embeddings = self.rotary(h.shape[1], h.device, h.dtype)
        return self.layer(
            h, attention_mask=None, position_embeddings=position_embeddings, use_cache=False
        )


class HFHead(LMHead):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def _check_seq_len(seq: int, limit: int) -> None:
    if seq > limit:
        raise CephaloError(
            f"sequence length {seq} exceeds the model's maximum {limit}; shorten the data's "
            "sequences or build the model with a larger seq_len"
        )


class HFUnitModel(UnitModel):
    """A `transformers` causal LM as units. `hf_config` rebuilds the HF model;
    `hf_names` maps each `<unit>.<param>` to the HF parameter names it stands for."""

    def __init__(self, name: str, family: str, hf_config, device: torch.device | str = "meta"):
        tf = _transformers()
        self.family = family
        self.hf_config = hf_config
        # fork_rng: HF's own init runs on a non-meta build; keep the global RNG (dropout's
        # source) untouched by construction.
        with torch.random.fork_rng(devices=[]), torch.device(device):
            if family == "gpt2":
                hf_model = tf.GPT2LMHeadModel(hf_config)
            else:
                hf_model = tf.LlamaForCausalLM(hf_config)
        if family == "gpt2":
            body = hf_model.transformer
            units = [Unit("embedding", "embedding", HFGPT2Embedding(body.wte, body.wpe, body.drop))]
            units += [
                Unit(f"blocks.{i}", "block", HFGPT2Block(layer)) for i, layer in enumerate(body.h)
            ]
            units.append(Unit("head", "head", HFHead(body.ln_f, hf_model.lm_head)))
            hidden, heads = hf_config.n_embd, hf_config.n_head
            ffn = hf_config.n_inner or 4 * hidden
            seq = hf_config.n_positions
        else:
            body = hf_model.model
            rotary = RotaryTable(hf_config)
            seq = hf_config.max_position_embeddings
            units = [Unit("embedding", "embedding", HFLlamaEmbedding(body.embed_tokens, seq))]
            units += [
                Unit(f"blocks.{i}", "block", HFLlamaBlock(layer, rotary))
                for i, layer in enumerate(body.layers)
            ]
            units.append(Unit("head", "head", HFHead(body.norm, hf_model.lm_head)))
            hidden, heads, ffn = (
                hf_config.hidden_size,
                hf_config.num_attention_heads,
                hf_config.intermediate_size,
            )
        tied = hf_model.lm_head.weight is hf_model.get_input_embeddings().weight
        spec = spec_from_units(
            units,
            name=name,
            arch="gpt" if family == "gpt2" else "llama",
            hidden_size=hidden,
            num_heads=heads,
            vocab_size=hf_config.vocab_size,
            ffn_hidden_size=ffn,
            tied_embeddings=tied,
            max_seq_len=seq,
        )
        super().__init__(spec, units)
        self.hf_names = _hf_name_map(hf_model, units)
        # Norm scales and embedding padding rows are recognised by module type, found once here
        # and kept by name (parameter identities change on `to_empty`).
        self._norm_params_by_name = {
            (u.name, f"{mname}.{pname}" if mname else pname)
            for u in units
            for mname, module in u.module.named_modules()
            if isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")
            for pname, _ in module.named_parameters(recurse=False)
        }
        self._padding_rows: dict[str, dict[str, int]] = {}
        for u in units:
            for mname, module in u.module.named_modules():
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    self._padding_rows.setdefault(u.name, {})[
                        f"{mname}.weight" if mname else "weight"
                    ] = module.padding_idx
        unexpected = [n for n, _ in self.named_buffers()]
        if unexpected:  # a transformers version that adds buffers to layers would need init here
            raise CephaloError(
                f"{name}: unit modules hold buffers {unexpected}; cephalo cannot initialise them"
            )

    def init_parameter(
        self, unit_name: str, param_name: str, param: nn.Parameter, generator: torch.Generator
    ) -> None:
        """HF's scheme, drawn from `generator` on the CPU: N(0, initializer_range) for
        matrices and embeddings (GPT-2's residual projections c_proj scaled by
        1/sqrt(2 n_layer)), zero biases, unit norm scales, zero padding rows."""
        std = self.hf_config.initializer_range
        if (unit_name, param_name) in self._norm_params_by_name:
            param.fill_(1.0 if param_name.endswith("weight") else 0.0)
        elif param_name.endswith("bias"):
            param.zero_()
        elif self.family == "gpt2" and param_name.endswith("c_proj.weight"):
            fill_normal_(param, std / math.sqrt(2 * self.spec.num_layers), generator)
        else:
            fill_normal_(param, std, generator)
            if param_name in self._padding_rows.get(unit_name, {}):
                param[self._padding_rows[unit_name][param_name]].zero_()


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


def hf_config_of(model: UnitModel):
    """The `transformers` config that `export_hf_state_dict(model)` loads into: the model's
    own for hf-* models; for the built-in GPT, the equivalent `GPT2Config` (exact GELU)."""
    if isinstance(model, HFUnitModel):
        return model.hf_config
    if isinstance(model, GPT):
        cfg = model.config
        if not cfg.bias:
            raise CephaloError(
                f"model {model.spec.name} has no biases (bias=false): transformers' GPT-2 "
                "always has them, so it cannot be exported; train with bias=true to export"
            )
        tf = _transformers()
        return tf.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.seq_len,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            activation_function="gelu",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            attn_implementation="sdpa",
        )
    raise CephaloError(f"model {model.spec.name} has no transformers equivalent to export to")


# Built-in GPT parameters stored by transformers' GPT-2 as Conv1D ([in, out]: transposed).
_CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


def _gpt_hf_names(model: GPT) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for unit, pname, _ in model.named_unit_parameters():
        ours = f"{unit}.{pname}"
        if unit == "embedding":
            names[ours] = [f"transformer.{pname}"]
            if pname == "wte.weight" and model.config.tie_embeddings:
                names[ours].append("lm_head.weight")
        elif unit == "head":
            names[ours] = [pname if pname.startswith("lm_head") else f"transformer.{pname}"]
        else:
            names[ours] = [f"transformer.h.{unit.split('.')[1]}.{pname}"]
    return names


def export_hf_state_dict(
    model: UnitModel, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """HF-named tensors for `model` (a tied tensor under each of its HF names), loadable into
    a model built from `hf_config_of(model)` with `load_state_dict(..., strict=True)`. Works
    for hf-* models and the built-in GPT (as GPT-2). `state` (names `<unit>.<param>`, e.g.
    from `Engine.full_state_dict()`) replaces the model's own values when given."""
    if isinstance(model, HFUnitModel):
        names, transpose = model.hf_names, ()
    elif isinstance(model, GPT):
        hf_config_of(model)  # fails early for configurations GPT-2 cannot express
        names, transpose = _gpt_hf_names(model), _CONV1D_SUFFIXES
    else:
        raise CephaloError(f"model {model.spec.name} has no transformers equivalent to export to")
    if state is None:
        state = {f"{u}.{n}": p.detach() for u, n, p in model.named_unit_parameters()}
    missing = sorted(set(names) - set(state))
    if missing:
        raise CephaloError(f"cannot export {model.spec.name}: missing tensors {missing[:5]}")
    out = {}
    for ours, hf_names in names.items():
        tensor = (
            state[ours].t().contiguous() if ours.endswith(transpose) and transpose else state[ours]
        )
        for hf_name in hf_names:
            out[hf_name] = tensor
    return out


def to_hf_model(model: UnitModel, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A `transformers` causal LM (on the CPU) holding `model`'s weights (or `state`'s):
    `to_hf_model(model).save_pretrained(path)` gives a checkpoint `transformers` loads."""
    tf = _transformers()
    config = hf_config_of(model)
    cls = tf.LlamaForCausalLM if isinstance(config, tf.LlamaConfig) else tf.GPT2LMHeadModel
    # Built on the CPU (not meta + assign) so that load_state_dict copies into HF's own,
    # already tied, parameters; fork_rng keeps HF's init draws off the global RNG.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        hf_model = cls(config)
    hf_model.load_state_dict(export_hf_state_dict(model, state), strict=True)
    return hf_model.eval()


def build_hf_unit_model(
    name: str, device: torch.device | str, overrides: dict[str, Any]
) -> HFUnitModel:
    """Registry entry: the `transformers` preset `name` as units."""
    preset = HF_PRESETS[name]
    config = make_hf_config(name, overrides)
    try:
        return HFUnitModel(name, preset.family, config, device=device)
    except (
        ValueError,
        TypeError,
        ZeroDivisionError,
        RuntimeError,
    ) as e:  # shapes the config allowed
        raise CephaloError(
            f"model {name}: cannot build it with the settings {overrides}: {_first_line(e)}"
        ) from None


__all__ = [
    "HF_PRESETS",
    "HFUnitModel",
    "build_hf_unit_model",
    "export_hf_state_dict",
    "hf_config_of",
    "make_hf_config",
    "to_hf_model",
]
