"""The rank-to-node map at launch: every rank says which node it is on and how it knows; the
all-gathered answers must agree, or every rank stops with the same message.

A rank knows its node from the cluster spec (an emulated `@nodeK`), from torchrun (its agent's
`GROUP_RANK`, with `LOCAL_WORLD_SIZE` ranks per node) or from its host name. The planner puts
shard groups on nodes and charges the links between them, so a wrong map would plan the wrong
network and, at run time, put a shard group across a slow link. The checks (`check_node_map`,
called by `discovery.discover_cluster` on the list every rank sees):

- every rank knows its node the same way (not some from the spec and others from torchrun);
- a node's ranks run on one host: a node spanning machines is a network the map hides;
- a torchrun node has the ranks torchrun says it runs (`LOCAL_WORLD_SIZE`, the same on each);
- an emulated node (`@nodeK` of the spec) lies within one torchrun node: emulated nodes may
  split a machine (two emulated nodes on one host), never join two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cephalo.errors import CephaloError

SOURCES = {
    "spec": "from the cluster spec (@nodeK)",
    "torchrun": "from torchrun (GROUP_RANK)",
    "host": "from their host name",
}


class _Described(Protocol):
    rank: int
    node: str
    node_source: str
    host: str
    torchrun_group: str | None
    local_world_size: int | None


def _ranks(ds) -> str:
    rs = sorted(d.rank for d in ds)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _by(ds, key) -> dict:
    out: dict = {}
    for d in sorted(ds, key=lambda d: d.rank):
        out.setdefault(key(d), []).append(d)
    return out


def check_node_map(descriptions: Sequence[_Described]) -> None:
    """Raise one `CephaloError` naming the ranks that disagree about their node (see the module
    docstring); every rank calls it on the same list, so every rank raises the same message."""
    fix = (
        "start every rank the same way: with torchrun, one agent per machine (--node-rank "
        "distinct, --nproc-per-node its GPUs); with a cluster spec, @nodeK on the ranks of one "
        "machine only"
    )
    sources = _by(descriptions, lambda d: d.node_source)
    if len(sources) > 1:
        parts = "; ".join(f"{_ranks(ds)} {SOURCES.get(s, s)}" for s, ds in sources.items())
        raise CephaloError(f"the ranks disagree about how they know their node: {parts}. {fix}")
    for node, ds in _by(descriptions, lambda d: d.node).items():
        hosts = _by(ds, lambda d: d.host)
        if len(hosts) > 1:
            parts = ", ".join(f"{_ranks(h)} on host {name!r}" for name, h in hosts.items())
            raise CephaloError(
                f"node {node!r} spans machines: {parts}. The ranks of one node must run on one "
                f"machine (the planner keeps shard groups inside a node); {fix}"
            )
        sizes = _by(ds, lambda d: d.local_world_size)
        if ds[0].node_source == "torchrun" and None not in sizes:
            if len(sizes) > 1:
                parts = ", ".join(f"{_ranks(s)} say {n}" for n, s in sizes.items())
                raise CephaloError(
                    f"the ranks of node {node!r} disagree about how many ranks it runs "
                    f"(LOCAL_WORLD_SIZE): {parts}. {fix}"
                )
            (size,) = sizes
            if size != len(ds):
                raise CephaloError(
                    f"node {node!r} runs {size} ranks by torchrun's LOCAL_WORLD_SIZE but "
                    f"{len(ds)} report it ({_ranks(ds)}): two torchrun agents were given the same "
                    f"--node-rank. {fix}"
                )
        if ds[0].node_source == "spec":
            groups = _by(ds, lambda d: d.torchrun_group)
            if len(groups) > 1 and None not in groups:
                parts = ", ".join(f"{_ranks(g)} on torchrun node {k}" for k, g in groups.items())
                raise CephaloError(
                    f"the cluster spec puts {_ranks(ds)} on {node} but torchrun runs them on "
                    f"different nodes ({parts}). An emulated node may split a machine, never "
                    f"join two; {fix}"
                )
