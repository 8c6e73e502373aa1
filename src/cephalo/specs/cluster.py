"""The cluster: which devices, how much memory each has, and how fast they talk.

Two ways to say it:

- a spec string, `cephalo plan --cluster 2xl4,a6000,p40`; grammar in `SPEC_GRAMMAR`;
- a file (TOML, JSON, or YAML when PyYAML is installed) with one entry per device type and
  optional link bandwidths; format in `Cluster.from_file`.

Bandwidth defaults come from the device types (`cephalo.specs.catalog.published`): within a node, the
slowest device's link (PCIe generation, or NVLink on SXM boards); between nodes, 100 Gbit/s
Ethernet at 80% efficiency. Override them in the file form when you know better.

Each node also has a host: its memory (`host_memory`, default
`catalog.DEFAULT_HOST_MEMORY_BYTES`) is shared by the ranks of the node for host-held training
state and offloaded activations, and its CPUs run the AdamW step of that state (default speed
`catalog.host_optimizer_s_per_param`, measured by `cephalo profile`, or set in the file).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import (
    CPU_DEFAULT_MEMORY_BYTES,
    DEFAULT_HOST_MEMORY_BYTES,
    DEVICE_ALIASES,
    device_display_name,
    device_memory_bytes,
    intra_node_bytes_per_s,
    is_unlisted,
    list_device_types,
    resolve_device_type,
)
from cephalo.specs.files import SUFFIXES, read_table_file

SPEC_GRAMMAR = """\
cluster spec: DEVICE[,DEVICE...][;LINK...]
  DEVICE  = [Nx]TYPE[@nodeK | @nodeA-B][:KEY=VALUE[,KEY=VALUE...]]   (@nodeA-B: N on each node A..B)
  TYPE    = a device type (`cephalo catalog`), case-insensitive, e.g. l4, a6000, a100, cpu
  KEY     = mem (e.g. 20GiB, 16GB, 512MiB), node (integer >= 0), slowdown (float >= 1, cpu only),
            pcie (host-copy bandwidth of an emulated cpu device, e.g. 12GB/s)
  LINK    = intra=RATE | inter=RATE | latency=SECONDS: the links of the whole cluster (within a
            node, between nodes, fixed cost of a collective), RATE e.g. 24GB/s;
            host=SIZE | hostK=SIZE: every node's / node K's host memory (default 256GiB)
  examples: 2xl4,a6000,p40   4xa100x80@node1   cpu,cpu:slowdown=2,cpu:slowdown=4,mem=1GiB,pcie=12GB/s
            8xa100x80@node0-1;inter=50GB/s   (2 nodes of 8)   cpu@node0,cpu@node1;host1=2GiB"""

# 100 Gbit/s Ethernet, ~80% achievable by NCCL/gloo ring collectives.
DEFAULT_INTER_NODE_BYTES_PER_S = 100e9 / 8 * 0.8
# Launch + synchronisation cost of one collective: NCCL on GPUs, gloo for the CPU emulation.
GPU_COLLECTIVE_LATENCY_S = 50e-6
CPU_COLLECTIVE_LATENCY_S = 200e-6

_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*/\s*s\s*$", re.IGNORECASE)
_DEVICE_RE = re.compile(
    r"^(?:(\d+)\s*x\s*)?([a-z0-9_.\-]*?)\s*(?:@\s*(?:node)?\s*(\S*))?$", re.IGNORECASE
)
_OPTIONS = ("mem", "node", "slowdown", "pcie")
_LINK_OPTIONS = {
    "intra": "intra_node_bytes_per_s",
    "inter": "inter_node_bytes_per_s",
    "latency": "collective_latency_s",
}
# More devices than any cluster has: a typo (or a fuzzer) would otherwise build a list of
# billions of devices before anything could complain.
MAX_DEVICES = 1_000_000


def _spec_error(what: str) -> CephaloError:
    return CephaloError(f"{what}\n{SPEC_GRAMMAR}")


def parse_bytes(text: str, what: str = "memory") -> int:
    """'20GiB' / '16 GB' / '512MiB' -> bytes (GiB = 2**30, GB = 10**9)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise CephaloError(
            f"bad {what} {text!r}: write a number and a unit, e.g. 20GiB, 16GB, 512MiB (units: GiB, GB, MiB, MB, KiB, KB, TiB, TB, B)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise CephaloError(f"bad {what} {text!r}: must be positive")
    return int(value)


def parse_rate(value: Any, what: str) -> float:
    """A bandwidth: a number (bytes/s) or a string like '12GB/s', '25 GiB/s'."""
    if isinstance(value, bool):
        raise CephaloError(f"bad {what} {value!r}: give bytes per second, e.g. 12e9 or '12GB/s'")
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        m = _RATE_RE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise CephaloError(
                f"bad {what} {value!r}: give bytes per second, e.g. 12e9 or '12GB/s'"
            )
        rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(rate) or rate <= 0:
        raise CephaloError(f"bad {what} {value!r}: must be a positive number of bytes per second")
    return rate


def _format_memory(n: int) -> str:
    """GiB for GPU-sized memory, MiB below 1 GiB (emulated budgets are often MiB)."""
    unit, size = ("GiB", n / 1024**3) if n >= 1024**3 else ("MiB", n / 1024**2)
    return f"{size:.0f} {unit}" if abs(size - round(size)) < 0.05 else f"{size:.1f} {unit}"


@dataclass
class Device:
    """One device (one rank) of the cluster."""

    type: str
    """Catalog key (`l4`, `a6000`, `p40`, ...) or `cpu`."""
    memory_bytes: int
    """Memory capacity: the catalog's, or the `mem=` override (the CPU emulation's budget)."""
    node: int = 0
    """Node (host) index; devices on different nodes talk over the inter-node network."""
    slowdown: float = 1.0
    """CPU emulation only: compute is stretched by this factor (1 = as fast as the host)."""
    pcie_bytes_per_s: float | None = None
    """CPU emulation only: every host <-> device copy is stretched to this bandwidth, as
    `slowdown` stretches compute (None: copies run at memcpy speed)."""

    @property
    def type_key(self) -> str:
        """The key profiles are stored under: `l4`, `cpu`, `cpu:slowdown=2`,
        `cpu:slowdown=2:pcie=12GB/s`.

        Slowdown and the emulated copy bandwidth change speed, so they are part of the type;
        memory is not (a profile's times do not depend on how much memory the device has).
        """
        key = self.type
        if self.slowdown != 1.0:
            key += f":slowdown={self.slowdown:g}"
        if self.pcie_bytes_per_s is not None:
            key += f":pcie={self.pcie_bytes_per_s / 1e9:g}GB/s"
        return key

    def to_dict(self) -> dict:
        out = {
            "type": self.type,
            "memory_bytes": self.memory_bytes,
            "node": self.node,
            "slowdown": self.slowdown,
        }
        if self.pcie_bytes_per_s is not None:
            out["pcie_bytes_per_s"] = self.pcie_bytes_per_s
        return out


@dataclass
class Cluster:
    """Devices in rank order, and the links between them."""

    devices: list[Device]
    intra_node_bytes_per_s: float = field(default=None)  # type: ignore[assignment]
    """Per-device collective bandwidth between devices of one node; default: the slowest
    device type's link (PCIe gen3 12 GB/s, gen4 24 GB/s, gen5 48 GB/s effective; NVLink
    100-200 GB/s on SXM boards; 1 GB/s for the gloo CPU emulation)."""
    inter_node_bytes_per_s: float = field(default=DEFAULT_INTER_NODE_BYTES_PER_S)
    """Per-device bandwidth between nodes; default 100 Gbit/s Ethernet at 80%: 10 GB/s."""
    collective_latency_s: float = field(default=None)  # type: ignore[assignment]
    """Fixed cost of one collective call; default 50 us (NCCL), 200 us with any `cpu` device (gloo)."""
    host_memory_bytes: int = DEFAULT_HOST_MEMORY_BYTES
    """Host memory of every node (unless `node_host_memory_bytes` says otherwise), shared by the
    ranks of the node for host-held training state and offloaded activations."""
    node_host_memory_bytes: dict[int, int] = field(default_factory=dict)
    """Per-node overrides of `host_memory_bytes`, by node index."""
    host_optimizer_s_per_param: float | None = None
    """AdamW time of one rank per host-held parameter on every node (unless
    `node_host_optimizer_s_per_param` says otherwise); None: measured (`cephalo profile`) or
    the catalog default (`catalog.host_optimizer_s_per_param`: the node's host memory bandwidth
    shared by its ranks)."""
    node_host_optimizer_s_per_param: dict[int, float] = field(default_factory=dict)
    """Per-node overrides of `host_optimizer_s_per_param`, by node index."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise CephaloError("a cluster needs at least one device")
        if self.intra_node_bytes_per_s is None:
            self.intra_node_bytes_per_s = min(intra_node_bytes_per_s(d.type) for d in self.devices)
        if self.collective_latency_s is None:
            any_cpu = any(d.type == "cpu" for d in self.devices)
            self.collective_latency_s = (
                CPU_COLLECTIVE_LATENCY_S if any_cpu else GPU_COLLECTIVE_LATENCY_S
            )

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return len({d.node for d in self.devices})

    def nodes(self) -> list[int]:
        """Node indices in first-seen (rank) order."""
        return list(dict.fromkeys(d.node for d in self.devices))

    def ranks_on_node(self, node: int) -> list[int]:
        return [i for i, d in enumerate(self.devices) if d.node == node]

    def host_memory_of(self, node: int) -> int:
        """Host memory of `node`, bytes."""
        return int(self.node_host_memory_bytes.get(node, self.host_memory_bytes))

    def host_optimizer_override(self, node: int) -> float | None:
        """The cluster's own host AdamW time per parameter for a rank of `node`, if it gives one."""
        return self.node_host_optimizer_s_per_param.get(node, self.host_optimizer_s_per_param)

    def device_types(self) -> list[str]:
        """Distinct `type_key`s in first-seen order."""
        return list(dict.fromkeys(d.type_key for d in self.devices))

    def slowest_link_bytes_per_s(self) -> float:
        """The link every ring collective is bounded by: inter-node if the cluster spans nodes."""
        if self.num_nodes > 1:
            return min(self.inter_node_bytes_per_s, self.intra_node_bytes_per_s)
        return self.intra_node_bytes_per_s

    def describe(self) -> str:
        """`2x L4 (24 GiB) + RTX A6000 (48 GiB) + P40 (24 GiB)`; consecutive equal devices grouped."""
        parts = []
        for (type_key, mem, node), count in _runs(
            (d.type_key, d.memory_bytes, d.node) for d in self.devices
        ):
            name = (
                device_display_name(type_key.split(":")[0])
                + type_key[len(type_key.split(":")[0]) :]
            )
            where = f" @node{node}" if self.num_nodes > 1 else ""
            parts.append(
                f"{count}x {name} ({_format_memory(mem)}){where}"
                if count > 1
                else f"{name} ({_format_memory(mem)}){where}"
            )
        return " + ".join(parts)

    def to_spec(self) -> str:
        """The spec string `Cluster.parse` reads back as this very cluster: devices in rank
        order (runs of equal ones counted), nodes when any device is off node 0, memory,
        slowdown and emulated host link where they differ from the type's, links where they
        differ from the defaults. Host memory and host optimizer speed (cluster-file fields
        only) have no spec syntax: a cluster with them set does not round-trip."""
        with_nodes = any(d.node != 0 for d in self.devices)
        runs = _runs(
            (d.type, d.memory_bytes, d.node, d.slowdown, d.pcie_bytes_per_s) for d in self.devices
        )
        # runs of equal devices on consecutive nodes, equally many on each: one @nodeA-B token
        merged: list[list] = []
        for (type_name, mem, node, slowdown, pcie), count in runs:
            last = merged[-1] if merged else None
            if (
                with_nodes
                and last is not None
                and last[0] == (type_name, mem, slowdown, pcie, count)
                and node == last[2] + 1
            ):
                last[2] = node
            else:
                merged.append([(type_name, mem, slowdown, pcie, count), node, node])
        parts = []
        for (type_name, mem, slowdown, pcie, count), first, last_node in merged:
            token = f"{count}x{type_name}" if count > 1 else type_name
            if with_nodes:
                token += f"@node{first}" + (f"-{last_node}" if last_node > first else "")
            default_mem = (
                CPU_DEFAULT_MEMORY_BYTES
                if type_name == "cpu"
                else None
                if is_unlisted(type_name)  # no data sheet: mem= always written
                else device_memory_bytes(type_name)
            )
            options = []
            if mem != default_mem:
                options.append(f"mem={_format_bytes_exact(mem)}")
            if slowdown != 1.0:
                short = f"{slowdown:g}"
                options.append(f"slowdown={short if float(short) == slowdown else repr(slowdown)}")
            if pcie is not None:
                options.append(f"pcie={_format_rate(pcie)}")
            parts.append(":".join([token, *options]))
        spec = ",".join(parts)
        default_intra = min(intra_node_bytes_per_s(d.type) for d in self.devices)
        default_latency = (
            CPU_COLLECTIVE_LATENCY_S
            if any(d.type == "cpu" for d in self.devices)
            else GPU_COLLECTIVE_LATENCY_S
        )
        if self.intra_node_bytes_per_s != default_intra:
            spec += f";intra={_format_rate(self.intra_node_bytes_per_s)}"
        if self.inter_node_bytes_per_s != DEFAULT_INTER_NODE_BYTES_PER_S:
            spec += f";inter={_format_rate(self.inter_node_bytes_per_s)}"
        if self.collective_latency_s != default_latency:
            spec += f";latency={self.collective_latency_s!r}"
        if self.host_memory_bytes != DEFAULT_HOST_MEMORY_BYTES:
            spec += f";host={_format_bytes_exact(self.host_memory_bytes)}"
        for node, nbytes in sorted(self.node_host_memory_bytes.items()):
            spec += f";host{node}={_format_bytes_exact(nbytes)}"
        return spec

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "devices": [d.to_dict() for d in self.devices],
            "intra_node_bytes_per_s": self.intra_node_bytes_per_s,
            "inter_node_bytes_per_s": self.inter_node_bytes_per_s,
            "collective_latency_s": self.collective_latency_s,
            "host_memory_bytes": self.host_memory_bytes,
        }
        if self.host_optimizer_s_per_param is not None:
            out["host_optimizer_s_per_param"] = self.host_optimizer_s_per_param
        nodes = sorted(set(self.node_host_memory_bytes) | set(self.node_host_optimizer_s_per_param))
        if nodes:
            out["nodes"] = [
                {
                    "node": n,
                    **(
                        {"host_memory_bytes": self.node_host_memory_bytes[n]}
                        if n in self.node_host_memory_bytes
                        else {}
                    ),
                    **(
                        {"host_optimizer_s_per_param": self.node_host_optimizer_s_per_param[n]}
                        if n in self.node_host_optimizer_s_per_param
                        else {}
                    ),
                }
                for n in nodes
            ]
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "cluster") -> Cluster:
        """From `to_dict()` output or the file form (see `from_file`)."""
        if not isinstance(d, dict):
            raise CephaloError(
                f"{where}: expected a table/object with a `devices` list, got {type(d).__name__}"
            )
        known = {
            "devices",
            "intra_node_bytes_per_s",
            "inter_node_bytes_per_s",
            "collective_latency_s",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            *_HOST_KEYS,
            "nodes",
        }
        unknown = set(d) - known
        if unknown:
            raise CephaloError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected devices, intra_node_bandwidth, "
                "inter_node_bandwidth, collective_latency_s, host_memory, host_optimizer_s_per_param, nodes"
            )
        entries = d.get("devices")
        if isinstance(entries, str):
            devices = cls.parse(entries).devices
        elif isinstance(entries, list) and entries:
            devices = [
                dev
                for i, e in enumerate(entries)
                for dev in _devices_from_entry(e, f"{where}: devices[{i}]")
            ]
        else:
            raise CephaloError(
                f"{where}: `devices` must be a non-empty list of {{type, count, memory, node}} entries or a spec string"
            )
        kwargs: dict[str, float] = {}
        for key, alt in (
            ("intra_node_bytes_per_s", "intra_node_bandwidth"),
            ("inter_node_bytes_per_s", "inter_node_bandwidth"),
        ):
            if key in d or alt in d:
                kwargs[key] = parse_rate(d.get(key, d.get(alt)), f"{where}: {alt}")
        if "collective_latency_s" in d:
            lat = d["collective_latency_s"]
            if (
                isinstance(lat, bool)
                or not isinstance(lat, (int, float))
                or not math.isfinite(lat)
                or lat < 0
            ):
                raise CephaloError(
                    f"{where}: collective_latency_s must be a number of seconds >= 0, got {lat!r}"
                )
            kwargs["collective_latency_s"] = float(lat)
        memory, optimizer = _host_settings(d, where)
        node_memory: dict[int, int] = {}
        node_optimizer: dict[int, float] = {}
        nodes = d.get("nodes", [])
        if not isinstance(nodes, list):
            raise CephaloError(
                f"{where}: `nodes` must be a list of {{node, host_memory, host_optimizer_s_per_param}} entries"
            )
        present = {dev.node for dev in devices}
        for i, e in enumerate(nodes):
            at = f"{where}: nodes[{i}]"
            if not isinstance(e, dict):
                raise CephaloError(
                    f'{at}: expected a table like {{node = 1, host_memory = "128GiB"}}'
                )
            unknown = set(e) - {"node", *_HOST_KEYS}
            if unknown:
                raise CephaloError(
                    f"{at}: unknown key(s) {', '.join(sorted(unknown))}; allowed: node, host_memory, "
                    "host_optimizer_s_per_param"
                )
            n = e.get("node")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise CephaloError(f"{at}: `node` must be an integer >= 0, got {n!r}")
            if n in node_memory or n in node_optimizer:
                raise CephaloError(
                    f"{at}: node {n} is listed twice in `nodes`; give each node's host settings once"
                )
            if n not in present:
                raise CephaloError(
                    f"{at}: node {n} has no devices (nodes in use: {', '.join(map(str, sorted(present)))})"
                )
            mem, opt = _host_settings(e, at)
            if mem is not None:
                node_memory[n] = mem
            if opt is not None:
                node_optimizer[n] = opt
        if memory is not None:
            kwargs["host_memory_bytes"] = memory
        if optimizer is not None:
            kwargs["host_optimizer_s_per_param"] = optimizer
        return cls(
            devices,
            **kwargs,
            node_host_memory_bytes=node_memory,
            node_host_optimizer_s_per_param=node_optimizer,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """A cluster file. TOML (also JSON, or YAML with PyYAML installed), e.g.

            intra_node_bandwidth = "24GB/s"     # optional, bytes/s or a rate string
            inter_node_bandwidth = "10GB/s"     # optional
            collective_latency_s = 5e-5         # optional
            host_memory = "256GiB"              # optional, per node (default 256 GiB)
            host_optimizer_s_per_param = 1.5e-9 # optional: host AdamW of one rank, s/param
            [[nodes]]                           # optional per-node overrides of the two above
            node = 1
            host_memory = "128GiB"
            [[devices]]
            type = "l4"
            count = 2                           # optional, default 1
            memory = "20GiB"                    # optional: override the catalog's capacity
            node = 0                            # optional, default 0
            [[devices]]
            type = "a6000"

        `devices` may also be a spec string: `devices = "2xl4,a6000"`.
        """
        p = Path(path)
        data = read_table_file(p, "cluster")
        return cls.from_dict(data, where=str(p))

    @classmethod
    def from_any(cls, spec_or_path: str | Path) -> Cluster:
        """A file if `spec_or_path` names one (or looks like one), else a spec string."""
        text = str(spec_or_path)
        p = Path(text)
        try:
            is_file = p.is_file()
        except OSError:  # a spec longer than a file name may be
            is_file = False
        if is_file or p.suffix.lower() in SUFFIXES:
            return cls.from_file(p)
        return cls.parse(text)

    @classmethod
    def parse(cls, spec: str) -> Cluster:
        """A cluster from a spec string (grammar in `SPEC_GRAMMAR`)."""
        if not isinstance(spec, str) or not spec.strip():
            raise _spec_error("empty cluster spec")
        spec, *link_tokens = spec.split(";")
        links = _parse_links(link_tokens)
        if not spec.strip():
            raise _spec_error("a cluster spec needs devices before its links (`;...`)")
        groups: list[tuple[str, list[str]]] = []  # (device token, option tokens)
        for raw in spec.split(","):
            token = raw.strip()
            if not token:
                raise _spec_error(
                    f"empty device in cluster spec {spec!r} (two commas, or a trailing comma?)"
                )
            head = token.split(":", 1)[0]
            if (
                ":" not in token
                and "=" in token
                and head.split("=", 1)[0].strip().lower() not in DEVICE_ALIASES
            ):
                # `cpu:slowdown=4,mem=1GiB`: an option continuing the previous device
                if not groups:
                    raise _spec_error(f"option {token!r} comes before any device")
                groups[-1][1].append(token)
                continue
            device, _, opts = token.partition(":")
            groups.append((device.strip(), [o for o in opts.split(":")] if opts else []))
        return cls([dev for device, opts in groups for dev in _parse_device(device, opts)], **links)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)


