"""The catalog: known GPU types, built-in model shapes, and published per-layer profiles.

Three kinds of facts live here, each with its source:

- **Device specs** (`DEVICES`): memory capacity, memory bandwidth and PCIe generation from
  the vendors' data sheets. They drive `device_memory_bytes`, the optimizer-step estimate and
  the default link bandwidths of `cephalo.specs.cluster`.
- **Model shapes** (`MODELS`): layers, hidden size, heads, vocabulary, FFN width of the
  models the Cephalo authors measured; parameter counts are derived from the shape (one
  function per family) and checked against the published totals in the tests.
- **Measured timings and memory** (`_data/catalog.json`): per-layer forward/backward time vs
  batch size on real GPUs and activation memory vs batch size, converted by
  `scripts/build_catalog.py` from the Cephalo authors' published profiles (MIT, see
  `_data/LICENSE` and `_data/README.md`). The package never reads the original files.

`catalog_profile(device, model, seq_len, dtype)` turns these into the `DeviceProfile` the cost
model reads; every number it makes up (embedding/head time, activation bytes, optimizer time)
comes from one documented function below.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cephalo.errors import CephaloError
from cephalo.specs.adapter import default_block_linears
from cephalo.specs.catalog.derived import DERIVED, SPECS, DerivationError
from cephalo.specs.catalog.flop_scaling import (
    LeaveOneOut,
    Published,
    estimate,
    group_of,
    leave_one_out,
)
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import Curve, DeviceProfile, UnitProfile

CATALOG_PATH = Path(__file__).parents[2] / "_data" / "catalog.json"

GiB = 1024**3
GB = 1000**3

DTYPES = ("fp16", "bf16", "fp32")
# The published timings are labelled `float16` / `float32`. bf16 runs on the same tensor-core
# paths at the same rate as fp16 on every GPU listed that supports it, so bf16 reads the
# float16 measurements (an approximation for GPUs without bf16, e.g. P40/V100/T4, whose bf16
# would in practice be emulated and slower: plan those in fp16).
DATA_DTYPE = {"fp16": "float16", "bf16": "float16", "fp32": "float32"}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


# ------------------------------------------------------------------------------ devices
@dataclass(frozen=True)
class DeviceSpec:
    """A GPU type as the vendor's data sheet describes it."""

    key: str
    """Catalog key, as in the published data (`l4`, `a100x80`, ...)."""
    name: str
    """Display name."""
    memory_gib: float
    """Memory capacity. GPU vendors write "24 GB" for memories built from power-of-two
    chips, i.e. 24 GiB (2**30 bytes): nvidia-smi reports an A100 80GB as 81920 MiB. So the
    data-sheet figure is taken in GiB; the usable part is a little smaller (ECC, driver)
    and the cost model's reserve covers that."""
    memory_bandwidth_gb_s: float
    """Peak memory bandwidth, decimal GB/s (data sheet)."""
    pcie_gen: int
    """Host interface generation (x16): 3, 4 or 5."""
    nvlink_bytes_per_s: float | None = None
    """Effective per-GPU collective bandwidth over NVLink within a node, if the part has it
    (SXM boards); None for PCIe-only boards."""
    aliases: tuple[str, ...] = ()


# Effective host<->device (and PCIe peer) copy bandwidth of a x16 link, bytes/s: about 75%
# of the nominal 16 / 32 / 64 GB/s per direction that pinned-memory copies reach.
PCIE_BYTES_PER_S = {3: 12e9, 4: 24e9, 5: 48e9}

DEVICES: dict[str, DeviceSpec] = {
    d.key: d
    for d in [
        DeviceSpec("t4", "T4", 16, 320, 3),
        DeviceSpec("l4", "L4", 24, 300, 4),
        DeviceSpec("a10g", "A10G", 24, 600, 4),
        DeviceSpec("a6000", "RTX A6000", 48, 768, 4, aliases=("rtxa6000", "rtx-a6000")),
        DeviceSpec("l40s", "L40S", 48, 864, 4),
        DeviceSpec("p40", "P40", 24, 346, 3),
        DeviceSpec("p100", "P100", 16, 732, 3),
        # The data's plain `v100` key sits beside `v100x32`, so it means the 16 GB part;
        # the alias follows the data.
        DeviceSpec("v100x16", "V100 SXM2 16GB", 16, 900, 3, 100e9, aliases=("v100", "v100-16gb")),
        DeviceSpec("v100x32", "V100 SXM2 32GB", 32, 900, 3, 100e9, aliases=("v100-32gb",)),
        DeviceSpec("v100-pciex16", "V100 PCIe 16GB", 16, 900, 3, aliases=("v100-pcie",)),
        DeviceSpec("rtx3090", "RTX 3090", 24, 936, 4, aliases=("3090", "rtx_3090")),
        DeviceSpec("a100x40", "A100 40GB", 40, 1555, 4, 200e9, aliases=("a100-40gb",)),
        # `a100` means the 80 GB part: the one the data measured at long sequences.
        DeviceSpec("a100x80", "A100 80GB", 80, 2039, 4, 200e9, aliases=("a100", "a100-80gb")),
        # H100 NVL boards pair up over an NVLink bridge; beyond a pair, traffic is PCIe gen5,
        # so the conservative intra-node figure is PCIe's.
        DeviceSpec("h100-nvl", "H100 NVL", 94, 3938, 5, aliases=("h100", "h100nvl")),
    ]
}
# Consumer and workstation cards without published profiles: their timings are derived from
# a measured sibling (`cephalo.specs.catalog.derived`, which holds their data-sheet numbers).
DEVICES.update(
    {
        k: DeviceSpec(k, c.name, c.memory_gib, c.bandwidth_gb_s, c.pcie_gen, aliases=c.aliases)
        for k, c in ((k, SPECS[k]) for k in DERIVED)
    }
)
MEASURED_DEVICES = tuple(k for k in DEVICES if k not in DERIVED)

