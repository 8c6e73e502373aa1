"""The advisor's partial bound (`BoundTables.betas` on `advise_partial.completion_nodes`) with shard
groups: every completion whose own bound reaches a step time is admitted by every partial vector
of it, at a price no lower than the completion's; and the search equals brute force on an
inventory of big node-less offers on a fast intra-node link beside nodes of one and two GPUs."""

import itertools

import numpy as np
import pytest

from cephalo.advise.advisor import Advisor
from cephalo.advise.partial import completion_nodes, last_alone_groups
from test_advise import GROUPED, TIGHT, brute_force, make_advisor, planned

# node-less offers whose count is open for most partial vectors, on fast intra-node links beside
# a slow network (a node of >= 2 of them is far faster than a device over the network), and
# nodes of one and two GPUs
OPEN_OFFERS = {
    "offer": [
        {"type": "t4", "max_count": 2, "price_per_hour": 0.35, "per_node": 1,
         "inter_node_bandwidth": "1GB/s"},
        {"type": "a6000", "max_count": 4, "price_per_hour": 0.79,
         "inter_node_bandwidth": "1GB/s", "intra_node_bandwidth": "50GB/s"},
        {"type": "l4", "max_count": 4, "price_per_hour": 0.80, "per_node": 2,
         "inter_node_bandwidth": "2GB/s"},
        {"type": "rtx3090", "max_count": 3, "price_per_hour": 0.43,
         "inter_node_bandwidth": "1GB/s", "intra_node_bandwidth": "50GB/s"},
    ]
}  # fmt: skip
OPEN_TIGHT_OFFERS = {
    "offer": [
        {"type": "a6000", "max_count": 3, "price_per_hour": 0.79,
         "inter_node_bandwidth": "1GB/s", "intra_node_bandwidth": "50GB/s"},
        {"type": "t4", "max_count": 3, "price_per_hour": 0.35, "per_node": 1,
         "inter_node_bandwidth": "2GB/s"},
        {"type": "l4", "max_count": 4, "price_per_hour": 0.80,
         "inter_node_bandwidth": "1GB/s", "intra_node_bandwidth": "50GB/s"},
    ]
}  # fmt: skip


@pytest.fixture(scope="module")
def open_nodes():
    return make_advisor(GROUPED, OPEN_OFFERS, reduce_dtype="bf16")


@pytest.fixture(scope="module")
def open_tight():
    # llama-1.1b: a T4 alone holds the whole state only with part of it on the host
    return make_advisor(TIGHT, OPEN_TIGHT_OFFERS, reduce_dtype="bf16")


def test_last_alone_groups():
    """A node alone in its group as the cluster's last: one group per node, or the last chunk
    of k = 2, 4, ... nodes when N = 1 mod k."""
    assert last_alone_groups(3, 3) == 2  # chunks of 2: [2 nodes][1]
    assert last_alone_groups(4, 4) == 4  # only one group per node
    assert last_alone_groups(5, 5) == 2  # chunks of 4: [4][1]
    assert last_alone_groups(6, 6) == 6
    assert last_alone_groups(7, 7) == 4  # chunks of 2: 3 + 1
    assert last_alone_groups(4, 6) == 2
    assert last_alone_groups(1, 2) == 2


def _partial_state(adv: Advisor, units: tuple[int, ...]) -> tuple[int, float, float, int]:
    x = np.zeros(len(adv.offers), dtype=np.int64)
    x[: len(units)] = units
    return adv._shape(x)


@pytest.mark.parametrize("which", ["open_nodes", "open_tight"])
def test_partial_bound_admits_every_completion(which, request):
    """For every cluster and every step time its own bound reaches (the least, and a few above
    it), every partial vector of it (its first counts fixed, the rest open) is admitted: its
    floor is within T and the least price its completions need is at most the cluster's. A
    partial bound that took an open node-less offer for one device (no faster than a ring of
    2 over the network) fails this on a node of several on a fast link."""
    adv = request.getfixturevalue(which)
    K = len(adv.offers)
    checked = 0
    for x in itertools.product(*(range(k + 1) for k in adv._max_units)):
        if not any(x) or adv.upper_bound(x) == 0:
            continue
        _, intra, inter, _ = adv._shape(np.asarray(x))
        t_x = adv._bounds.step_lower_bound(np.asarray(x), intra, inter)
        price = adv.price_of(x)
        for T in (t_x * (1 + 1e-9), t_x * 1.05, t_x * 1.3):
            for depth in range(K + 1):
                units = tuple(int(k) for k in x[:depth])
                n, p_intra, p_inter, nodes = _partial_state(adv, units)
                covers, floor = adv._partial_betas(units, n, p_intra, p_inter, nodes, T)
                assert floor <= T, (x, depth, T)
                gpus = np.asarray(units, dtype=np.int64) * adv._unit_gpus[:depth]
                held = float(np.dot(gpus, adv._state_cap[:depth]))
                own = adv._completion_cost(
                    depth, units, n, p_intra, p_inter, nodes, T, covers, held
                )
                partial_price = adv.price_of(units + (0,) * (K - depth))
                assert partial_price + own <= price + 1e-6, (x, depth, T, own)
                checked += 1
    assert checked > 500


def test_completion_nodes_of_a_partial(open_nodes):
    """Open node-less offers have nodes of unknown size (0); a fixed one its count; groups of a
    node alone grow with the partial's nodes; only the last fixed node or an open one may be last."""
    nb = completion_nodes(open_nodes.offers, (1, 3), nodes=2)
    assert nb.sizes == (1, 3, 2, 0)
    assert nb.groups == (2, 2, 3, 3)
    assert nb.last == (0, 3, 2, 3)
    added = completion_nodes(open_nodes.offers, (1, 3), nodes=2, added=True)
    assert added.groups == (3, 3, 3, 3) and added.last == (0, 0, 2, 3)


@pytest.mark.parametrize("which", ["open_nodes", "open_tight"])
def test_search_equals_brute_force_with_open_node_less_offers(which, request):
    """The search with shard groups, exact, equals planning every cluster, on the inventory and
    each of its sub-inventories with every offer at its most or at half of it."""
    adv = request.getfixturevalue(which)
    table = planned(adv)
    for max_units in itertools.product(*((k, k // 2) for k in adv._max_units)):
        limited = adv.limited_to(
            {o.name: k * o.unit_gpus for o, k in zip(adv.offers, max_units, strict=True)}
        )
        found = limited.search(plans_per_level=None)
        assert found.bound.exact
        got = [(p.cluster, p.samples_per_s) for p in found.frontier]
        assert got == brute_force(adv, table, max_units), max_units
