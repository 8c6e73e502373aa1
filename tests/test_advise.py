"""`cephalo advise`: the search equals planning every cluster, its bound holds, its throughputs
are `cephalo plan`'s, marginal values, and bad input."""

import itertools
import json
import math

import numpy as np
import pytest

from cephalo.advise.advisor import Advisor
from cephalo.advise.results import select_frontier
from cephalo.cli import main
from cephalo.costmodel.sources import build_cost_model
from cephalo.errors import CephaloError
from cephalo.planner.group_split import GroupPlanMemo
from cephalo.planner.shard_groups import candidate_groupings, make_hierarchical_plan, plan_grouping
from cephalo.specs.cluster import Cluster
from cephalo.specs.offers import Offers

# a small catalog model and batch keep each planner call cheap; four offers of four types
SMALL = ("bert-base", 512, "fp32", 8)
SMALL_OFFERS = {
    "offer": [
        {"type": "t4", "max_count": 4, "price_per_hour": 0.35},
        {"type": "p40", "max_count": 4, "price_per_hour": 0.30},
        {"type": "l4", "max_count": 4, "price_per_hour": 0.80},
        {"type": "a6000", "max_count": 4, "price_per_hour": 0.79},
    ]
}
# a model whose state does not fit on one 16 GiB GPU (unless most of it is kept in host
# memory: the `tight` advisor keeps all state on the GPUs, `tight_host` may not), nodes of 2,
# a slow network
TIGHT = ("llama-1.1b", 512, "fp32", 16)
TIGHT_OFFERS = {
    "offer": [
        {"type": "t4", "max_count": 3, "price_per_hour": 0.35},
        {
            "type": "l4",
            "max_count": 4,
            "price_per_hour": 0.80,
            "per_node": 2,
            "inter_node_bandwidth": "3GB/s",
        },
        {"type": "p100", "max_count": 3, "price_per_hour": 0.40, "intra_node_bandwidth": "8GB/s"},
    ]
}
# nodes of one GPU (their own groups hold whole replicas: no collectives inside a group) and of
# two, each offer on a slower network: shard groups win on most clusters of several nodes
# (`grouped`: one group per node; `grouped_tight`: llama-1.1b does not fit a T4's memory
# without host state, so groups of 2 nodes), which the bound must allow for and the search
# must still equal brute force on
GROUPED = ("bert-base", 512, "fp32", 8)
GROUPED_OFFERS = {
    "offer": [
        {"type": "t4", "max_count": 3, "price_per_hour": 0.35, "per_node": 1,
         "inter_node_bandwidth": "1GB/s"},
        {"type": "l4", "max_count": 4, "price_per_hour": 0.80, "per_node": 2,
         "inter_node_bandwidth": "2GB/s"},
        {"type": "a6000", "max_count": 2, "price_per_hour": 0.79},
    ]
}  # fmt: skip
GROUPED_TIGHT_OFFERS = {
    "offer": [
        {"type": "t4", "max_count": 3, "price_per_hour": 0.35, "per_node": 1,
         "inter_node_bandwidth": "1GB/s"},
        {"type": "l4", "max_count": 4, "price_per_hour": 0.80, "per_node": 2,
         "inter_node_bandwidth": "3GB/s"},
        {"type": "p100", "max_count": 2, "price_per_hour": 0.40, "intra_node_bandwidth": "8GB/s"},
    ]
}  # fmt: skip


def make_advisor(
    settings,
    offers,
    allow_host_state: bool = True,
    hierarchy: bool = True,
    reduce_dtype: str = "fp32",
) -> Advisor:
    model, seq, dtype, batch = settings
    return Advisor(
        Offers.from_dict(offers),
        lambda spec: build_cost_model(spec, model, seq, dtype),
        batch,
        allow_host_state=allow_host_state,
        hierarchy=hierarchy,
        reduce_dtype=reduce_dtype,
    )


@pytest.fixture(scope="module")
def small():
    # flat plans keep planning all 624 clusters affordable; the tight inventories (nodes of 2,
    # a slow network) check the search with shard groups
    return make_advisor(SMALL, SMALL_OFFERS, hierarchy=False)


