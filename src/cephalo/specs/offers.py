"""GPU offers: which device types one may rent or buy, how many, at what price per hour.

The advisor (`cephalo advise`, `cephalo.advise.advisor`) searches every cluster the offers
allow. An offers file is TOML (also JSON, or YAML with PyYAML installed), one `[[offer]]`
table per offer:

    [[offer]]
    name = "AWS g6.12xlarge"        # optional label (default: the type); unique
    type = "l4"                     # a catalog device type (`cephalo catalog`)
    max_count = 16                  # GPUs at most
    price_per_hour = 1.1464         # USD per GPU per hour
    per_node = 4                    # optional: GPUs come in nodes of this many (whole nodes only)
    inter_node_bandwidth = "5GB/s"  # optional: the node's network link (default 10 GB/s)
    intra_node_bandwidth = "24GB/s" # optional: between its GPUs (default: the type's, `cephalo catalog`)
    source = "https://..."          # optional: where the price comes from
    as_of = "2024-06-01"            # optional: when

Each offer's GPUs sit on their own node(s): without `per_node`, one node holding all one
rents of it (a machine one fills); with `per_node`, nodes of that many. GPUs of two offers
are never on one node, so a cluster mixing offers talks over the slowest inter-node link.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import (
    device_memory_bytes,
    intra_node_bytes_per_s,
    resolve_device_type,
)
from cephalo.specs.cluster import DEFAULT_INTER_NODE_BYTES_PER_S, MAX_DEVICES, parse_rate
from cephalo.specs.files import read_table_file

MICRO_USD_PER_USD = 1_000_000
"""Prices are summed in whole micro-dollars, so equal prices compare equal exactly."""
MAX_PRICE_PER_HOUR = 1e4
"""Beyond any GPU's hourly price: a larger one is a typo (cents for dollars, or a total)."""

_KEYS = (
    "name",
    "type",
    "max_count",
    "price_per_hour",
    "per_node",
    "inter_node_bandwidth",
    "intra_node_bandwidth",
    "source",
    "as_of",
)


@dataclass(frozen=True)
class Offer:
    """One kind of GPU one may rent or buy."""

    name: str
    """Label in tables and JSON (the type unless given)."""
    type: str
    """Catalog device type key (`l4`, `a100x80`, ...)."""
    max_count: int
    """GPUs at most."""
    price_per_hour: float
    """USD per GPU per hour."""
    per_node: int | None = None
    """GPUs per node when they come in whole nodes; None: one node holding all one rents."""
    inter_node_bytes_per_s: float = DEFAULT_INTER_NODE_BYTES_PER_S
    """The node's network link, per device."""
    intra_node_bytes_per_s: float | None = None
    """Link between its GPUs within a node; None: the type's default (`cephalo catalog`)."""
    source: str | None = None
    """Where the price comes from (a URL)."""
    as_of: str | None = None
    """When the price was read."""

    @property
    def unit_gpus(self) -> int:
        """GPUs one step of the count adds: a whole node, or one GPU."""
        return self.per_node or 1

    @property
    def max_units(self) -> int:
        return self.max_count // self.unit_gpus

    @property
    def micro_usd_per_gpu(self) -> int:
        return round(self.price_per_hour * MICRO_USD_PER_USD)

    @property
    def memory_bytes(self) -> int:
        return device_memory_bytes(self.type)

    @functools.cached_property
    def intra_bytes_per_s(self) -> float:
        """The link between this offer's GPUs: given, or the type's default."""
        if self.intra_node_bytes_per_s is not None:
            return self.intra_node_bytes_per_s
        return intra_node_bytes_per_s(self.type)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "max_count": self.max_count,
            "price_per_hour": self.price_per_hour,
            "per_node": self.per_node,
            "inter_node_bytes_per_s": self.inter_node_bytes_per_s,
            "intra_node_bytes_per_s": self.intra_bytes_per_s,
            "source": self.source,
            "as_of": self.as_of,
        }