def _format_bytes_exact(n: int) -> str:
    """Bytes as `parse_bytes` reads them back exactly: 20GiB, 512MiB, or a count of B."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _format_rate(bytes_per_s: float) -> str:
    """A rate `parse_rate` reads back exactly: `50GB/s` where that is exact, else bytes/s."""
    gb = f"{bytes_per_s / 1e9:g}"
    if float(gb) * 1e9 == bytes_per_s:
        return f"{gb}GB/s"
    return f"{bytes_per_s!r}B/s"


def _parse_links(tokens: list[str]) -> dict[str, Any]:
    """The `;intra=RATE;inter=RATE;latency=SECONDS;host=SIZE;hostK=SIZE` tail of a spec as
    `Cluster` arguments."""
    out: dict[str, Any] = {}
    for raw in tokens:
        key, eq, value = raw.partition("=")
        key = key.strip().lower()
        if eq and key.startswith("host") and value.strip():
            nbytes = parse_bytes(value.strip(), f"{key}= host memory")
            if key == "host":
                if "host_memory_bytes" in out:
                    raise _spec_error("link option host given twice")
                out["host_memory_bytes"] = nbytes
                continue
            if key[4:].isdigit():
                nodes = out.setdefault("node_host_memory_bytes", {})
                if int(key[4:]) in nodes:
                    raise _spec_error(f"link option {key} given twice")
                nodes[int(key[4:])] = nbytes
                continue
        if not eq or key not in _LINK_OPTIONS or not value.strip():
            raise _spec_error(
                f"bad link option {raw.strip()!r}: expected one of intra=RATE, inter=RATE, "
                "latency=SECONDS, host=SIZE, hostK=SIZE"
            )
        field_name = _LINK_OPTIONS[key]
        if field_name in out:
            raise _spec_error(f"link option {key} given twice")
        if key == "latency":
            try:
                lat = float(value)
            except ValueError:
                lat = float("nan")
            if not math.isfinite(lat) or lat < 0:
                raise _spec_error(
                    f"bad latency {value.strip()!r}: must be a number of seconds >= 0"
                )
            out[field_name] = lat
        else:
            out[field_name] = parse_rate(value.strip(), f"{key}= rate")
    return out


_HOST_KEYS = ("host_memory", "host_memory_bytes", "host_optimizer_s_per_param")


def _host_settings(d: dict, where: str) -> tuple[int | None, float | None]:
    """(host memory bytes, host optimizer s/param) of a cluster file's table, each None if absent."""
    memory = None
    if "host_memory" in d and "host_memory_bytes" in d:
        raise CephaloError(f"{where}: give host_memory or host_memory_bytes, not both")
    if "host_memory" in d:
        memory = parse_bytes(d["host_memory"], f"{where}: host_memory")
    elif "host_memory_bytes" in d:
        mb = d["host_memory_bytes"]
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise CephaloError(f"{where}: host_memory_bytes must be a positive integer, got {mb!r}")
        memory = mb
    optimizer = None
    if "host_optimizer_s_per_param" in d:
        v = d["host_optimizer_s_per_param"]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise CephaloError(
                f"{where}: host_optimizer_s_per_param must be a positive number of seconds per "
                f"parameter (e.g. 1.5e-9), got {v!r}"
            )
        optimizer = float(v)
    return memory, optimizer


