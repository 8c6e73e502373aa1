"""The tables one plan's searches share (rank_tables.TableCache) and the T-independent terms of
cap(b; T) (rank_capacity.HostCapTerms) change no plan: every plan equals, bit for bit, the plan
made with every search tabulating afresh and every cap computed from scratch."""

import numpy as np
import pytest

import cephalo.planner.search.capacity as rank_capacity
import cephalo.planner.search.rank_tables as rank_tables
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.planner.makers import make_plan
from cephalo.planner.search.rank_tables import SearchRegime, TableCache, rank_groups, tabulate
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

# GPU clusters (padding backend) where the padded search runs its sub-searches: near-even
# splits without host state, and one with host state (its searches both with and without)
CLUSTERS = [
    ("2xl4,2xa6000", "llama-7b", 32, 1024, "bf16"),
    ("3xa6000,3xl4", "llama-7b", 96, 512, "bf16"),
    ("2xrtx3090,2xrtx3060", "llama-7b", 16, 512, "fp16"),
]


def _cm(spec: str, model: str, seq: int, dtype: str):
    return catalog_cost_model(Cluster.parse(spec), get_model_spec(model), seq, dtype)


def _plan_dict(plan) -> dict:
    d = plan.to_dict()
    d["meta"].pop("planner_wall_s", None)
    return d


def _fresh_tables(cache: TableCache, g, bmax: int, allowed: SearchRegime):
    """`TableCache.tables` that keeps nothing: every search tabulates afresh."""
    return rank_tables._tables(cache.cm, g, bmax, allowed)


def _fresh_terms(cm, g, pad: float):
    """`rank_capacity._group_host_terms` that keeps nothing: every cap from scratch."""
    g.host_cap_terms = None
    return _group_host_terms(cm, g, pad)


_group_host_terms = rank_capacity._group_host_terms


@pytest.mark.parametrize("spec, model, B, seq, dtype", CLUSTERS)
def test_plans_equal_those_made_without_the_cache(monkeypatch, spec, model, B, seq, dtype):
    cm = _cm(spec, model, seq, dtype)
    assert cm.padded_collectives
    made = []
    tables = rank_tables._tables

    def counted(*args):
        made.append(args[2])
        return tables(*args)

    monkeypatch.setattr(rank_tables, "_tables", counted)
    cached = make_plan(cm, B)
    with_cache = len(made)

    made.clear()
    monkeypatch.setattr(TableCache, "tables", _fresh_tables)
    monkeypatch.setattr(rank_capacity, "_group_host_terms", _fresh_terms)
    fresh = make_plan(_cm(spec, model, seq, dtype), B)
    assert _plan_dict(cached) == _plan_dict(fresh)
    assert [r.state_fraction for r in cached.ranks] == [r.state_fraction for r in fresh.ranks]
    # the sub-searches repeat tables: the cache makes fewer of them
    assert with_cache < len(made)


def test_cached_tables_are_shared_and_read_only():
    cm = _cm("2xl4,2xa6000", "llama-7b", 1024, "bf16")
    cache = TableCache(cm)
    allowed = SearchRegime(offload=True, host=True)
    a, b = rank_groups(cm, allowed)[0], rank_groups(cm, allowed)[0]
    tabulate(cm, a, 16, allowed, cache)
    tabulate(cm, b, 16, allowed, cache)
    assert a.time is b.time and a.memcap is b.memcap
    with pytest.raises(ValueError):
        a.time[0, 0] = 0.0
    # another charge or batch range: other tables
    tabulate(cm, b, 16, SearchRegime(offload=True, host=True, pad=0.3), cache)
    assert a.time is not b.time
    fresh = rank_groups(cm, allowed)[0]
    tabulate(cm, fresh, 16, allowed)
    for name in ("time", "memcap", "micro", "offload", "overlap", "host_boundary"):
        assert np.array_equal(getattr(a, name), getattr(fresh, name))


def test_host_terms_follow_the_tables_and_the_charge():
    """A group's cap terms are made for its tables and charge: new tables or another charge
    give the caps computed from scratch."""
    cm = _cm("2xrtx3090,2xrtx3060", "llama-7b", 512, "fp16")
    for pad in (0.0, 0.27):
        allowed = SearchRegime(offload=True, host=True, pad=pad)
        g = rank_groups(cm, allowed)[0]
        for bmax in (8, 16):
            tabulate(cm, g, bmax, allowed)
            for T in (1.0, 3.4, 10.0):
                f, best = rank_capacity.capacity(g, T, cm, allowed)
                g_new = rank_groups(cm, allowed)[0]
                tabulate(cm, g_new, bmax, allowed)
                f_new, best_new = rank_capacity.capacity(g_new, T, cm, allowed)
                assert np.array_equal(f, f_new) and np.array_equal(best, best_new)
            # the terms kept on the group are those of its current tables and charge
            assert g.host_cap_terms is not None and g.host_cap_terms[0] == pad