@pytest.fixture(scope="module")
def tight():
    return make_advisor(TIGHT, TIGHT_OFFERS, allow_host_state=False)


@pytest.fixture(scope="module")
def tight_host():
    return make_advisor(TIGHT, TIGHT_OFFERS)


@pytest.fixture(scope="module")
def grouped():
    return make_advisor(GROUPED, GROUPED_OFFERS, reduce_dtype="bf16")


@pytest.fixture(scope="module")
def grouped_tight():
    return make_advisor(TIGHT, GROUPED_TIGHT_OFFERS, allow_host_state=False, reduce_dtype="bf16")


@pytest.fixture(scope="module")
def grouped_tight_host():
    # a T4 alone in its group holds llama-1.1b's whole state only with part of it on the host
    return make_advisor(TIGHT, GROUPED_TIGHT_OFFERS, reduce_dtype="bf16")


def planned(adv: Advisor) -> dict[tuple, float | None]:
    """The planner's throughput of every count vector (cached in the advisor)."""
    out = {}
    for units in itertools.product(*(range(k + 1) for k in adv._max_units)):
        if any(units):
            out[units] = adv.samples_per_s(adv.cluster_of(units).to_spec())
    return out


def brute_force(adv: Advisor, table, max_units) -> list[tuple[str, float]]:
    """The frontier of every count vector within `max_units`, from the planner's table."""
    records = [
        (adv.price_of(units), sps, (int(np.dot(units, adv._unit_gpus)), units))
        for units, sps in table.items()
        if sps is not None
    ]
    return _frontier_within(adv, records, max_units)


def _frontier_within(adv: Advisor, records, max_units) -> list[tuple[str, float]]:
    inside = [r for r in records if all(u <= m for u, m in zip(r[2][1], max_units, strict=True))]
    return [(adv.cluster_of(k[1]).to_spec(), s) for _, s, k in select_frontier(inside)]


@pytest.mark.parametrize(
    "which", ["small", "tight", "tight_host", "grouped", "grouped_tight", "grouped_tight_host"]
)
def test_search_equals_brute_force_on_every_inventory(which, request):
    """Every inventory of up to 4 types x 0..4 GPUs (and the tight one's every sub-inventory):
    the search's frontier is exactly the brute-force one, clusters and throughputs."""
    adv = request.getfixturevalue(which)
    table = planned(adv)
    records = [
        (adv.price_of(units), sps, (int(np.dot(units, adv._unit_gpus)), units))
        for units, sps in table.items()
        if sps is not None
    ]
    checked = 0
    for max_units in itertools.product(*(range(k + 1) for k in adv._max_units)):
        limited = adv.limited_to(
            {o.name: k * o.unit_gpus for o, k in zip(adv.offers, max_units, strict=True)}
        )
        found = limited.search(plans_per_level=None)
        assert found.bound.exact
        got = [(p.cluster, p.samples_per_s) for p in found.frontier]
        assert got == _frontier_within(adv, records, max_units), max_units
        checked += 1
    assert checked == int(np.prod(adv._max_units + 1))
    if which == "small":
        assert checked == 625
        assert len(brute_force(adv, table, adv._max_units)) >= 8  # a frontier worth the name


@pytest.mark.parametrize(
    "which", ["small", "tight", "tight_host", "grouped", "grouped_tight", "grouped_tight_host"]
)
def test_bound_holds_for_every_cluster(which, request):
    """No plan beats the bound the search prunes with; a cluster whose bound is 0 because its
    state cannot fit is one the planner cannot fit either."""
    adv = request.getfixturevalue(which)
    for units, sps in planned(adv).items():
        ub = adv.upper_bound(units)
        if sps is None:
            continue
        assert sps <= ub * (1 + 1e-12), (units, sps, ub)
        assert ub > 0
    if which == "tight":
        # one T4 cannot hold llama-1.1b's state: the bound knows it without planning
        assert adv.upper_bound((1, 0, 0)) == 0.0
        assert adv.samples_per_s(adv.cluster_of((1, 0, 0)).to_spec()) is None
    if which == "tight_host":
        # with most of its state in host memory one T4 trains it, and the bound knows it can
        sps = adv.samples_per_s(adv.cluster_of((1, 0, 0)).to_spec())
        assert sps is not None and 0 < sps <= adv.upper_bound((1, 0, 0))


