"""What every completion of a partial count vector has, node by node: the facts the partial bound
(`BoundTables.betas`) charges a rank of each offer for in shard groups.

The search fixes offers' counts in order; the cluster's nodes come in the same order
(`advise_bound.nodes_of`), so a partial vector with counts for its first offers knows the nodes
of those offers, and that any node an unfixed offer adds comes after them. Per offer:

- `sizes`: the fewest devices one of its nodes has: `per_node`; for an offer without nodes (all
  its GPUs on one node), its count once fixed, else 0 (its count is open: one device, or a node
  of >= 2 on its intra-node link);
- `groups`: the fewest shard groups of a grouping in which its node is a group alone, but for
  the cluster's last node: the candidate groupings (`groups.candidate_groupings`) cut the nodes
  in order into chunks of k = 1, 2, 4, ... nodes, so a node is alone in its chunk only for k = 1
  (as many groups as nodes: at least those of the partial, and one more for an offer it does
  not have yet) or as the last chunk's only node;
- `last`: where its node may be the cluster's last one, the most devices that node may have
  (0: it cannot be last): alone in the last chunk, it may sit in only 2 groups. Only one node
  is last, so the bound adds what that one node may take beyond its `groups` samples once
  (`BoundTables.betas`' `extra`), rather than charging every node 2 groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

from cephalo.specs.offers import Offer


class NodeBounds(NamedTuple):
    """Per offer, what its nodes have in every completion considered (module docstring)."""

    sizes: tuple[int, ...]
    groups: tuple[int, ...]
    last: tuple[int, ...]
    last_groups: tuple[int, ...]
    """The fewest groups its node may be alone among as the cluster's last node (where `last`)."""


@lru_cache(maxsize=4096)
def last_alone_groups(fewest: int, most: int) -> int:
    """The fewest groups in which a cluster of `fewest`..`most` nodes has its last node alone in
    its group: k = 1 (one group per node: N groups), or chunks of k = 2, 4, ... < N nodes with
    N = 1 mod k (the last chunk that one node: (N - 1) / k + 1 groups)."""
    best = max(2, fewest)
    for nodes in range(max(fewest, 2), most + 1):
        best = min(best, nodes)
        k = 2
        while k < nodes:
            if nodes % k == 1:
                best = min(best, (nodes - 1) // k + 1)
            k *= 2
        if best == 2:
            break
    return best


Tails = dict[tuple[int, int], tuple[tuple[int, ...], ...]]
"""`completion_nodes`' memo of the open offers' part, per (fixed offers, nodes)."""


def completion_nodes(
    offers: Sequence[Offer],
    units: Sequence[int],
    nodes: int,
    added: bool = False,
    top: int | None = None,
    tails: Tails | None = None,
) -> NodeBounds:
    """The `NodeBounds` of the completions of `units` (counts of the first offers; `nodes`: the
    nodes they make). `added`: only completions that add devices of the offers not yet fixed
    (so they have more nodes than the partial, and their last node is one of those offers'),
    else every completion, the partial itself included. `top`: the most the last fixed count
    may be (the partial stands for counts units[-1]..top of that offer; default units[-1]).
    `tails`: a memo for the offers not fixed yet, whose part depends on `len(units)` and
    `nodes` only (the search asks about many partials with the same two; one memo per
    `offers`)."""
    depth = len(units)
    # the fewest nodes a completion holding an offer's ranks has: the partial's, and one more for
    # an offer not fixed yet (or for every offer, once devices are added)
    fixed_groups = max(2, nodes + 1 if added else nodes)
    tail = tails.get((depth, nodes)) if tails is not None else None
    if tail is None:
        tail = _open_part(offers, depth, nodes)
        if tails is not None:
            tails[(depth, nodes)] = tail
    t_sizes, t_groups, t_last, t_last_groups = tail
    sizes = [o.per_node or int(k) * o.unit_gpus for o, k in zip(offers[:depth], units, strict=True)]
    last = [0] * depth
    last_groups = [fixed_groups] * depth
    if not added:
        # the partial itself: its last node is its last fixed offer's with devices
        for j in range(depth - 1, -1, -1):
            k = int(top if top is not None and j == depth - 1 else units[j])
            if k > 0:
                o = offers[j]
                last[j] = o.per_node or k * o.unit_gpus
                spread = k - int(units[j]) if o.per_node else 0  # its nodes: units[j]..k
                last_groups[j] = last_alone_groups(max(nodes, 1), max(nodes, 1) + spread)
                break
    return NodeBounds(
        (*sizes, *t_sizes),
        (fixed_groups,) * depth + t_groups,
        (*last, *t_last),
        (*last_groups, *t_last_groups),
    )


def _open_part(
    offers: Sequence[Offer], depth: int, nodes: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """`completion_nodes`' sizes, groups, last and last_groups of the offers from `depth` on,
    for a partial of `nodes` nodes (the same with or without `added`)."""
    open_groups = max(2, nodes + 1)
    sizes, last, last_groups = [], [], []
    most = nodes  # the most nodes a completion whose last node is offer j's has
    for o in offers[depth:]:
        sizes.append(o.per_node or 0)
        # nothing after it: its (last) node ends the cluster, of nodes+1..most nodes
        most += o.max_units if o.per_node else 1
        last.append(o.per_node or o.max_units * o.unit_gpus)
        last_groups.append(last_alone_groups(nodes + 1, most))
    return tuple(sizes), (open_groups,) * len(sizes), tuple(last), tuple(last_groups)