def _runs(items) -> list[tuple[Any, int]]:
    out: list[list] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1][1] += 1
        else:
            out.append([it, 1])
    return [(k, n) for k, n in out]


def _parse_device(token: str, option_tokens: list[str]) -> list[Device]:
    m = _DEVICE_RE.match(token)
    if not m or not m.group(2):
        raise _spec_error(
            f"bad device {token!r}: expected [Nx]TYPE[@nodeK], e.g. 2xl4 or a100@node1"
        )
    count_text, type_name, node_text = m.groups()
    count = int(count_text) if count_text is not None else 1
    if count < 1:
        raise _spec_error(f"bad device {token!r}: the count must be at least 1")
    if count > MAX_DEVICES:
        raise _spec_error(
            f"bad device {token!r}: count {count} is not a plausible number of devices"
        )
    dtype = resolve_device_type(type_name)
    options: dict[str, str] = {}
    if node_text is not None:
        options["node"] = node_text
    for opt in option_tokens:
        key, eq, value = opt.partition("=")
        key = key.strip().lower()
        if not eq or key not in _OPTIONS or not value.strip():
            raise _spec_error(
                f"bad option {opt!r} for device {token!r}: expected one of {', '.join(k + '=...' for k in _OPTIONS)}"
            )
        if key in options:
            raise _spec_error(f"option {key} given twice for device {token!r}")
        options[key] = value.strip()
    nodes = _node_range(options.get("node"), token)
    if nodes is not None:  # N devices on each node of a range, @node0-7
        if len(nodes) * count > MAX_DEVICES:
            raise _spec_error(
                f"bad device {token!r}: {len(nodes) * count} devices is not plausible"
            )
        options["node"] = str(nodes[0])
    try:
        d = _make_device(dtype, options, token)
    except CephaloError as e:
        raise _spec_error(str(e)) from None
    return [
        Device(d.type, d.memory_bytes, node, d.slowdown, d.pcie_bytes_per_s)
        for node in (nodes or [d.node])
        for _ in range(count)
    ]