@pytest.mark.parametrize("which", ["grouped", "grouped_tight", "grouped_tight_host"])
def test_shard_groups_bound(which, request):
    """Where shard groups win: each candidate grouping's floor (the bound the planner skips
    groupings with) is below its plan's step, and infinite only where the grouping has no plan;
    the advisor's answer is the planner's without the floors; and the bound stays close to the
    planner's throughput (a bound that dropped the groups' collectives or their all-reduce
    would plan far more clusters).

    The test's own plans share one `GroupPlanMemo` (as the advisor's do; a memo's plans are
    the ones planned afresh, test_group_plan_memo): the clusters repeat groups, and
    `make_hierarchical_plan` plans the groupings `plan_grouping` just planned. It is not the
    advisor's memo, and the floors are not given: the comparison stays independent."""
    adv = request.getfixturevalue(which)
    model, seq, dtype, batch = GROUPED if which == "grouped" else TIGHT
    kw = {"allow_host_state": which != "grouped_tight"}
    labels, hierarchical = set(), 0
    memo = GroupPlanMemo()
    for units, sps in planned(adv).items():
        cm = build_cost_model(adv.cluster_of(units).to_spec(), model, seq, dtype)
        for grouping in candidate_groupings(cm):
            floor = adv._bounds.grouping_floor(cm, grouping.groups)
            res = plan_grouping(cm, batch, grouping, "bf16", memo, **kw)
            if res.plan is None:
                continue
            assert math.isfinite(floor) and floor <= res.step_s * (1 + 1e-12), (units, grouping)
        if sps is None:
            continue
        plan = make_hierarchical_plan(cm, batch, reduce_dtype="bf16", memo=memo, **kw)
        assert plan.predicted.samples_per_s == sps, units
        hierarchical += plan.hierarchical
        labels.add(plan.meta.get("grouping"))
        assert sps >= 0.9 * adv.upper_bound(units), units
    assert hierarchical >= 15
    assert labels >= ({"2 nodes"} if which == "grouped_tight" else {"per node"})
    if which == "grouped_tight_host":  # the bound of a T4 alone: state partly on the host
        assert 0 < adv.types["t4"].solo.host_part < 1


def test_links_and_nodes_of_the_clusters(tight):
    """Offers on their own nodes, nodes of per_node GPUs, links the slowest offer's."""
    c = tight.cluster_of((2, 2, 1))
    assert c.to_spec() == "2xt4@node0,2xl4@node1-2,p100@node3;intra=8GB/s;inter=3GB/s"
    assert c.num_nodes == 4 and c.slowest_link_bytes_per_s() == 3e9
    assert Cluster.parse(c.to_spec()).to_dict() == c.to_dict()
    assert tight.cluster_of((3, 0, 0)).to_spec() == "3xt4"  # one node, the type's own link


def test_tolerance_keeps_its_promise(small):
    """With the tolerance raised after a few plans, every cluster has at most (1 + g) times
    the throughput the found frontier reaches at its price; below `exact_below` it is exact."""
    table = planned(small)
    found = small.search(plans_per_level=3)
    assert not found.bound.exact and found.bound.tolerance > 0
    g = found.bound.tolerance
    points = [(round(p.price_per_hour * 1e6), p.samples_per_s) for p in found.frontier]
    for units, sps in table.items():
        if sps is None:
            continue
        price = small.price_of(units)
        reached = max((s for p, s in points if p <= price), default=0.0)
        assert sps <= (1 + g) * reached * (1 + 1e-9), (units, sps, reached)
    below = found.bound.exact_below_price
    got = [(p.cluster, p.samples_per_s) for p in found.frontier if p.price_per_hour < below]
    exact = brute_force(small, table, small._max_units)
    assert got == [(c, s) for c, s in exact if small.price_of(_units(small, c)) / 1e6 < below]
    assert got  # the exact part is not empty


