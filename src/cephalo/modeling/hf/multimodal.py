"""Multimodal checkpoints whose language model is trained (Gemma 3: `Gemma3ForConditionalGeneration`).

The directory's `config.json` describes the whole model (`text_config`, `vision_config`);
cephalo trains its language model as the family's causal LM (`Gemma3ForCausalLM` built from
`text_config`: the same modules and arithmetic as the multimodal model's language model on
text) and carries the rest (vision tower, projector) unchanged:

- reading: every stored name goes through transformers' own renamings of the multimodal
  class (legacy `language_model.model.*` names included) to its name in that model; the
  language model's names (`model.language_model.*`, `lm_head.*`) map to the causal LM's
  (`model.*`, `lm_head.*`); the others are carried, never read into a unit;
- export (`save`): config.json is the source's (with `dtype` float32, as the causal-LM
  export writes), the language model's tensors are written under the multimodal model's
  names and the carried tensors are copied byte for byte from the source files, so the
  exported directory loads with `AutoModelForImageTextToText` and differs from the input
  only in the language model's weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cephalo.errors import CephaloError

TEXT_MODEL_TYPES = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
"""Multimodal `model_type` -> (its language model's `model_type`, causal-LM class)."""
LANGUAGE_PREFIX = "model.language_model."
HEAD_PREFIX = "lm_head."


def multimodal_type(data: dict[str, Any]) -> str | None:
    """The multimodal `model_type` of a config.json whose language model cephalo trains."""
    model_type = data.get("model_type")
    if model_type in TEXT_MODEL_TYPES and isinstance(data.get("text_config"), dict):
        return model_type
    return None


def text_config(full):
    """The language model's config (the causal LM cephalo builds) from a multimodal
    directory's config (`AutoConfig`, read by `hf_config.directory_config`)."""
    text = full.get_text_config()
    _, causal = TEXT_MODEL_TYPES[full.model_type]
    text.architectures = [causal]
    text.tie_word_embeddings = bool(getattr(full, "tie_word_embeddings", True))
    # Gemma3ForConditionalGeneration's forward applies no final logit soft-capping (its
    # causal LM does, when set; released Gemma 3 configs leave it unset): train the logits
    # of the model the export will be loaded as
    if hasattr(text, "final_logit_softcapping"):
        text.final_logit_softcapping = None
    return text


class MultimodalSource:
    """The multimodal directory a language model came from: its name mapping and export."""

    def __init__(self, directory: Path):
        import transformers as tf  # present: its config was read through it

        self.directory = directory
        self.config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        with torch.device("meta"):
            full = tf.AutoModelForImageTextToText.from_config(self.config)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        self._renamings = [
            t
            for t in get_model_conversion_mapping(full, add_legacy=True)
            if isinstance(t, WeightRenaming)
        ]
        self._names = {n for n, _ in full.named_parameters(remove_duplicate=False)}
        self._prefix = full.base_model_prefix

    def full_name(self, key: str) -> str:
        """A stored key's name in the multimodal model (transformers' own renamings)."""
        from transformers.core_model_loading import rename_source_key

        present = dict.fromkeys(self._names, True)
        name, _ = rename_source_key(key, self._renamings, [], self._prefix, present)
        return name

    def renamer(self) -> Callable[[str], str | None]:
        """Stored key -> the causal LM's name, or None for a carried tensor."""

        def rename(key: str) -> str | None:
            name = self.full_name(key)
            if name.startswith(LANGUAGE_PREFIX):
                return "model." + name[len(LANGUAGE_PREFIX) :]
            if name.startswith(HEAD_PREFIX):
                return name
            return None

        return rename

    def save(self, out: Path, lm_tensors: dict[str, torch.Tensor], tied: bool) -> None:
        """Write the multimodal directory: the source's config.json (dtype float32), the
        language model's tensors (causal-LM names -> multimodal names; a tied head not
        repeated) and the carried tensors copied unchanged from the source files."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        from cephalo.modeling.hf.weights import scan_directory

        out.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, value in lm_tensors.items():
            if name.startswith(HEAD_PREFIX):
                if not tied:
                    tensors[name] = value.contiguous()
            elif name.startswith("model."):
                tensors[LANGUAGE_PREFIX + name[len("model.") :]] = value.contiguous()
            else:
                raise CephaloError(f"cannot export {name!r} into the multimodal model")
        rename = self.renamer()
        for key, stored in scan_directory(self.directory).items():
            if rename(key) is not None:
                continue
            with safe_open(str(stored.file), framework="pt", device="cpu") as f:
                tensors[self.full_name(key)] = f.get_tensor(key)
        if not tensors:
            raise CephaloError("nothing to export")
        # tensors sharing storage (none expected) would be refused by save_file: clone them
        seen: set[int] = set()
        for name, value in list(tensors.items()):
            ptr = value.untyped_storage().data_ptr()
            if ptr in seen:
                tensors[name] = value.clone()
            seen.add(ptr)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((self.directory / "config.json").read_text())
        config["dtype"] = "float32"
        config.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for extra in ("preprocessor_config.json", "processor_config.json"):
            if (self.directory / extra).is_file():
                shutil.copyfile(self.directory / extra, out / extra)


__all__ = [
    "MultimodalSource",
    "TEXT_MODEL_TYPES",
    "multimodal_type",
    "text_config",
]
