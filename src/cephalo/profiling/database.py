"""The profile database: measured device and collective profiles in one JSON file.

A measurement is only reusable for the same thing measured, so every entry is keyed by

- the device type key (`cpu`, `cpu:slowdown=2`, `l4`) and the host (CPU model and host
  name on CPUs, the GPU's name on CUDA): the same type key on another machine is another
  device;
- the model signature: a hash of the model's shape and module structure (dropout
  included, it costs time), so a renamed but identical model hits and a resized one misses;
- sequence length, compute dtype and the torch version (kernels change between releases);
- the measurement method's version (`MEASURE_METHOD`): entries measured the way an older
  cephalo measured miss and are measured again;
- the peers it was measured with (`DeviceKey.peers`): co-located CPU ranks are measured
  concurrently, and their contention for the cores is part of the numbers.

Collective profiles are keyed by the world size, backend, the ordered device type keys
and the host. Memory capacity is not part of any key: times do not depend on how much
memory a device has, so the loaded profile takes the device's capacity from the cluster.

File format (version 1):

    {"version": 1,
     "devices": {KEY: {"key": {...}, "profile": DeviceProfile.to_dict(), "measured_at": ISO}},
     "comm":    {KEY: {"key": {...}, "profile": {"bytes_per_s": .., "latency_s": ..}, ...}}}

Writes go to a temporary file renamed over the old one, so a crash never leaves a
half-written database; an unreadable file is an error that names it (delete it or pass
`--refresh`), never a silent re-measure.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cephalo import envvars
from cephalo.errors import CephaloError
from cephalo.specs.profile import CommProfile, DeviceProfile

DB_VERSION = 1
MEASURE_METHOD = 6
"""Bump when how a device is measured changes what a profile says. 2: the optimizer step
and (on CPUs) the host copies are timed under the emulator; `async_copies` recorded.
3: co-located CPU ranks measured concurrently by the wall clock (`DeviceKey.peers`).
4: emulated CPU devices stretched to slowdown x the thread's CPU time, not its wall time.
5: activation bytes no longer count saved views of the unit's parameters (the engine's
ledger does not: they live in its gathered buffer); small micro-batches were overstated.
6: the host's AdamW on host-held state measured (`host_optimizer_s_per_param`); the optimizer
step's norm sum in fp64; an emulated link (`pcie=`) measured through the engine's HostLink."""
DEFAULT_DB_PATH = Path("~/.cache/cephalo/profiles.json")


def default_db_path() -> Path:
    """`$CEPHALO_PROFILE_DB` if set, else `~/.cache/cephalo/profiles.json`."""
    env = os.environ.get(envvars.PROFILE_DB)
    return Path(env).expanduser() if env else DEFAULT_DB_PATH.expanduser()


def host_signature(device: torch.device | str = "cpu") -> str:
    """What identifies the hardware a profile was measured on."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = _cpu_model() or platform.processor() or platform.machine()
    return f"cpu:{cpu}@{socket.gethostname()}"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def model_signature(model: torch.nn.Module, spec: Any) -> str:
    """A short hash of the model's shape (ModelSpec fields minus names) and its modules' repr."""
    # block_linears: already in the modules' repr (left out so that caches made before the
    # field existed stay valid)
    skip = ("name", "aliases", "block_linears")
    # the MoE fields only when set (dense models keep the signatures made before they existed)
    moe = ("active_params_per_block", "num_experts", "experts_per_token")
    shape = {k: v for k, v in asdict(spec).items() if k not in skip and not (k in moe and not v)}
    text = json.dumps(shape, sort_keys=True) + "\n" + repr(model)
    quantized = getattr(model, "quantized_parameters", None)
    if quantized:  # QLoRA: the same modules as LoRA, but the profile times the dequantization
        text += "\nnf4: " + ",".join(sorted(quantized))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DeviceKey:
    """What a device profile was measured for."""

    device_type: str
    """Type key: `cpu`, `cpu:slowdown=2`, `l4`."""
    model: str
    """Model signature (`model_signature`)."""
    seq_len: int
    dtype: str
    torch: str
    """torch version that measured it."""
    host: str
    """`host_signature` of the measuring device."""
    method: int = MEASURE_METHOD
    """How it was measured (`MEASURE_METHOD` of the cephalo that measured it)."""
    peers: str = ""
    """Measured concurrently with these ranks (their type keys, in rank order, comma
    separated), which shared its host's cores; empty when measured alone."""
    compile: str = "off"
    """The blocks' `parallel.compile` mode as measured (resolved: `off`, `inductor`,
    `graphs`): a compiled block's profile is not an eager one's."""

    def text(self) -> str:
        values = asdict(self)
        if values["compile"] == "off":  # the keys of eager profiles as before the field
            del values["compile"]
        return "|".join(str(v) for v in values.values())


@dataclass(frozen=True)
class CommKey:
    """What a collective profile was measured for."""

    devices: tuple[str, ...]
    """Type keys of the ranks, in rank order."""
    backend: str
    torch: str
    host: str
    """Host signature of rank 0 (links differ between machines)."""

    def text(self) -> str:
        return "|".join(["comm", ",".join(self.devices), self.backend, self.torch, self.host])


@dataclass
class ProfileDatabase:
    """An in-memory view of one database file; `save()` writes it back atomically."""

    path: Path
    devices: dict[str, dict] = field(default_factory=dict)
    comm: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None) -> ProfileDatabase:
        """The database at `path` (default `default_db_path()`); empty if the file is absent."""
        p = Path(path).expanduser() if path else default_db_path()
        if not p.exists():
            return cls(p)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CephaloError(
                f"cannot read the profile database {p}: {e}; delete it (it is only a cache) "
                "or point --cache/[profile] cache elsewhere"
            ) from None
        if not isinstance(data, dict) or data.get("version") != DB_VERSION:
            raise CephaloError(
                f"profile database {p} has format version {data.get('version') if isinstance(data, dict) else '?'}, "
                f"this cephalo reads version {DB_VERSION}; delete the file to re-measure"
            )
        return cls(p, dict(data.get("devices", {})), dict(data.get("comm", {})))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"version": DB_VERSION, "devices": self.devices, "comm": self.comm}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------ entries
    def get_device(self, key: DeviceKey) -> DeviceProfile | None:
        entry = self.devices.get(key.text())
        return DeviceProfile.from_dict(entry["profile"]) if entry else None

    def put_device(self, key: DeviceKey, profile: DeviceProfile) -> None:
        self.devices[key.text()] = {
            "key": asdict(key),
            "profile": profile.to_dict(),
            "measured_at": _now(),
        }

    def get_comm(self, key: CommKey) -> CommProfile | None:
        entry = self.comm.get(key.text())
        return CommProfile(**entry["profile"]) if entry else None

    def put_comm(self, key: CommKey, profile: CommProfile, meta: dict | None = None) -> None:
        self.comm[key.text()] = {
            "key": {**asdict(key), "devices": list(key.devices)},
            "profile": asdict(profile),
            "meta": meta or {},
            "measured_at": _now(),
        }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