def _units(adv: Advisor, spec: str) -> tuple[int, ...]:
    for units in itertools.product(*(range(k + 1) for k in adv._max_units)):
        if any(units) and adv.cluster_of(units).to_spec() == spec:
            return units
    raise AssertionError(spec)


@pytest.mark.parametrize("flat", [False, True])
def test_frontier_throughput_is_what_cephalo_plan_reports(flat, tmp_path):
    """Each E.cluster, planned by `cephalo plan --cluster E.cluster`, gives E.samples_per_s: with
    shard groups (a cluster of several offers is several nodes) and without (--no-hierarchy)."""
    model, seq, dtype, batch = TIGHT
    adv = Advisor(
        Offers.from_dict(TIGHT_OFFERS),
        lambda spec: build_cost_model(spec, model, seq, dtype),
        batch,
        allow_host_state=False,
        hierarchy=not flat,
        reduce_dtype="bf16",
    )
    found = adv.search()
    assert any(";" in p.cluster for p in found.frontier)  # the links travel in the spec
    grouped = 0
    for p in found.frontier:
        out = tmp_path / "plan.json"
        rc = main(
            ["plan", "--cluster", p.cluster, "--model", model, "--seq-len", str(seq),
             "--dtype", dtype, "--global-batch", str(batch), "--json", str(out),
             "--no-host-state", "--cross-node-reduce-dtype", "bf16"]
            + (["--no-hierarchy"] if flat else [])
        )  # fmt: skip
        assert rc == 0
        plan = json.loads(out.read_text())
        assert plan["predicted"]["samples_per_s"] == p.samples_per_s
        grouped += len(plan.get("shard_groups") or []) > 1
    # shard groups pay on the slow network between the offers' nodes (and never without them)
    assert (grouped > 0) == (not flat), grouped


def test_marginal_values_are_planner_answers(small):
    """Without one device / with one more unit: each number is the planner's for that cluster;
    pays_for_itself compares price per sample with and without."""
    units = (1, 2, 0, 1)
    m = small.marginal("chosen", units=units)
    base = small.samples_per_s(small.cluster_of(units).to_spec())
    assert m.samples_per_s == base
    assert {d.offer for d in m.devices} == {"t4", "p40", "a6000"}
    price = small.price_of(units) / 1e6
    for d in m.devices:
        assert d.samples_per_s_without == small.samples_per_s(d.cluster_without)
        assert math.isclose(d.tokens_per_s_lost, (base - d.samples_per_s_without) * 512)
        assert d.pays_for_itself == (
            price / base <= (price - d.price_per_hour) / d.samples_per_s_without
        )
    assert {a.offer for a in m.additions} == {"t4", "p40", "l4", "a6000"}
    for a in m.additions:
        assert a.samples_per_s_with == small.samples_per_s(a.cluster_with)
    best = m.best_to_add
    assert best is not None
    assert best.tokens_per_s_per_usd == max(a.tokens_per_s_per_usd for a in m.additions)


def test_marginal_values_of_an_owned_cluster(small):
    have = Cluster.parse("2xl4,a6000")
    m = small.marginal("have", have=have)
    assert m.cluster == "2xl4,a6000"
    assert [d.type for d in m.devices] == ["l4", "a6000"]
    assert m.price_per_hour == pytest.approx(2 * 0.8 + 0.79)
    for a in m.additions:  # rented GPUs join on a node of their own
        with_it = Cluster.parse(a.cluster_with)
        assert with_it.num_nodes == 2 and with_it.devices[-1].node == 1
    # a type that is not among the offers has no price, so no verdict
    m2 = small.marginal("have", have=Cluster.parse("2xl4,a10g"))
    assert m2.price_per_hour is None
    assert all(d.pays_for_itself is None for d in m2.devices)