# The emulated device of the CPU cluster (`cpu`, `cpu:slowdown=2`). It has no published
# profile (measure it with `cephalo profile`); its memory is a budget the runtime enforces.
CPU_DEFAULT_MEMORY_BYTES = 4 * GiB
# gloo over loopback TCP on one host: about 1 GB/s for large messages.
CPU_LINK_BYTES_PER_S = 1e9


def _alias_table() -> dict[str, str]:
    table = {"cpu": "cpu"}
    for d in DEVICES.values():
        table[d.key] = d.key
        for a in d.aliases:
            table[a] = d.key
    return table


DEVICE_ALIASES = _alias_table()


UNLISTED_PREFIX = "gpu-"
"""Type of a GPU the catalog does not list, as a running job discovers it: `gpu-` and a slug
of its CUDA name (`gpu-nvidia-h200`). It has no data-sheet entry and no published profile:
the job profiles it under that name (`parallel.plan = "auto"`), and the defaults below assume a
PCIe gen4 board until the profiler has measured its links."""
UNLISTED_PCIE_GEN = 4


def is_unlisted(device_type: str) -> bool:
    return device_type.startswith(UNLISTED_PREFIX)


_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")
_FORM_WORDS = re.compile(r"^(sxm\d*|pcie|\d+gb|hbm\d*e?|x\d+)$")


def _chip(name: str) -> str:
    """`NVIDIA A100-SXM4-80GB` -> `a100`; `NVIDIA GeForce RTX 3090` -> `rtx3090`: the name's
    words without vendor, memory size or form factor."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return "".join(w for w in words if w not in _VENDOR_WORDS and not _FORM_WORDS.match(w))


def device_type_for_gpu(name: str, memory_bytes: int) -> str:
    """The catalog key of a GPU as CUDA names it (`torch.cuda.get_device_name`), with its
    memory to tell apart the variants of one chip (A100 40/80 GB, V100 16/32 GB, SXM/PCIe);
    a GPU the catalog does not list gets `UNLISTED_PREFIX` + a slug of its name."""
    chip = _chip(name)
    lowered = name.lower()
    candidates = [d for d in DEVICES.values() if chip and _chip(d.name) == chip]
    if candidates:

        def distance(d: DeviceSpec) -> tuple[float, int]:
            memory_gap = abs(d.memory_gib * GiB - memory_bytes) / (d.memory_gib * GiB)
            # SXM boards have NVLink, PCIe boards do not: a name that says which settles a tie
            form = 0
            if "sxm" in lowered and d.nvlink_bytes_per_s is None:
                form = 1
            if "pcie" in lowered and d.nvlink_bytes_per_s is not None:
                form = 1
            return (round(memory_gap, 1), form)

        best = min(candidates, key=distance)
        if distance(best)[0] <= 0.2:  # within 20 % of the data sheet (ECC, driver reserve)
            return best.key
    slug = "-".join(w for w in re.split(r"[^a-z0-9]+", name.lower()) if w) or "unknown"
    return UNLISTED_PREFIX + slug


def resolve_device_type(name: str) -> str:
    """Catalog key for a device type name (case-insensitive, aliases accepted); an unlisted
    GPU's discovered type (`gpu-...`) is its own key."""
    if is_unlisted(name.strip().lower()):
        return name.strip().lower()
    key = DEVICE_ALIASES.get(name.strip().lower())
    if key is None:
        raise CephaloError(
            f"unknown device type {name!r}.{_suggest(name, DEVICE_ALIASES)} Known types: {', '.join(list_device_types())}"
        )
    return key


def list_device_types() -> list[str]:
    """Catalog keys of the known device types (GPUs, then `cpu`)."""
    return [*DEVICES, "cpu"]


