"""Back to transformers: a model's weights under transformers' names, as a transformers
model, or as a directory `AutoModelForCausalLM.from_pretrained` loads.

`export_hf_state_dict` maps unit parameter names back to transformers names;
`to_hf_model` loads them into a fresh transformers model (strictly), `save_hf_directory`
writes a directory `from_pretrained` loads, with the source directory's tokenizer files.
Every HF model exports (directories and presets); the built-in GPT too, as a
`GPT2LMHeadModel` (exact GELU, Conv1D weights transposed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from cephalo.errors import CephaloError
from cephalo.modeling.gpt import GPT
from cephalo.modeling.hf.config import TOKENIZER_FILES, transformers_module
from cephalo.modeling.hf.model import HFUnitModel, build_hf_model
from cephalo.modeling.units import UnitModel


def hf_config_of(model: UnitModel):
    """The `transformers` config that `export_hf_state_dict(model)` loads into: the model's
    own for HF models; for the built-in GPT, the equivalent `GPT2Config` (exact GELU)."""
    if isinstance(model, HFUnitModel):
        return model.hf_config
    if isinstance(model, GPT):
        cfg = model.config
        if not cfg.bias:
            raise CephaloError(
                f"model {model.spec.name} has no biases (bias=false): transformers' GPT-2 "
                "always has them, so it cannot be exported; train with bias=true to export"
            )
        tf = transformers_module()
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
    """transformers-named tensors for `model` (a tied tensor under each of its names),
    loadable into a model built from `hf_config_of(model)` with `load_state_dict(...,
    strict=True)`. Works for HF models and the built-in GPT (as GPT-2). `state` (names
    `<unit>.<param>`, e.g. from `Engine.full_state_dict()`) replaces the model's own values."""
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
    """A `transformers` causal LM (on the CPU, eval mode) holding `model`'s weights (or
    `state`'s), built on meta and given the tensors themselves (no second copy of the model;
    with `state=None` the model's values are cloned, so the two never share storage)."""
    hf_model = build_hf_model(hf_config_of(model), "meta")
    tensors = export_hf_state_dict(model, state)
    if state is None:
        clones: dict[int, torch.Tensor] = {}
        tensors = {k: clones.setdefault(id(t), t.clone()) for k, t in tensors.items()}
    hf_model.load_state_dict(tensors, strict=True, assign=True)
    hf_model.tie_weights()  # assign gave the tied names two Parameter objects
    return hf_model.eval()


DIRECTORY_EXTRAS = TOKENIZER_FILES + ("generation_config.json",)
"""Files of the source model directory an export copies next to its weights."""


def save_hf_directory(
    model: UnitModel, out: Path, state: dict[str, torch.Tensor] | None = None
) -> list[str]:
    """Write `model` (or `state`) as a directory `AutoModelForCausalLM.from_pretrained` loads
    (config.json + safetensors, fp32), with the tokenizer files of the model's source
    directory copied next to them. The language model of a multimodal directory is written
    back into it, the rest copied unchanged (`hf_multimodal`). Returns the names of the
    copied files."""
    out.mkdir(parents=True, exist_ok=True)
    multimodal = getattr(model, "multimodal", None)
    if multimodal is not None:  # the language model into its multimodal directory
        multimodal.save(out, export_hf_state_dict(model, state), model.spec.tied_embeddings)
    else:
        to_hf_model(model, state).save_pretrained(str(out))
    copied = []
    source = getattr(model, "directory", None)
    if source is not None and Path(source).resolve() != out.resolve():
        for name in DIRECTORY_EXTRAS:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
                copied.append(name)
    return copied


__all__ = [
    "DIRECTORY_EXTRAS",
    "export_hf_state_dict",
    "hf_config_of",
    "save_hf_directory",
    "to_hf_model",
]