def test_types_without_a_profile_are_left_out_with_a_note():
    """gpt-test has published profiles for a6000, l4 and p40 only."""
    offers = {
        "offer": [
            {"type": "l4", "max_count": 2, "price_per_hour": 0.8},
            {"type": "t4", "max_count": 2, "price_per_hour": 0.35},
        ]
    }
    adv = make_advisor(("gpt-test", 512, "fp32", 4), offers)
    assert [o.name for o in adv.offers] == ["l4"]
    assert len(adv.left_out) == 1 and adv.left_out[0].startswith("t4: left out")
    with pytest.raises(CephaloError, match="no offer can run this model"):
        make_advisor(("gpt-test", 512, "fp32", 4), {"offer": [offers["offer"][1]]})


# ---------------------------------------------------------------------- the command
def advise(tmp_path, offers: dict, *extra: str, settings=SMALL):
    path = tmp_path / "offers.json"
    path.write_text(json.dumps(offers))
    model, seq, dtype, batch = settings
    args = ["advise", "--offers", str(path), "--model", model, "--seq-len", str(seq),
            "--dtype", dtype, "--global-batch", str(batch), *extra]  # fmt: skip
    return main(args)


def test_cli_json_contract(tmp_path, capsys):
    out = tmp_path / "advice.json"
    png = tmp_path / "advice.png"
    # flat plans (--no-hierarchy) keep the CLI's tests fast; the Advisor's own tests and the
    # tight inventory below plan with shard groups
    rc = advise(
        tmp_path, SMALL_OFFERS, "--budget", "3", "--target-tokens-per-s", "4000",
        "--have", "2xl4", "--json", str(out), "--plot", str(png), "--no-hierarchy",
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "frontier" in text and "exact" in text
    d = json.loads(out.read_text())
    assert set(d) >= {"frontier", "best_under_budget", "cheapest_meeting_target", "marginal"}
    keys = {"cluster", "price_per_hour", "samples_per_s", "tokens_per_s", "usd_per_million_tokens"}
    prices = [e["price_per_hour"] for e in d["frontier"]]
    assert prices == sorted(prices)
    for e in d["frontier"]:
        assert keys <= set(e)
        assert e["tokens_per_s"] == e["samples_per_s"] * 512
        assert math.isclose(
            e["usd_per_million_tokens"], e["price_per_hour"] / (e["tokens_per_s"] * 3600) * 1e6
        )
    best = d["best_under_budget"]
    assert best["price_per_hour"] <= 3
    assert best == max(
        (e for e in d["frontier"] if e["price_per_hour"] <= 3), key=lambda e: e["samples_per_s"]
    )
    cheapest = d["cheapest_meeting_target"]
    assert cheapest["tokens_per_s"] >= 4000
    assert cheapest == min(
        (e for e in d["frontier"] if e["tokens_per_s"] >= 4000), key=lambda e: e["price_per_hour"]
    )
    assert [m["base"] for m in d["marginal"]] == ["chosen", "have"]
    assert d["marginal"][0]["cluster"] == best["cluster"]
    assert d["marginal"][1]["cluster"] == "2xl4"
    assert png.stat().st_size > 10_000


def test_cli_budget_that_buys_nothing_names_the_cheapest_that_fits(tmp_path, capsys):
    rc = advise(tmp_path, TIGHT_OFFERS, "--budget", "0.5", "--no-host-state", settings=TIGHT)
    assert rc == 2
    err = capsys.readouterr().err
    assert "no cluster the offers allow fits llama-1.1b within $0.50/h" in err
    assert "the cheapest that does is 2xt4 at $0.70/h" in err


def test_cli_target_no_cluster_meets(tmp_path, capsys):
    out = tmp_path / "a.json"
    rc = advise(
        tmp_path, SMALL_OFFERS, "--target-tokens-per-s", "1e9", "--json", str(out), "--no-hierarchy"
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "no cluster the offers allow reaches 1,000,000,000 tokens/s" in err
    assert "the most is" in err
    d = json.loads(out.read_text())  # the answer is still written
    assert d["cheapest_meeting_target"] is None and d["frontier"]


@pytest.mark.parametrize(
    "offer, message",
    [
        ({"type": "a100x8", "max_count": 2, "price_per_hour": 1.0}, "Did you mean 'a100x80'"),
        ({"type": "l4", "max_count": 2, "price_per_hour": -0.8}, "price_per_hour is negative"),
        ({"type": "l4", "max_count": 2}, "`price_per_hour` is missing"),
        ({"type": "l4", "max_count": 2, "price_per_hour": "cheap"}, "must be a number"),
        (
            {"type": "l4", "max_count": 0, "price_per_hour": 0.8},
            "max_count must be an integer >= 1",
        ),
        ({"type": "l4", "price_per_hour": 0.8}, "`max_count` is required"),
        ({"type": "l4", "max_count": 6, "price_per_hour": 0.8, "per_node": 4}, "use 4 or 8"),
        ({"type": "l4", "max_count": 2, "price_per_hour": 0.8, "colour": 1}, "unknown key"),
        ({"type": "l4", "max_count": 2, "price_per_hour": 9e9}, "per GPU, not per node"),
    ],
    ids=[
        "unknown type",
        "negative price",
        "missing price",
        "price not a number",
        "no GPUs",
        "missing max_count",
        "not whole nodes",
        "unknown key",
        "price per node",
    ],
)
def test_bad_offers_get_one_clear_error(tmp_path, capsys, offer, message):
    rc = advise(tmp_path, {"offer": [offer]})
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("cephalo advise: error: ") and message in err
    assert "Traceback" not in err


def test_bad_offers_files(tmp_path):
    bad = tmp_path / "o.toml"
    bad.write_text("[[offer]\ntype = 'l4'")
    with pytest.raises(CephaloError, match="cannot parse offers file"):
        Offers.from_file(bad)
    with pytest.raises(CephaloError, match="cannot read offers file"):
        Offers.from_file(tmp_path / "missing.toml")
    with pytest.raises(CephaloError, match="no offers"):
        Offers.from_dict({"offer": []})
    with pytest.raises(CephaloError, match="used twice"):
        Offers.from_dict(
            {"offer": [{"name": "x", "type": "l4", "max_count": 1, "price_per_hour": 1}] * 2}
        )
    # the same type twice without names gets numbered names
    two = Offers.from_dict(
        {"offer": [{"type": "l4", "max_count": 1, "price_per_hour": p} for p in (1, 2)]}
    )
    assert [o.name for o in two] == ["l4#0", "l4#1"]


def test_example_offers_file_parses_with_sources():
    offers = Offers.from_file("configs/offers-example.toml")
    assert len(offers) >= 6
    for o in offers:
        assert o.source and o.source.startswith("https://") and o.as_of


def test_cli_have_that_cannot_hold_the_model(tmp_path, capsys):
    rc = advise(tmp_path, TIGHT_OFFERS, "--have", "t4", "--no-host-state", settings=TIGHT)
    assert rc == 2
    err = capsys.readouterr().err
    assert "T4 (16 GiB) cannot train llama-1.1b at global batch 16: llama-1.1b does not fit" in err


def test_cli_plans_with_shard_groups_unless_told_not_to(tmp_path, capsys):
    """A frontier cluster of several nodes is planned as `cephalo plan` plans it: with shard
    groups by default (the all-reduce between them in --cross-node-reduce-dtype), flat with
    --no-hierarchy."""
    answers = {}
    for flags in ((), ("--no-hierarchy",), ("--cross-node-reduce-dtype", "bf16")):
        out = tmp_path / "a.json"
        assert advise(tmp_path, TIGHT_OFFERS, "--json", str(out), "--no-host-state", *flags,
                      settings=TIGHT) == 0  # fmt: skip
        answers[flags] = {
            e["cluster"]: e["samples_per_s"] for e in json.loads(out.read_text())["frontier"]
        }
    model, seq, dtype, batch = TIGHT
    for flags, frontier in answers.items():
        for spec, sps in frontier.items():
            cm = build_cost_model(spec, model, seq, dtype)
            plan = make_hierarchical_plan(
                cm, batch, hierarchy="--no-hierarchy" not in flags,
                reduce_dtype="bf16" if "bf16" in flags else "fp32", allow_host_state=False,
            )  # fmt: skip
            assert plan.predicted.samples_per_s == sps
    # shard groups pay somewhere on this slow network: the frontier differs from the flat one
    assert answers[()] != answers[("--no-hierarchy",)]