def device_spec(device_type: str) -> DeviceSpec | None:
    """The data-sheet entry of a device type (None for `cpu` and unlisted GPUs)."""
    return DEVICES.get(resolve_device_type(device_type))


def device_memory_bytes(device_type: str) -> int:
    """Memory capacity in bytes (data-sheet GiB, see `DeviceSpec.memory_gib`); `cpu`: the default budget."""
    if is_unlisted(device_type):
        raise CephaloError(
            f"device type {device_type!r} is not in the catalog, so its memory is unknown: give it "
            f"with mem=, e.g. {device_type}:mem=80GiB"
        )
    spec = device_spec(device_type)
    return CPU_DEFAULT_MEMORY_BYTES if spec is None else int(spec.memory_gib * GiB)


def device_display_name(device_type: str) -> str:
    if is_unlisted(device_type):
        return device_type[len(UNLISTED_PREFIX) :]
    spec = device_spec(device_type)
    return "CPU" if spec is None else spec.name


def intra_node_bytes_per_s(device_type: str) -> float:
    """Default per-link collective bandwidth between two devices of this type in one node."""
    if is_unlisted(device_type):
        return PCIE_BYTES_PER_S[UNLISTED_PCIE_GEN]
    spec = device_spec(device_type)
    if spec is None:
        return CPU_LINK_BYTES_PER_S
    return spec.nvlink_bytes_per_s or PCIE_BYTES_PER_S[spec.pcie_gen]


def host_copy_bytes_per_s(device_type: str) -> float:
    """Device <-> pinned host memory copy bandwidth: effective x16 PCIe of the board's generation."""
    if is_unlisted(device_type):
        return PCIE_BYTES_PER_S[UNLISTED_PCIE_GEN]
    spec = device_spec(device_type)
    return CPU_LINK_BYTES_PER_S * 10 if spec is None else PCIE_BYTES_PER_S[spec.pcie_gen]


# AdamW on a shard touches per parameter: fp32 master (read+write 8 B), fp32 grad (read 4),
# exp_avg and exp_avg_sq (read+write 16), and writes the 16-bit compute copy (2): ~30 B.
# The fused kernels reach about 70% of peak memory bandwidth; the step is bandwidth-bound.
ADAMW_BYTES_PER_PARAM = 30
ADAMW_BANDWIDTH_EFFICIENCY = 0.7


# ------------------------------------------------------------------------------ hosts
# A GPU server's host: its memory and the speed at which its CPUs run AdamW on training state
# kept in host memory (`host_state_fraction`). Defaults for planning clusters you do not own;
# a cluster file overrides both per node (`host_memory`, `host_optimizer_s_per_param`), and
# `cephalo profile` measures the optimizer on the real host.
DEFAULT_HOST_MEMORY_BYTES = 256 * GiB
"""Host memory per node: a common configuration of 4-8 GPU servers (and at least twice the
GPU memory of the boxes in the catalog's clusters). It holds the host state of every rank of
the node and their offloaded activations."""
HOST_ADAMW_BYTES_PER_PARAM = 36
"""Host memory traffic of AdamW per host-held parameter: fp32 master read+write (8), gradient
written by the device copy and read (8), both moments read+write (16), the compute-dtype copy
written and read by the upload to the device (4)."""
DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S = 100e9
"""Host memory bandwidth a multi-threaded CPU AdamW reaches on a two-socket server (DDR4-3200,
16 channels: 410 GB/s peak; a quarter of it for a streaming update from several processes)."""


def host_optimizer_s_per_param(ranks_on_node: int) -> float:
    """Default host AdamW time per host-held parameter of ONE rank, seconds: the node's host
    memory bandwidth is shared by its ranks (they run their host steps at the same moment,
    after the global gradient norm), so each gets 1 / ranks_on_node of it."""
    if ranks_on_node < 1:
        raise CephaloError(f"a node needs at least one rank, got {ranks_on_node}")
    return ranks_on_node * HOST_ADAMW_BYTES_PER_PARAM / DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S


def optimizer_s_per_param(device_type: str) -> float:
    """AdamW step time per owned parameter, seconds: bytes moved / achievable memory bandwidth."""
    spec = device_spec(device_type)
    if spec is None:
        raise CephaloError(
            "the `cpu` device has no catalog profile; measure it with `cephalo profile`"
        )
    return ADAMW_BYTES_PER_PARAM / (spec.memory_bandwidth_gb_s * GB * ADAMW_BANDWIDTH_EFFICIENCY)


