"""Known GPU types: memory, bandwidth and PCIe generation from the vendors' data sheets (`DEVICES`),
the names a CUDA device or a user may give them, the CPU stand-ins, and the optimizer-step
speeds derived from memory bandwidth (device and host AdamW)."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass

from cephalo.errors import CephaloError
from cephalo.specs.catalog.derived import DERIVED, SPECS

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
        slug = "-".join(w for w in re.split(r"[^a-z0-9]+", name.lower()) if w) or "NAME"
        raise CephaloError(
            f"unknown device type {name!r}.{_suggest(name, DEVICE_ALIASES)} A GPU the catalog "
            f"does not list: write it as {UNLISTED_PREFIX}{slug}:mem=SIZE (its memory, e.g. "
            f"{UNLISTED_PREFIX}{slug}:mem=24GiB) and measure it with `cephalo profile` (a job with "
            f"parallel.plan = auto measures it itself). Known types: {', '.join(list_device_types())}"
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


def _family(name: str) -> str:
    """Letters and the first digit of the model number (`rtx3`, `a6`, `h1`): a suggestion
    from another family (an RTX 3080 for a 2080, an H100 for an H200) is a different GPU."""
    match = re.match(r"[^0-9]*[0-9]?", name.strip().lower().replace("_", "").replace("-", ""))
    return match.group(0) if match else ""


def _suggest(name: str, choices: dict[str, str]) -> str:
    """A near spelling of a known type of the same family, else nothing."""
    lowered = name.strip().lower()
    close = difflib.get_close_matches(lowered, list(choices), n=5, cutoff=0.6)
    same = [c for c in close if _family(c) == _family(name)]
    same.sort(key=lambda c: -len(os.path.commonprefix([c, lowered])))  # stable: difflib's next
    return f" Did you mean {choices[same[0]]!r}?" if same else ""