def _node_range(text: str | None, token: str) -> list[int] | None:
    """`A-B` as the nodes A..B (None when `text` is one node, or absent)."""
    if text is None or "-" not in str(text).strip().lstrip("-"):
        return None
    first, _, last = str(text).partition("-")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise _spec_error(
            f"bad node range {text!r} for {token!r}: write @nodeA-B, e.g. @node0-3"
        ) from None
    if a < 0 or b < a:
        raise _spec_error(f"bad node range {text!r} for {token!r}: need 0 <= A <= B in @nodeA-B")
    return list(range(a, b + 1))


def _make_device(dtype: str, options: dict[str, Any], token: str) -> Device:
    """A device from its type and raw option values (strings from a spec, or file values)."""
    if options.get("mem") is not None:
        memory = parse_bytes(options["mem"], f"mem= for {token!r}:")
    else:
        memory = device_memory_bytes(dtype) if dtype != "cpu" else CPU_DEFAULT_MEMORY_BYTES
    node = 0
    if options.get("node") is not None:
        raw = options["node"]
        try:
            node = int(str(raw)) if not isinstance(raw, bool) else -1
        except ValueError:
            node = -1
        if node < 0:
            raise CephaloError(f"bad node {raw!r} for {token!r}: must be an integer >= 0")
    slowdown = 1.0
    if options.get("slowdown") is not None:
        raw = options["slowdown"]
        try:
            slowdown = float(raw) if not isinstance(raw, bool) else float("nan")
        except ValueError:
            slowdown = float("nan")
        if not math.isfinite(slowdown) or slowdown < 1:
            raise CephaloError(f"bad slowdown {raw!r} for {token!r}: must be a number >= 1")
        if dtype != "cpu" and slowdown != 1.0:
            raise CephaloError(
                f"slowdown= only applies to emulated `cpu` devices, not {dtype!r} ({token!r})"
            )
    pcie = None
    if options.get("pcie") is not None:
        if dtype != "cpu":
            raise CephaloError(
                f"pcie= only applies to emulated `cpu` devices, not {dtype!r} ({token!r}): a GPU's "
                "host link comes from its PCIe generation"
            )
        pcie = parse_rate(options["pcie"], f"pcie= for {token!r}:")
    return Device(
        type=dtype, memory_bytes=memory, node=node, slowdown=slowdown, pcie_bytes_per_s=pcie
    )


