"""Pretrained weights of a `transformers` model directory, read one unit at a time.

The directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
(what `save_pretrained` writes). `PretrainedWeights` reads only the files' headers when it
is made (names, shapes, dtypes: no tensor data) and checks them against the model the
config describes, so a mismatch is one clear error before any training: a missing tensor,
an unexpected one, a wrong shape, a non-float dtype, or a file that is not valid
safetensors, each named with its file. `read(unit_params)` then loads just the tensors of
one unit through `safetensors.safe_open` (memory-mapped: a tensor's bytes are read when it
is taken), upcasting bf16/fp16 to fp32, so a process holds at most one unit of pretrained
values at a time, whatever the model's size. A tensor holding NaN or infinity is reported as
damaged.

Stored names are mapped to the model's parameter names by transformers' own checkpoint
renamings (legacy names such as GPT-NeoX's `embed_out`, a bare base-model checkpoint without
the `model.` / `transformer.` prefix: `hf.checkpoint_key_renamer`), and the names
transformers itself ignores when loading (old rotary `inv_freq`, `position_ids`, GPT-2's
causal-mask `attn.bias` buffers) are skipped, as `from_pretrained` skips them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cephalo.errors import CephaloError, first_line

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
OTHER_WEIGHT_FILES = (
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# transformers' own skip list for every model (modeling_utils: `_adjust_missing_and_unexpected_keys`)
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def weight_files_present(directory: Path) -> list[str]:
    """Names of the weight files in `directory` (safetensors or other formats)."""
    names = (SAFETENSORS_INDEX, SAFETENSORS_FILE, *OTHER_WEIGHT_FILES)
    return [n for n in names if (directory / n).is_file()]


def has_safetensors(directory: Path) -> bool:
    return (directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS_FILE).is_file()


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, its name in the file, its header shape and dtype."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str


MERGE_OPS = ("MergeModulelist", "Concatenate")
"""transformers' conversion operations the reader applies itself: stacking one tensor per
expert and concatenating gate and up projections (what MoE checkpoints need)."""


@dataclass(frozen=True)
class MergedPiece:
    """A stored tensor that is one piece of a fused parameter (one expert's projection):
    the parameter's name, the converter's source pattern it matched, and its expert index."""

    key: str
    target: str
    pattern: str
    index: int
    patterns: tuple[str, ...]
    ops: tuple[Any, ...] = field(compare=False)

    @classmethod
    def of(cls, key: str, target: str, pattern: str, converter: Any) -> MergedPiece:
        regex = re.escape(pattern).replace(r"\*", r"(\d+)")
        found = re.search(regex, key)
        if found is None or not found.groups():
            raise CephaloError(
                f"pretrained weights: cannot tell which expert tensor {key!r} is ({pattern!r})"
            )
        return cls(
            key,
            target,
            pattern,
            int(found.group(1)),
            tuple(converter.source_patterns),
            tuple(converter.operations),
        )


@dataclass(frozen=True)
class MergedTensor:
    """A fused parameter assembled from its stored pieces (pattern -> pieces by expert)."""

    pieces: dict[str, list[StoredTensor]]
    ops: tuple[Any, ...]
    patterns: tuple[str, ...]

    @property
    def key(self) -> str:
        return next(iter(self.pieces.values()))[0].key

    @property
    def file(self) -> Path:
        return next(iter(self.pieces.values()))[0].file

    def stored(self) -> list[StoredTensor]:
        return [t for pieces in self.pieces.values() for t in pieces]

    def assemble(self, tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """transformers' own operations (stack per pattern, then concatenate)."""
        value: Any = dict(tensors)
        for op in self.ops:
            value = op.convert(value, list(self.patterns), ["_target"])
        if not isinstance(value, dict) or len(value) != 1:
            raise CephaloError("pretrained weights: an expert conversion gave no single tensor")
        return next(iter(value.values()))

    @property
    def shape(self) -> tuple[int, ...]:
        meta = {
            p: [torch.empty(t.shape, device="meta") for t in pieces]
            for p, pieces in self.pieces.items()
        }
        return tuple(self.assemble(meta).shape)

    @property
    def dtype(self) -> str:
        bad = [t.dtype for t in self.stored() if t.dtype not in FLOAT_DTYPES]
        return bad[0] if bad else self.stored()[0].dtype


def _merged_tensor(directory: Path, target: str, pieces: list[MergedPiece], stored) -> MergedTensor:
    first = pieces[0]
    by_pattern: dict[str, dict[int, StoredTensor]] = {p: {} for p in first.patterns}
    for piece in pieces:
        by_pattern[piece.pattern][piece.index] = stored[piece.key]
    counts = {len(v) for v in by_pattern.values()}
    for pattern, found in by_pattern.items():
        if sorted(found) != list(range(len(found))) or counts != {len(found)} or not found:
            raise CephaloError(
                f"pretrained weights in {directory}: the expert tensors of {target!r} are "
                f"incomplete ({pattern!r}: experts {sorted(found)}); copy the whole model "
                "directory again"
            )
    return MergedTensor(
        {p: [found[i] for i in sorted(found)] for p, found in by_pattern.items()},
        first.ops,
        first.patterns,
    )


def _safetensors_error() -> type[Exception]:
    from safetensors import SafetensorError

    return SafetensorError


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} from a safetensors file's header (no tensor data is read)."""
    from safetensors import safe_open

    if not file.is_file():
        raise CephaloError(
            f"pretrained weights: {file} is missing (the index lists it); copy the whole model "
            "directory again"
        )
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out = {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(key)
                out[key] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
            return out
    except (_safetensors_error(), OSError, ValueError) as e:
        raise CephaloError(
            f"pretrained weights: cannot read {file}: {first_line(e)}. The file is damaged or not "
            'safetensors; copy or save it again (or set model.init = "random")'
        ) from None


def scan_directory(directory: Path) -> dict[str, StoredTensor]:
    """Every stored tensor by its name in the checkpoint (from the index or the single file)."""
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CephaloError(
                f"pretrained weights: {index_path} is damaged ({first_line(e)}); it must map "
                'every tensor name to its shard file: {"weight_map": {"name": "file"}}'
            ) from None
        headers = {name: _header(directory / name) for name in sorted(set(weight_map.values()))}
        tensors = {}
        for key, name in weight_map.items():
            header = headers[name]
            if key not in header:
                raise CephaloError(
                    f"pretrained weights: {index_path} puts tensor {key!r} in {directory / name}, "
                    "which does not hold it; the index and the shards do not belong together"
                )
            shape, dtype = header[key]
            tensors[key] = StoredTensor(directory / name, key, shape, dtype)
        return tensors
    file = directory / SAFETENSORS_FILE
    if file.is_file():
        return {
            key: StoredTensor(file, key, shape, dtype)
            for key, (shape, dtype) in _header(file).items()
        }
    others = [n for n in OTHER_WEIGHT_FILES if (directory / n).is_file()]
    if others:
        raise CephaloError(
            f"pretrained weights: {directory} holds {', '.join(others)}, and cephalo reads "
            "safetensors only. Convert once with transformers (AutoModelForCausalLM.from_pretrained"
            '(DIR).save_pretrained(DIR2, safe_serialization=True)), or set model.init = "random"'
        )
    raise CephaloError(
        f"pretrained weights: {directory} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}; "
        'set model.init = "random" to train from a random start'
    )


class PretrainedWeights:
    """The checkpoint of a model directory, checked against the model's parameters.

    `names`: for each parameter `<unit>.<param>`, the transformers names it stands for (a
    tied weight has several; any one stored is enough). `shapes`: its logical shape.
    `rename`: a stored name -> the model's name for it (transformers' own checkpoint
    renamings, e.g. a legacy name or a bare base-model checkpoint's missing prefix; None: a
    tensor not trained and not read, e.g. a multimodal model's vision tower); the identity by
    default. `ignored`: regexes of stored names to skip."""

    def __init__(
        self,
        directory: Path,
        names: dict[str, list[str]],
        shapes: dict[str, tuple[int, ...]],
        rename: Callable[[str], str] | None = None,
        ignored: Sequence[str] = (),
    ):
        self.directory = directory
        stored = scan_directory(directory)
        known = {hf for hf_names in names.values() for hf in hf_names}
        skip = re.compile("|".join(f"({p})" for p in (*ALWAYS_IGNORED, *ignored)))
        by_name: dict[str, StoredTensor | MergedTensor] = {}
        merged: dict[str, list[MergedPiece]] = {}
        unexpected: list[StoredTensor] = []
        for key, t in stored.items():
            name = rename(key) if rename is not None else key
            if name is None:  # carried unchanged (a multimodal model's vision tower)
                continue
            if isinstance(name, MergedPiece):
                if name.target in known:
                    merged.setdefault(name.target, []).append(name)
                else:
                    unexpected.append(t)
            elif name in known:
                by_name[name] = t
            elif not skip.search(key):
                unexpected.append(t)
        if unexpected:
            listed = ", ".join(f"{t.key!r} (in {t.file.name})" for t in unexpected[:5])
            more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
            raise CephaloError(
                f"pretrained weights in {directory} do not match its config.json: tensors {listed}"
                f"{more} have no place in the model. Use the config the weights were saved with "
                '(or model.init = "random")'
            )
        for target, pieces in merged.items():
            by_name.setdefault(target, _merged_tensor(directory, target, pieces, stored))
        self.sources: dict[str, StoredTensor | MergedTensor] = {}
        files = sorted({t.file.name for t in stored.values()})
        for ours, hf_names in names.items():
            found = next((by_name[n] for n in hf_names if n in by_name), None)
            if found is None:
                raise CephaloError(
                    f"pretrained weights in {directory} lack tensor {hf_names[0]!r} (searched "
                    f"{', '.join(files)}): the weights do not match config.json; use the config "
                    'they were saved with (or model.init = "random")'
                )
            if found.shape != tuple(shapes[ours]):
                raise CephaloError(
                    f"pretrained weights: tensor {found.key!r} in {found.file} has shape "
                    f"{list(found.shape)} but config.json makes it {list(shapes[ours])}: the "
                    "weights do not match config.json"
                )
            if found.dtype not in FLOAT_DTYPES:
                raise CephaloError(
                    f"pretrained weights: tensor {found.key!r} in {found.file} is {found.dtype}; "
                    f"cephalo trains floating-point weights ({', '.join(FLOAT_DTYPES)}) only "
                    "(quantized checkpoints are not supported)"
                )
            self.sources[ours] = found

    def files(self) -> list[Path]:
        return sorted({s.file for t in self.sources.values() for s in _stored(t)})

    @torch.no_grad()
    def read(self, unit_name: str, param_names: Sequence[str]) -> dict[str, torch.Tensor]:
        """{param: fp32 CPU tensor} for the parameters `param_names` of unit `unit_name`,
        read from their files (only these tensors' bytes are read)."""
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[Any, StoredTensor]]] = {}
        for pname in param_names:
            source = self.sources[f"{unit_name}.{pname}"]
            for i, t in enumerate(_stored(source)):
                part = pname if isinstance(source, StoredTensor) else (pname, i)
                by_file.setdefault(t.file, []).append((part, t))
        values: dict[Any, torch.Tensor] = {}
        for file, items in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for pname, t in items:
                        # get_tensor maps the file (no copy); the upcast is the one real copy
                        stored = f.get_tensor(t.key)
                        value = stored if stored.dtype == torch.float32 else stored.float()
                        del stored
                        # a float64 sum cannot overflow on finite fp32 values and propagates
                        # NaN / inf, without a tensor-sized boolean temporary
                        if not bool(torch.isfinite(value.sum(dtype=torch.float64))):
                            raise CephaloError(
                                f"pretrained weights: tensor {t.key!r} in {file} holds NaN or "
                                "infinite values: the file is damaged; copy or save it again"
                            )
                        values[pname] = value
            except (_safetensors_error(), OSError) as e:
                raise CephaloError(
                    f"pretrained weights: cannot read {file}: {first_line(e)}. The file is "
                    "damaged; copy or save it again"
                ) from None
        out = {}
        for pname in param_names:
            source = self.sources[f"{unit_name}.{pname}"]
            if isinstance(source, StoredTensor):
                out[pname] = values.pop(pname)
                continue
            parts = iter(range(len(source.stored())))
            tensors = {
                p: [values.pop((pname, next(parts))) for _ in pieces]
                for p, pieces in source.pieces.items()
            }
            out[pname] = source.assemble(tensors)
        return out


def _stored(source: StoredTensor | MergedTensor) -> list[StoredTensor]:
    return [source] if isinstance(source, StoredTensor) else source.stored()


__all__ = [
    "MERGE_OPS",
    "MergedPiece",
    "MergedTensor",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "PretrainedWeights",
    "StoredTensor",
    "has_safetensors",
    "scan_directory",
    "weight_files_present",
]