@dataclass(frozen=True)
class Offers:
    """The offers of one file, in file order."""

    offers: tuple[Offer, ...]
    where: str = "offers"

    def __iter__(self) -> Iterator[Offer]:
        return iter(self.offers)

    def __len__(self) -> int:
        return len(self.offers)

    def by_name(self, name: str) -> Offer:
        for o in self.offers:
            if o.name == name:
                return o
        raise KeyError(name)

    @classmethod
    def from_list(cls, entries: list[Offer], where: str = "offers") -> Offers:
        names = [o.name for o in entries]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CephaloError(
                f"{where}: offer name(s) {', '.join(map(repr, dupes))} used twice; give each offer its own `name`"
            )
        return cls(tuple(entries), where)

    @classmethod
    def from_dict(cls, data: Any, where: str = "offers") -> Offers:
        """From a parsed file: `{"offer": [{...}, ...]}` (`offers` also accepted)."""
        if not isinstance(data, dict):
            raise CephaloError(
                f"{where}: expected a table with an `offer` list ([[offer]] in TOML), got {type(data).__name__}"
            )
        unknown = set(data) - {"offer", "offers"}
        if unknown:
            raise CephaloError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; an offers file holds [[offer]] tables"
            )
        entries = data.get("offer", data.get("offers"))
        if not isinstance(entries, list) or not entries:
            raise CephaloError(
                f"{where}: no offers; write one [[offer]] table per GPU type with type, max_count and price_per_hour"
            )
        offers = [_offer(e, f"{where}: offer[{i}]") for i, e in enumerate(entries)]
        # default names are the types; the same type offered twice gets numbered names
        names = [o.name for o in offers]
        renamed = []
        for i, o in enumerate(offers):
            explicit = isinstance(entries[i], dict) and "name" in entries[i]
            if not explicit and names.count(o.name) > 1:
                o = Offer(**{**o.__dict__, "name": f"{o.type}#{i}"})
            renamed.append(o)
        return cls.from_list(renamed, where)

    @classmethod
    def from_file(cls, path: str | Path) -> Offers:
        p = Path(path)
        data = read_table_file(p, "offers")
        return cls.from_dict(data, where=str(p))


def _offer(e: Any, where: str) -> Offer:
    if not isinstance(e, dict):
        raise CephaloError(
            f'{where}: expected a table like {{type = "l4", max_count = 4, price_per_hour = 0.8}}, got {e!r}'
        )
    unknown = set(e) - set(_KEYS)
    if unknown:
        raise CephaloError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(_KEYS)}"
        )
    if not isinstance(e.get("type"), str):
        raise CephaloError(
            f'{where}: `type` is required, a device type name such as "l4" (`cephalo catalog` lists them)'
        )
    try:
        dtype = resolve_device_type(e["type"])
    except CephaloError as err:
        raise CephaloError(f"{where}: {err}") from None
    name = e.get("name", dtype)
    if not isinstance(name, str) or not name.strip():
        raise CephaloError(f"{where}: `name` must be a non-empty string, got {name!r}")
    count = e.get("max_count")
    if count is None:
        raise CephaloError(f"{where} ({name}): `max_count` is required: how many GPUs at most")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
        raise CephaloError(
            f"{where} ({name}): max_count must be an integer >= 1 and at most {MAX_DEVICES:,}, got {count!r}"
        )
    if "price_per_hour" not in e:
        raise CephaloError(
            f"{where} ({name}): `price_per_hour` is missing: the USD price of one GPU for one hour "
            "(0 for hardware you already own)"
        )
    price = e["price_per_hour"]
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not math.isfinite(price):
        raise CephaloError(
            f"{where} ({name}): price_per_hour must be a number of USD per GPU-hour, got {price!r}"
        )
    if price < 0:
        raise CephaloError(
            f"{where} ({name}): price_per_hour is negative ({price}); give the USD price of one GPU for one hour"
        )
    if price > MAX_PRICE_PER_HOUR:
        raise CephaloError(
            f"{where} ({name}): price_per_hour {price} is more than {MAX_PRICE_PER_HOUR:g} USD for one GPU-hour; "
            "give the price per GPU, not per node or per month"
        )
    per_node = e.get("per_node")
    if per_node is not None:
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise CephaloError(
                f"{where} ({name}): per_node must be an integer >= 1 (GPUs per node), got {per_node!r}"
            )
        if count % per_node:
            lower, upper = count // per_node * per_node, (count // per_node + 1) * per_node
            raise CephaloError(
                f"{where} ({name}): max_count {count} is not a whole number of nodes of {per_node} GPUs; "
                f"use {lower or upper} or {upper}"
            )
    kwargs: dict[str, Any] = {}
    for key, field in (
        ("inter_node_bandwidth", "inter_node_bytes_per_s"),
        ("intra_node_bandwidth", "intra_node_bytes_per_s"),
    ):
        if key in e:
            kwargs[field] = parse_rate(e[key], f"{where} ({name}): {key}")
    for key in ("source", "as_of"):
        if key in e:
            value = e[key]
            if isinstance(value, datetime.date):  # TOML and YAML read 2024-06-01 as a date
                value = value.isoformat()
            if not isinstance(value, str):
                raise CephaloError(f"{where} ({name}): {key} must be a string, got {value!r}")
            kwargs[key] = value
    return Offer(
        name=name.strip(),
        type=dtype,
        max_count=count,
        price_per_hour=float(price),
        per_node=per_node,
        **kwargs,
    )