def _devices_from_entry(e: Any, where: str) -> list[Device]:
    """One entry of a file's `devices` list: {type, count?, memory?|memory_bytes?, node?, slowdown?}."""
    if not isinstance(e, dict):
        raise CephaloError(
            f'{where}: expected a table/object like {{type = "l4", count = 2}}, got {e!r}'
        )
    allowed = {
        "type",
        "count",
        "memory",
        "memory_bytes",
        "node",
        "slowdown",
        "pcie",
        "pcie_bytes_per_s",
    }
    unknown = set(e) - allowed
    if unknown:
        raise CephaloError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}"
        )
    if not isinstance(e.get("type"), str):
        raise CephaloError(
            f'{where}: `type` is required, a device type name such as "l4" (known: {", ".join(list_device_types())})'
        )
    dtype = resolve_device_type(e["type"])
    count = e.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
        raise CephaloError(
            f"{where}: count must be an integer >= 1 and at most {MAX_DEVICES:,}, got {count!r}"
        )
    options: dict[str, Any] = {
        "node": e.get("node"),
        "slowdown": e.get("slowdown"),
        "pcie": e.get("pcie", e.get("pcie_bytes_per_s")),
    }
    if "memory" in e:
        options["mem"] = e["memory"]
    device = _make_device(dtype, options, where)
    if "memory_bytes" in e:
        mb = e["memory_bytes"]
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise CephaloError(f"{where}: memory_bytes must be a positive integer, got {mb!r}")
        device.memory_bytes = mb
    return [
        Device(
            device.type, device.memory_bytes, device.node, device.slowdown, device.pcie_bytes_per_s
        )
        for _ in range(count)
    ]