# ------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    """A built-in model's architecture, as far as the cost model needs it."""

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Vocabulary (classes for ViT)."""
    data_keys: tuple[str, ...]
    """The published data's keys for this model, in order of preference (the first is the
    one whose measurements win when two keys measured the same thing)."""
    num_kv_heads: int | None = None
    """Grouped-query attention (Mistral); None = one K/V head per query head."""
    max_seq_len: int = 2048
    extra_aliases: tuple[str, ...] = ()
    fallback_keys: tuple[str, ...] = ()
    """Keys of a model with the SAME layer shape whose measurements stand in when this one
    has none (Llama 2 layers are Llama layers)."""


# ViT: the authors' ViTs take 224x224 images in 16x16 patches (196 patches + a class token)
# and classify 10 classes; this reproduces their published parameter totals exactly.
VIT_PATCH, VIT_TOKENS, VIT_CHANNELS = 16, 197, 3

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape("gpt-test", "gpt", 12, 512, 8, 2048, 50257, ("deepspeedgpt_test",)),
        ModelShape("gpt-1.3b", "gpt", 24, 2048, 16, 8192, 50257, ("deepspeedgpt_1.3b", "gpt_1.3b")),
        ModelShape(
            "gpt-2.7b", "gpt", 32, 2560, 32, 10240, 50257, ("deepspeedgpt_2.7b", "gpt_2.7b")
        ),
        ModelShape(
            "gpt-6.7b", "gpt", 32, 4096, 32, 16384, 50257, ("deepspeedgpt_6.7b", "gpt_6.7b")
        ),
        ModelShape("gpt-175b", "gpt", 96, 12288, 96, 49152, 50257, ("deepspeedgpt_175b",)),
        ModelShape(
            "llama-1.1b",
            "llama",
            22,
            2048,
            32,
            5632,
            32000,
            ("deepspeedllama_tiny",),
            extra_aliases=("llama-tiny", "tinyllama"),
        ),
        ModelShape("llama-3b", "llama", 26, 3200, 32, 8640, 32000, ("deepspeedllama_3b",)),
        ModelShape("llama-7b", "llama", 32, 4096, 32, 11008, 32000, ("deepspeedllama_7b",)),
        ModelShape("llama-13b", "llama", 40, 5120, 40, 13824, 32000, ("deepspeedllama_13b",)),
        ModelShape(
            "llama-33b",
            "llama",
            60,
            6656,
            52,
            17920,
            32000,
            ("deepspeedllama_33b",),
            extra_aliases=("llama-30b",),
        ),
        ModelShape("llama-65b", "llama", 80, 8192, 64, 22016, 32000, ("deepspeedllama_65b",)),
        ModelShape(
            "llama2-1.1b",
            "llama",
            22,
            2048,
            32,
            5632,
            32000,
            ("deepspeedllamav2_tiny",),
            max_seq_len=4096,
            extra_aliases=("llama2-tiny",),
            fallback_keys=("deepspeedllama_tiny",),
        ),
        ModelShape(
            "llama2-3b",
            "llama",
            26,
            3200,
            32,
            8640,
            32000,
            ("deepspeedllamav2_3b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_3b",),
        ),
        ModelShape(
            "llama2-7b",
            "llama",
            32,
            4096,
            32,
            11008,
            32000,
            ("deepspeedllamav2_7b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_7b",),
        ),
        ModelShape(
            "llama2-13b",
            "llama",
            40,
            5120,
            40,
            13824,
            32000,
            ("deepspeedllamav2_13b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_13b",),
        ),
        ModelShape(
            "mistral-7b",
            "mistral",
            32,
            4096,
            32,
            14336,
            32000,
            ("deepspeedmistral_7b", "mistral_7b"),
            num_kv_heads=8,
            max_seq_len=8192,
        ),
        ModelShape(
            "bert-base", "bert", 12, 768, 12, 3072, 30522, ("deepspeedbert_base",), max_seq_len=512
        ),
        ModelShape(
            "bert-large",
            "bert",
            24,
            1024,
            16,
            4096,
            30522,
            ("deepspeedbert_large", "bert_large"),
            max_seq_len=512,
        ),
        ModelShape(
            "bert-xlarge",
            "bert",
            36,
            1536,
            24,
            6144,
            30522,
            ("deepspeedbert_xlarge", "bert_xlarge"),
            max_seq_len=512,
        ),
        ModelShape(
            "vit-h", "vit", 32, 1280, 16, 5120, 10, ("deepspeedvit_h",), max_seq_len=VIT_TOKENS
        ),
        ModelShape(
            "vit-g",
            "vit",
            48,
            1664,
            16,
            8192,
            10,
            ("deepspeedvit_g", "vit_g"),
            max_seq_len=VIT_TOKENS,
        ),
        ModelShape(
            "vit-e",
            "vit",
            56,
            1792,
            16,
            15360,
            10,
            ("deepspeedvit_e", "vit_e"),
            max_seq_len=VIT_TOKENS,
        ),
    ]
}


def block_params(s: ModelShape) -> int:
    """Parameters of one Transformer block (weights + biases + norms), by family.

    gpt/bert: QKV+O (4h^2 + 4h), MLP (2*h*f + f + h), two LayerNorms (4h).
    llama/mistral: Q,O (2h^2) + K,V (2*h*h_kv), SwiGLU MLP (3*h*f), two RMSNorms (2h), no biases.
    vit: as gpt/bert with its own MLP width.
    """
    h, f = s.hidden_size, s.ffn_hidden_size
    if s.arch in ("llama", "mistral"):
        kv = h * (s.num_kv_heads or s.num_heads) // s.num_heads
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def embedding_params(s: ModelShape) -> int:
    """Parameters of the embedding unit.

    gpt: token (V*h) + learned positions (max_seq*h). llama/mistral: token (V*h).
    bert: token + positions (512) + token types (2) + LayerNorm (2h).
    vit: patch projection (3*16*16*h + h) + class token (h) + positions (197*h).
    """
    h, v = s.hidden_size, s.vocab_size
    if s.arch == "gpt":
        return v * h + s.max_seq_len * h
    if s.arch in ("llama", "mistral"):
        return v * h
    if s.arch == "bert":
        return v * h + s.max_seq_len * h + 2 * h + 2 * h
    if s.arch == "vit":
        return VIT_CHANNELS * VIT_PATCH * VIT_PATCH * h + h + h + VIT_TOKENS * h
    raise ValueError(s.arch)


def head_params(s: ModelShape) -> int:
    """Parameters the head owns.

    gpt: final LayerNorm (2h) + untied output projection (V*h): the authors' GPTs keep a
    separate output matrix (their totals hold two vocabulary-sized matrices).
    llama/mistral: final RMSNorm (h) + untied output projection (V*h).
    bert: pooler (h^2 + h) + MLM transform (h^2 + h + 2h) + decoder bias (V); the decoder
    weight is tied to the token embedding.
    vit: final LayerNorm (2h) + classifier (h*C + C).
    """
    h, v = s.hidden_size, s.vocab_size
    if s.arch == "gpt":
        return 2 * h + v * h
    if s.arch in ("llama", "mistral"):
        return h + v * h
    if s.arch == "bert":
        return (h * h + h) + (h * h + h + 2 * h) + v
    if s.arch == "vit":
        return 2 * h + h * v + v
    raise ValueError(s.arch)


def _model_spec(s: ModelShape) -> ModelSpec:
    return ModelSpec(
        name=s.name,
        arch=s.arch,
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_heads=s.num_heads,
        vocab_size=s.vocab_size,
        ffn_hidden_size=s.ffn_hidden_size,
        params_per_block=block_params(s),
        embedding_params=embedding_params(s),
        head_params=head_params(s),
        tied_embeddings=s.arch == "bert",
        max_seq_len=s.max_seq_len,
        aliases=(*s.extra_aliases, *s.data_keys),
        block_linears=default_block_linears(
            s.arch, s.hidden_size, s.ffn_hidden_size, s.num_heads, s.num_kv_heads
        ),
    )


def _model_alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for s in MODELS.values():
        for name in (s.name, *s.extra_aliases, *s.data_keys):
            table[name.lower()] = s.name
    return table


MODEL_ALIASES = _model_alias_table()


def list_models() -> list[ModelSpec]:
    """Every built-in model, in catalog order."""
    return [_model_spec(s) for s in MODELS.values()]


def model_shape(name: str) -> ModelShape:
    key = MODEL_ALIASES.get(name.strip().lower().replace("_", "-")) or MODEL_ALIASES.get(
        name.strip().lower()
    )
    if key is None:
        raise CephaloError(
            f"unknown model {name!r}.{_suggest(name, MODEL_ALIASES)} Known models: {', '.join(MODELS)}"
        )
    return MODELS[key]


def get_model_spec(name: str) -> ModelSpec:
    """A built-in model by friendly name (`gpt-2.7b`) or published key (`deepspeedgpt_2.7b`)."""
    return _model_spec(model_shape(name))


def _suggest(name: str, choices: dict[str, str]) -> str:
    close = difflib.get_close_matches(name.strip().lower(), list(choices), n=1, cutoff=0.6)
    return f" Did you mean {choices[close[0]]!r}?" if close else ""


# ---------------------------------------------------------------------- shipped data
@cache
def _catalog() -> dict:
    try:
        return json.loads(CATALOG_PATH.read_text())
    except (OSError, ValueError) as e:  # a broken install, not a user error, but say so clearly
        raise CephaloError(
            f"cannot read the packaged catalog {CATALOG_PATH}: {e}; reinstall cephalo"
        ) from e


def published_total_params(model: str) -> int | None:
    """Total parameters the authors published for this model (model_stats.json), if any."""
    return _catalog()["published_params"].get(model_shape(model).name, {}).get("total_parameters")


def published_params_per_layer(model: str) -> int | None:
    return (
        _catalog()["published_params"].get(model_shape(model).name, {}).get("parameters_per_layer")
    )


def skipped_entries() -> list[dict]:
    """Entries of the published data the converter did not use, each with a `reason`."""
    return list(_catalog()["skipped"])


def available_profiles() -> list[tuple[str, str, int, str]]:
    """(model, device_type, seq_len, data dtype `fp16`|`fp32`) for every measured block timing."""
    out = []
    for model, by_dev in _catalog()["timings"].items():
        for dev, by_seq in by_dev.items():
            for seq, by_dtype in by_seq.items():
                out.extend((model, dev, int(seq), dtype) for dtype in by_dtype)
    return sorted(out)


def _timing_entry(model: str, device: str, seq_len: int, dtype: str) -> tuple[dict, int]:
    """The measured block timing for (model, device, dtype) and the seq_len it was measured
    at: the exact seq_len if present, else the nearest one (by ratio) of the same dtype."""
    data_dtype = "fp32" if dtype == "fp32" else "fp16"
    by_seq = _catalog()["timings"].get(model, {}).get(device, {})
    seqs = sorted(int(s) for s, by_dtype in by_seq.items() if data_dtype in by_dtype)
    if not seqs:
        have = [f"{d}/{s}/{t}" for m, d, s, t in available_profiles() if m == model]
        raise CephaloError(
            f"no published {data_dtype} profile of {model} on {device}"
            + (" (bf16 uses the fp16 data)" if dtype == "bf16" else "")
            + f". Published for {model} (device/seq_len/dtype): {', '.join(have) or 'none'}."
            " Choose one of those, or measure your devices with `cephalo profile`."
        )
    nearest = min(seqs, key=lambda s: abs(math.log(s / seq_len)))
    return by_seq[str(nearest)][data_dtype], nearest


def block_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one block for one sample: 2 per weight per token (the matmuls) plus
    attention scores and weighted sum, 2 * 2 * seq^2 * h (Narayanan et al. 2021). The weights
    are those a token uses: a mixture-of-experts block's active ones (top-k routed + shared
    experts, `ModelSpec.compute_params_per_block`), assuming tokens spread evenly over the
    experts (imbalance is not modelled)."""
    return (
        2.0 * spec.compute_params_per_block * seq_len + 4.0 * seq_len * seq_len * spec.hidden_size
    )


def head_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of the output projection: 2 * tokens * h * V (ViT classifies one token)."""
    tokens = 1 if spec.arch == "vit" else seq_len
    return 2.0 * tokens * spec.hidden_size * spec.vocab_size


# An embedding lookup is a gather: memory-bound and tiny next to a block's matmuls. Its time
# is taken as this fraction of a block's (ViT's patch projection is a real matmul and uses
# its FLOP ratio instead, when larger).
EMBEDDING_TIME_FRACTION = 0.02


def embedding_time_ratio(spec: ModelSpec, seq_len: int) -> float:
    """Embedding time / block time."""
    if spec.arch == "vit":
        patch_flops = 2.0 * VIT_TOKENS * VIT_CHANNELS * VIT_PATCH * VIT_PATCH * spec.hidden_size
        return max(EMBEDDING_TIME_FRACTION, patch_flops / block_flops_per_sample(spec, seq_len))
    return EMBEDDING_TIME_FRACTION


def head_time_ratio(spec: ModelSpec, seq_len: int) -> float:
    """Head time / block time, by FLOP ratio (the published data times blocks only)."""
    return head_flops_per_sample(spec, seq_len) / block_flops_per_sample(spec, seq_len)


def korthikanti_block_activation_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """Activation bytes one block saves for backward, per sample, without recomputation:
    s*h*(34 + 5*a*s/h) in 16-bit training (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", eq. 1 with b=1, t=1); doubled in fp32."""
    s, h, a = seq_len, spec.hidden_size, spec.num_heads
    return s * h * (34 + 5 * a * s / h) * DTYPE_BYTES[dtype] / 2


def boundary_activation_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """One layer-boundary activation (a block's input kept for recomputation), per sample."""
    return seq_len * spec.hidden_size * DTYPE_BYTES[dtype]


def head_logits_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """The head's activations per sample: the logits in the compute dtype plus the fp32
    copy the loss (log-softmax) works on; in fp32 training that is two fp32 copies."""
    tokens = 1 if spec.arch == "vit" else seq_len
    return tokens * spec.vocab_size * (DTYPE_BYTES[dtype] + 4)


def block_activation_bytes_per_sample(
    spec: ModelSpec, seq_len: int, dtype: str
) -> tuple[float, str]:
    """Peak extra memory of recomputing + backpropagating one block, per sample, and its source.

    Where the authors profiled memory (model_memory.json: peak allocated minus training
    state, with recomputation, at batch 1..k), the slope of that line per sample covers one
    block's recompute activations + every layer's boundary activation + the head's logits.
    Subtracting the two known parts leaves the block's share. That measurement was made at
    the data's sequence length (512) and is scaled to `seq_len` with the Korthikanti formula's
    ratio. The result never goes below the formula (a measurement smaller than theory means
    the subtraction over-counted), and the formula alone is used where nothing was measured.
    """
    formula = korthikanti_block_activation_bytes(spec, seq_len, dtype)
    mem = _catalog()["memory"].get(spec.name, {}).get("fp32" if dtype == "fp32" else "fp16")
    if mem is None:
        return formula, "formula"
    s0 = mem["seq_len"]
    per_sample = mem["slope_bytes_per_sample"]
    block0 = (
        per_sample
        - spec.num_layers * boundary_activation_bytes(spec, s0, dtype)
        - head_logits_bytes(spec, s0, dtype)
    )
    measured = block0 * formula / korthikanti_block_activation_bytes(spec, s0, dtype)
    return (measured, "measured") if measured > formula else (formula, "formula")


# Curves are evaluated at these micro-batch sizes when a unit's curve is a multiple of a
# per-sample constant (activation memory is linear in the micro-batch).
_ACT_XS = [1.0, 2.0, 4.0, 8.0, 16.0]


def _scaled(curve: Curve, factor: float) -> Curve:
    return Curve(list(curve.xs), [y * factor for y in curve.ys])


def _linear_bytes(per_sample: float) -> Curve:
    return Curve(list(_ACT_XS), [per_sample * x for x in _ACT_XS])


def _data_dtype(dtype: str) -> str:
    return "fp32" if dtype == "fp32" else "fp16"


def _block_shape(spec: ModelSpec) -> tuple[int, int, int]:
    return (spec.params_per_block, spec.hidden_size, spec.num_heads)


def timed_model_for(spec: ModelSpec) -> str | None:
    """The catalog model whose published block timings describe `spec`'s blocks: itself, or
    one with the same block shape (a transformers Llama-2-7B directory is llama2-7b's
    blocks); None when no published model has these blocks."""
    timings = _catalog()["timings"]
    if spec.name in timings:
        return spec.name
    if spec.num_experts:  # no published model routes tokens to experts: FLOP-scaled
        return None
    for name in timings:
        if name in MODELS and _block_shape(_model_spec(MODELS[name])) == _block_shape(spec):
            return name
    return None


@cache
def published_entries(
    device: str, dtype: str, measured_only: bool = False
) -> tuple[Published, ...]:
    """Every published block timing on `device` in `dtype`'s data (bf16 reads fp16); with
    `measured_only`, without the entries derived from a sibling card (`specs.catalog.derived`)."""
    out = []
    for name, by_dev in _catalog()["timings"].items():
        if name not in MODELS:
            continue
        spec = _model_spec(MODELS[name])
        for seq, by_dtype in by_dev.get(device, {}).items():
            entry = by_dtype.get(_data_dtype(dtype))
            if entry is not None and not (measured_only and entry["source"] == "derived"):
                out.append(
                    Published(
                        name,
                        _block_shape(spec),
                        group_of(spec.arch),
                        int(seq),
                        block_flops_per_sample(spec, int(seq)),
                        Curve.from_dict(entry["fwd_s"]),
                        Curve.from_dict(entry["bwd_s"]),
                    )
                )
    return tuple(out)


@cache
def estimate_error(device: str | None, dtype: str | None, group: str) -> LeaveOneOut | None:
    """Leave-one-out error of the FLOP-scaled estimate for `group` blocks on `device` in
    `dtype`; with `device` / `dtype` None, pooled over every GPU and dtype of the catalog."""
    devices = [device] if device else sorted(MEASURED_DEVICES)  # derived cards repeat them
    dtypes = [dtype] if dtype else ["fp16", "fp32"]
    # measured entries only: a derived entry's error is the derivation's (printed beside it)
    return leave_one_out(
        [published_entries(d, t, measured_only=True) for d in devices for t in dtypes], group
    )


def _estimated_block(
    spec: ModelSpec, device: str, seq_len: int, dtype: str
) -> tuple[Curve, Curve, dict]:
    """Block curves of a model without published profiles, by FLOP scaling (flop_scaling.py),
    and what to tell the user about them."""
    candidates = published_entries(device, dtype)
    if not candidates:
        raise CephaloError(
            f"{device} has no published {_data_dtype(dtype)} profiles to estimate {spec.name} "
            "from; measure your devices with `cephalo profile`"
        )
    group = group_of(spec.arch)
    est = estimate(block_flops_per_sample(spec, seq_len), group, seq_len, candidates)
    here = estimate_error(device, dtype, group)
    overall = estimate_error(None, None, group)
    timings = _catalog()["timings"]
    from_derived = any(
        timings[m][device][seq][_data_dtype(dtype)].get("source") == "derived"
        for m, seq in (src.split("@") for src in est.sources)
    )
    meta = {
        "timing_source": "flop-scaled",
        "estimated_from": ", ".join(est.sources) + (" (derived entries)" if from_derived else ""),
        "estimate_group": group,
        "estimate_error": (here or overall).describe() if (here or overall) else "not measurable",
        "estimate_error_scope": f"{device} {_data_dtype(dtype)}" if here else "all catalog GPUs",
    }
    return est.fwd, est.bwd, meta


def derived_meta(device: str) -> dict:
    """What a plan says about a derived card: its method and the method's measured error."""
    info = _catalog()["derived"][device]
    err = _catalog()["derivation_errors"].get(info["error_scope"])
    return {
        "derived_method": info["method"],
        "derived_error_scope": info["error_scope"],
        "derived_fills_gaps": bool(info.get("fills_gaps")),
        "derived_error": DerivationError.from_dict(err).describe() if err else "not measurable",
    }


def catalog_profile(
    device_type: str, model: ModelSpec | str, seq_len: int, dtype: str
) -> DeviceProfile:
    """The cost model's view of `device_type` running `model` at (seq_len, dtype), from the
    published measurements.

    Block forward/backward times are the measured curves (seconds vs micro-batch) of the
    model, or of a published model with the same blocks. A missing seq_len is served from
    the nearest measured one, scaled linearly in tokens (an approximation: attention's share
    grows quadratically, a few percent at these lengths). A catalog model's missing dtype is
    an error that lists what exists. A model the catalog never measured (a transformers
    directory, a preset) gets block times estimated from the same GPU's published profiles
    by FLOP scaling (`_estimated_block`; its leave-one-out error is in the profile's meta).
    Embedding and head times are the block's times x `embedding_time_ratio` /
    `head_time_ratio`.
    """
    if dtype not in DTYPES:
        raise CephaloError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if seq_len <= 0:
        raise CephaloError(f"seq_len must be positive, got {seq_len}")
    spec = model if isinstance(model, ModelSpec) else get_model_spec(model)
    device = resolve_device_type(device_type)
    if device == "cpu":
        raise CephaloError(
            "the `cpu` device has no catalog profile; measure it with `cephalo profile`"
        )
    timed = timed_model_for(spec)
    timing_meta: dict = {}
    try:
        if timed is None:
            raise LookupError
        entry, data_seq = _timing_entry(timed, device, seq_len, dtype)
        seq_scale = seq_len / data_seq
        block_fwd = _scaled(Curve.from_dict(entry["fwd_s"]), seq_scale)
        block_bwd = _scaled(Curve.from_dict(entry["bwd_s"]), seq_scale)
        timing_meta = {
            "data_key": entry["key"],
            "data_seq_len": data_seq,
            "timing_source": entry["source"],
        }
        if timed != spec.name:
            timing_meta["timing_model"] = timed
    except (LookupError, CephaloError):
        if timed == spec.name:
            raise  # a catalog model: say which of its profiles exist
        block_fwd, block_bwd, timing_meta = _estimated_block(spec, device, seq_len, dtype)
    uses_derived = timing_meta.get("timing_source") == "derived" or timing_meta.get(
        "estimated_from", ""
    ).endswith("(derived entries)")
    if device in DERIVED or uses_derived:
        timing_meta.update(derived_meta(device))
    act_block, act_source = block_activation_bytes_per_sample(spec, seq_len, dtype)
    emb_ratio, head_ratio = embedding_time_ratio(spec, seq_len), head_time_ratio(spec, seq_len)
    units = {
        "embedding": UnitProfile(
            _scaled(block_fwd, emb_ratio),
            _scaled(block_bwd, emb_ratio),
            _linear_bytes(boundary_activation_bytes(spec, seq_len, dtype)),
        ),
        "block": UnitProfile(block_fwd, block_bwd, _linear_bytes(act_block)),
        "head": UnitProfile(
            _scaled(block_fwd, head_ratio),
            _scaled(block_bwd, head_ratio),
            _linear_bytes(head_logits_bytes(spec, seq_len, dtype)),
        ),
    }
    return DeviceProfile(
        device_type=device,
        memory_bytes=device_memory_bytes(device),
        units=units,
        optimizer_s_per_param=optimizer_s_per_param(device),
        host_copy_bytes_per_s=host_copy_bytes_per_s(device),
        source="catalog",
        async_copies=True,  # every catalog device is a GPU: copies on a side stream
        meta={
            "model": spec.name,
            "seq_len": seq_len,
            "dtype": dtype,
            **timing_meta,
            "data_dtype": _data_dtype(dtype),  # bf16 reads the fp16 data
            "activation_source": act_source,
            "embedding_time_ratio": emb_ratio,
            "head_time_ratio": head_ratio,
        },
    )
