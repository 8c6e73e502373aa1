"""Pipeline stages as the cost model charges them (issue 40): one formula each, here only.

These formulas are what the planner (planner/stages/) and `cephalo simulate` judge a staged
plan by, and what the pipeline runtime (runtime/pipeline/) does: the same gathers and
reduce-scatters per schedule and `keep_gathered`, the same boundaries in flight, the same tied
exchange.

A staged plan (plan format 3) splits the model's units u = 0 (embedding), 1..L (blocks),
L + 1 (head) into S contiguous ranges, one per stage; stage s runs on whole nodes, every
micro-batch of the step (M of them, B / M samples each) split over its ranks (rank i takes
b_i samples of each), its units' state sharded unevenly over them (fractions s_i summing to
1 in the stage). Per stage and rank, with f_u(b), w_u(b) the profiled forward and recompute +
backward of unit u at b samples and g_u, r_u one all-gather / reduce-scatter of the unit over
the stage's ranks (ring at the stage's slowest link, `CostModel.group_model`):

  per micro-batch   kept gathered (`Stage.keep_gathered`, ZeRO-2-like): c_i = sum_u f_u + w_u
                    gathered per micro-batch: c_i = sum_u max(f_u, g_u) + max(w_u, g_u + r_u)
                    (the head is not gathered again for its backward), as today's engine
                    overlaps a unit's collectives with its neighbour's compute
                    t_s = max_i c_i (a rank with b_i = 0 waits for the others)
  once per step     kept gathered: the stage's gathers beside its first micro-batch's forward
                    F_s, its reduce-scatters beside its last backward W_s:
                    g_first + max(0, G - g_first - F_s) + r_first + max(0, R - r_first - W_s)
                    (G, R the sums over the stage's units); per micro-batch: g_first + r_first;
                    plus the optimizer, max_i s_i x P_s x opt_i (P_s the stage's trained
                    parameters): the stage's overhead o_s
  boundaries        each micro-batch's boundary activation (B / M x seq x hidden x d bytes)
                    crosses the link between stage s and s + 1 forward, its gradient backward:
                    c_l = bytes / link + latency, each direction on its own (full duplex)
  tied embeddings   (the head's weight is the token embedding's, which stage 0 owns): once per
                    step the last stage sends its fp32 gradient of that matrix to the first and
                    gets the updated compute-dtype weights back, vocab x hidden x (4 + d) bytes
                    over the link between them, charged whole (`tied_exchange_s`)
  the step          sum_s t_s + 2 sum_l c_l + (M - 1) max(max_s t_s, max_l c_l) + max_s o_s
                    (+ the tied exchange):
                    the fill and the drain charge every stage and every crossing once (the
                    bubble, (S - 1) / M of the steady state on equal stages), the steady state
                    runs at the slowest stage or link (the crossings hide under it), GPipe and
                    1F1B alike; they differ in memory:
  memory of rank i  state s_i x (the stage's state bytes) + kept gathered: the stage's units in
                    the compute dtype and their fp32 gradients unsharded, per micro-batch: two
                    units and two unit gradients + the boundaries of the micro-batches in
                    flight, each unit's input of b_i samples (1F1B: stage s of S holds
                    min(M, S - s) micro-batches, GPipe all M) and two buffers for the crossing
                    + the largest unit's recompute + backward activations at b_i (the head's
                    at least one chunk of fp32 logits) + the reserve (a share of the device and
                    a GPU's context and communicators: world, stage, the crossing).

The planner's rules (the DP over cuts is exact given them): a stage keeps its weights
gathered where that fits, else gathers per micro-batch; its fractions water-fill its
optimizer (the least max_i s_i x opt_i under each rank's memory left).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo.costmodel.memory import (
    GRAD_BYTES,
    LOGIT_BYTES,
    device_reserve_bytes,
    head_chunk_positions,
)
from cephalo.costmodel.results import MemoryBreakdown, PlanEvaluation, RankCost
from cephalo.errors import CephaloError
from cephalo.planner.plan import SCHEDULES, Plan

STAGE_PROCESS_GROUPS = 2
"""Process groups a staged rank is in beyond the world's: its stage's and the crossing's (three
communicators, as `memory.communicators(2)` counts them)."""


def in_flight(schedule: str, position: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose boundaries stage `position` holds at once: GPipe all M, 1F1B
    min(M, S - s)."""
    if schedule not in SCHEDULES:
        raise CephaloError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, stages - position)


def pipeline_step_s(times, overheads, links, micro_batches: int, extra_s: float = 0.0) -> float:
    """The step of a pipeline (module docstring): per-micro-batch stage times `times`, per-step
    stage overheads `overheads`, per-crossing link times `links`, M micro-batches, `extra_s`
    charged whole (the tied exchange)."""
    return step_of(
        max(times), sum(times), max(overheads, default=0.0), links, micro_batches, extra_s
    )


def step_of(
    max_time: float,
    sum_time: float,
    max_overhead: float,
    links,
    micro_batches: int,
    extra_s: float = 0.0,
) -> float:
    """`pipeline_step_s` from the three numbers of the stages it reads (their largest and total
    time per micro-batch, their largest overhead): what the cut DP (planner/stages/cuts.py)
    keeps per partial cut. Non-decreasing in each, so a partial cut's value is a floor."""
    steady = max(max_time, max(links, default=0.0))
    fill_drain = sum_time + 2 * sum(links)
    return fill_drain + (micro_batches - 1) * steady + max_overhead + extra_s


@dataclass
class StageTables:
    """One stage (its ranks, their micro-batch split, its position in the pipeline) over every
    range of units: arrays [U, U] indexed [first, last] (inf / False where last < first)."""

    time: np.ndarray
    """t_s per micro-batch."""
    overhead: np.ndarray
    """o_s once per step (gathers and reduce-scatters not hidden, the optimizer)."""
    fits: np.ndarray
    keep: np.ndarray
    """Whether the weights stay gathered across micro-batches (the rule, or the plan's)."""
    fractions: np.ndarray
    """[n, U, U] per kind of rank: its state fraction (the rule's, or the plan's)."""
    parts: dict[str, np.ndarray]
    """[n, U, U] per kind of rank: compute (c_i), optimizer, memory categories
    (MemoryBreakdown's)."""
    index: list[int]
    """Per rank of the stage: its kind (the row of `fractions` and `parts`): identical ranks
    doing identical work are computed once."""


class StageCosts:
    """`CostModel`'s methods for pipeline stages (a mixin: reads the model's devices, links,
    profiles and layout; each stage's collectives from its `group_model`)."""

    def stage_model(self, ranks: list[int]):
        """The cost model of one stage's ranks (its ring over its slowest link), memoised."""
        cache = self.__dict__.setdefault("_stage_models", {})
        key = tuple(ranks)
        if key not in cache:
            cache[key] = self.group_model(list(ranks), 1)
        return cache[key]

    @property
    def num_units(self) -> int:
        """Units of the model: embedding, L blocks, head."""
        return self.model.num_layers + 2

    def unit_kinds(self) -> list[str]:
        return ["embedding"] + ["block"] * self.model.num_layers + ["head"]

    def link_s(self, ranks_a: list[int], ranks_b: list[int], micro_samples: int) -> float:
        """One micro-batch's boundary (or its gradient) from one stage to the next: its bytes
        over the slowest link between the two stages' ranks + latency."""
        nbytes = micro_samples * self.sample_boundary_bytes
        if self.links is not None:
            bw = self.links.bytes_per_s([*ranks_a, *ranks_b])
            return nbytes / bw + self.links.latency_s
        return nbytes / self.comm.bytes_per_s + self.comm.latency_s

    def blocks_floor_s(self, groups: list[list[int]], splits: list[list[int]], M: int) -> float:
        """A floor under the step of every cut of these stages (`groups`, each micro-batch split
        `splits`) at M micro-batches: the L blocks alone, stage s running its blocks at its
        slowest rank's block time beta_s (forward + recompute + backward; per micro-batch
        gathering only adds): sum_s t_s >= L min_s beta_s and max_s t_s >= L / sum_s 1/beta_s
        (the best fractional split of the blocks), into `step_of`."""
        cache = self.__dict__.setdefault("_block_times", {})
        betas = []
        for ranks, split in zip(groups, splits, strict=True):
            worst = 0.0
            for r, b in zip(ranks, split, strict=True):
                key = (self.devices[r].type_key, int(b))
                if key not in cache:
                    f, w = self._pass_times(key[0], key[1], max(key[1], 1))["block"]
                    cache[key] = float(f + w)
                worst = max(worst, cache[key])
            betas.append(worst)
        L = self.model.num_layers
        if min(betas) <= 0:
            return 0.0
        return step_of(L / sum(1 / x for x in betas), L * min(betas), 0.0, [], M)

    def tied_exchange_s(self, first: list[int], last: list[int]) -> float:
        """Tied embeddings split between the first and the last stage: the head's fp32 gradient
        of the shared matrix to stage 0 and its updated compute-dtype weights back, once per
        step (0 without tied embeddings, or with one stage)."""
        if not self.model.tied_embeddings or list(first) == list(last):
            return 0.0
        nbytes = self.model.vocab_size * self.model.hidden_size * (GRAD_BYTES + self.dtype_bytes)
        if self.links is not None:
            return nbytes / self.links.bytes_per_s([*first, *last]) + self.links.latency_s
        return nbytes / self.comm.bytes_per_s + self.comm.latency_s

    def stage_tables(
        self,
        ranks: list[int],
        micro: list[int],
        position: int,
        stages: int,
        micro_batches: int,
        schedule: str,
        fractions: list[float] | None = None,
        keep: bool | None = None,
    ) -> StageTables:
        """Every range of units on one stage (module docstring). `fractions` and `keep`: the
        plan's (evaluation); None: the planner's rules."""
        sub = self.stage_model(ranks)
        U = self.num_units
        kinds = self.unit_kinds()
        lay = self.layout.units
        held = np.array([lay[k].held_bytes for k in kinds])
        trained = np.array([float(lay[k].trained) for k in kinds])
        owned = np.array(self.layout.owned_trained, dtype=np.float64)
        total_owned = max(float(owned.sum()), 1.0)
        state = owned / total_owned * self.layout.state_bytes
        gather = np.array([sub.collectives.gather(k) for k in kinds])
        scatter = np.array([sub.collectives.scatter(k) for k in kinds])
        gather_b = np.where(np.arange(U) == U - 1, 0.0, gather)

        def rng(v: np.ndarray) -> np.ndarray:
            """Sums over [a, b]."""
            p = np.concatenate([[0.0], np.cumsum(v)])
            return p[None, 1:] - p[:-1, None]

        first = np.arange(U)[:, None] + np.zeros((1, U))
        valid = np.arange(U)[None, :] >= np.arange(U)[:, None]
        a_idx = np.arange(U)
        L = self.model.num_layers
        has_emb = (a_idx[:, None] == 0) & valid
        has_head = (a_idx[None, :] == U - 1) & valid
        has_block = (np.maximum(a_idx[:, None], 1) <= np.minimum(a_idx[None, :], L)) & valid
        held_max = np.maximum.reduce(
            [
                np.where(has_emb, lay["embedding"].held_bytes, 0.0),
                np.where(has_block, lay["block"].held_bytes, 0.0),
                np.where(has_head, lay["head"].held_bytes, 0.0),
            ]
        )
        grad_max = GRAD_BYTES * np.maximum.reduce(
            [
                np.where(has_emb, lay["embedding"].trained, 0.0),
                np.where(has_block, lay["block"].trained, 0.0),
                np.where(has_head, lay["head"].trained, 0.0),
            ]
        )
        G, R = rng(gather), rng(scatter)
        g_first, r_first = gather[first.astype(int)], scatter[first.astype(int)]
        P = rng(trained)
        state_r = rng(state)
        units_r = rng(np.ones(U))
        held_r, grads_r = rng(held), GRAD_BYTES * P
        flight = in_flight(schedule, position, stages, micro_batches)
        beta = self.sample_boundary_bytes
        # identical ranks doing identical work are computed once (`count` of each)
        idents: dict[tuple, int] = {}
        index = []
        for i, (r, b) in enumerate(zip(ranks, micro, strict=True)):
            dev = self.devices[r]
            own = None if fractions is None else float(fractions[i])
            ident = (dev.type_key, int(dev.memory_bytes), int(b), own)
            index.append(idents.setdefault(ident, len(idents)))
        uniq = list(idents)
        n = len(uniq)
        count = np.bincount(np.array(index), minlength=n).astype(np.float64)
        comp = {True: np.zeros((n, U, U)), False: np.zeros((n, U, U))}
        fwd = np.zeros((n, U, U))
        bwd = np.zeros((n, U, U))
        fixed = {True: np.zeros((n, U, U)), False: np.zeros((n, U, U))}
        mem: dict[str, np.ndarray] = {}
        cats = ("gathered", "grad_accum", "activations", "boundary", "logits", "reserve")
        for c in cats:
            mem[c] = np.zeros((2, n, U, U))
        caps = np.array([float(u[1]) for u in uniq])
        opt_rate = np.array([self.optimizer_s_per_param(u[0]) for u in uniq])
        for i, (key, _mem, b, _own) in enumerate(uniq):
            passes = sub._pass_times(key, int(b), max(int(b), 1))
            f = np.array([float(passes[k][0]) for k in kinds])
            w = np.array([float(passes[k][1]) for k in kinds])
            fwd[i], bwd[i] = rng(f), rng(w)
            comp[True][i] = rng(f + w)
            comp[False][i] = rng(np.maximum(f, gather) + np.maximum(w, gather_b + scatter))
            t = sub._tables[key]
            # the head's pass: its profile curve, never below one chunk of fp32 logits
            chunk = int(head_chunk_positions(b, self.seq_len, self.model.vocab_size))
            logit_bytes = b * chunk * self.model.vocab_size * LOGIT_BYTES
            head_act = max(float(t.act["head"].at(int(b))), logit_bytes) if b else 0.0
            act = np.maximum.reduce(
                [
                    np.where(has_emb, float(t.act["embedding"].at(int(b))), 0.0),
                    np.where(has_block, float(t.act["block"].at(int(b))), 0.0),
                ]
            )
            logits = np.where(has_head, head_act, 0.0)
            boundary = (flight * units_r + 2) * b * beta
            if self.reserve_bytes is not None:
                reserve = float(self.reserve_bytes) + self.reserve_extra_bytes
            else:
                reserve = (
                    int(self.reserve_fraction * caps[i])
                    + device_reserve_bytes(key, STAGE_PROCESS_GROUPS)
                    + self.reserve_extra_bytes
                )
            for m, kept in ((0, True), (1, False)):
                mem["gathered"][m, i] = held_r if kept else np.minimum(2 * held_max, held_r)
                mem["grad_accum"][m, i] = grads_r if kept else np.minimum(2 * grad_max, grads_r)
                mem["activations"][m, i] = act
                mem["logits"][m, i] = logits
                mem["boundary"][m, i] = boundary
                mem["reserve"][m, i] = reserve
                fixed[kept][i] = sum(mem[c][m, i] for c in cats)
        # the fractions: the plan's, or water-filling the optimizer under each rank's memory
        safe_state = np.where(state_r > 0, state_r, 1.0)
        frac = {}
        for kept in (True, False):
            room = (caps[:, None, None] - fixed[kept]) / safe_state
            if fractions is not None:
                own = np.array([u[3] for u in uniq])
                frac[kept] = np.broadcast_to(own[:, None, None], room.shape)
            else:
                frac[kept] = _water_fill(np.maximum(room, 0.0), opt_rate, count)
        F = fwd.max(axis=0)
        W = bwd.max(axis=0)
        out = {}
        for kept in (True, False):
            s = frac[kept]
            total_mem = fixed[kept] + s * state_r
            # + 8: the whole bytes per category an evaluation reports (MemoryBreakdown)
            fits_r = np.all(total_mem + 8 <= caps[:, None, None], axis=0) & valid
            if fractions is None:
                fits_r &= np.abs((s * count[:, None, None]).sum(axis=0) - 1.0) <= 1e-6
            opt = s * P * opt_rate[:, None, None]
            if kept:
                once = g_first + np.maximum(0.0, G - g_first - F) + r_first
                once = once + np.maximum(0.0, R - r_first - W)
            else:
                once = g_first + r_first
            out[kept] = (comp[kept].max(axis=0), once + opt.max(axis=0), fits_r, opt, s)
        if keep is None:
            use_keep = out[True][2] | ~out[False][2]  # kept gathered where it fits
        else:
            use_keep = np.full((U, U), bool(keep))
        pick = lambda a, b: np.where(use_keep, a, b)  # noqa: E731
        time = np.where(valid, pick(out[True][0], out[False][0]), np.inf)
        overhead = np.where(valid, pick(out[True][1], out[False][1]), np.inf)
        fits = pick(out[True][2], out[False][2]) & valid
        m_idx = np.where(use_keep, 0, 1)
        parts = {
            "compute": pick(comp[True], comp[False]),
            "optimizer": pick(out[True][3], out[False][3]),
            "state": pick(out[True][4], out[False][4]) * state_r,
        }
        for c in cats:
            parts[c] = np.where(m_idx[None] == 0, mem[c][0], mem[c][1])
        return StageTables(
            time=time,
            overhead=overhead,
            fits=fits,
            keep=use_keep,
            fractions=pick(out[True][4], out[False][4]),
            parts=parts,
            index=index,
        )

    def check_stages(self, plan: Plan) -> None:
        """What a staged plan must agree on with this cluster and model: the last stage ends at
        the head, every node in one stage."""
        stages = plan.stages or []
        last = stages[-1].units[1]
        if last != self.num_units - 1:
            raise CephaloError(
                f"the plan's last stage ends at unit {last} but {self.model.name} has units "
                f"0..{self.num_units - 1} (embedding 0, blocks 1..{self.model.num_layers}, head "
                f"{self.num_units - 1}): the stages must cover every unit"
            )
        if self.links is not None:
            owner: dict[int, int] = {}
            for i, st in enumerate(stages):
                for r in st.ranks:
                    node = self.links.node_of[r]
                    if owner.setdefault(node, i) != i:
                        raise CephaloError(
                            f"node {node} has ranks in stage {owner[node]} and in stage {i}: a "
                            "stage is made of whole nodes (its ranks share the node's link for "
                            "the crossing); give each node's ranks to one stage (a cluster "
                            "spec marks its nodes with @nodeK)"
                        )

    def _evaluate_stages(self, plan: Plan) -> PlanEvaluation:
        """A staged plan: each stage's ranks at its range, the pipeline's step on every rank."""
        self.check_stages(plan)
        stages = plan.stages or []
        M = int(plan.num_micro_batches or 1)
        S = len(stages)
        micro_samples = plan.global_batch_size // M
        times, overheads, rows = [], [], []
        for pos, st in enumerate(stages):
            micro = [
                plan.ranks[r].micro_batch_size if plan.ranks[r].batch_size else 0 for r in st.ranks
            ]
            tab = self.stage_tables(
                st.ranks,
                micro,
                pos,
                S,
                M,
                plan.schedule or "1f1b",
                fractions=[plan.ranks[r].state_fraction for r in st.ranks],
                keep=st.keep_gathered,
            )
            a, b = st.units
            times.append(float(tab.time[a, b]))
            overheads.append(float(tab.overhead[a, b]))
            rows.append((st, tab, a, b))
        links = [
            self.link_s(stages[i].ranks, stages[i + 1].ranks, micro_samples) for i in range(S - 1)
        ]
        tied = self.tied_exchange_s(stages[0].ranks, stages[-1].ranks)
        step = pipeline_step_s(times, overheads, links, M, tied)
        costs: list[RankCost] = [None] * plan.world_size  # type: ignore[list-item]
        for st, tab, a, b in rows:
            for i, r in enumerate(st.ranks):
                p = {k: float(v[tab.index[i], a, b]) for k, v in tab.parts.items()}
                memory = MemoryBreakdown(
                    **{
                        c: int(math.ceil(p[c]))
                        for c in (
                            "state",
                            "gathered",
                            "grad_accum",
                            "activations",
                            "boundary",
                            "logits",
                            "reserve",
                        )
                    }
                )
                node = self.host.node_of[r] if self.host is not None else 0
                costs[r] = RankCost(
                    rank=r,
                    device=self.devices[r].type_key,
                    step_s=step,
                    compute_s=M * p["compute"],
                    optimizer_s=p["optimizer"],
                    comm_s=sum(links),
                    host_copy_s=0.0,
                    memory=memory,
                    capacity_bytes=self.capacity_bytes(r),
                    node=node,
                    host_capacity_bytes=self.host.memory_bytes[node]
                    if self.host is not None
                    else None,
                )
        return PlanEvaluation(
            ranks=costs, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len
        )


def _water_fill(room: np.ndarray, opt_rate: np.ndarray, count: np.ndarray) -> np.ndarray:
    """[n, U, U] fractions s_i = min(room_i, lam / opt_i) of n kinds of rank (`count` of each),
    lam the least with sum_i count_i s_i = 1 (the least max_i s_i x opt_i under the memory caps
    `room`); where the caps sum below 1 the fractions sum below 1 (the range does not fit)."""
    rate = opt_rate[:, None, None]
    weight = count[:, None, None]
    lo = np.zeros(room.shape[1:])
    hi = np.full(room.shape[1:], float(opt_rate.max()))
    for _ in range(32):  # 2^-32 of the largest rate: the fractions are normalised below
        mid = (lo + hi) / 2
        enough = (np.minimum(room, mid / rate) * weight).sum(axis=0) >= 1.0
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid)
    s = np.minimum(room, hi / rate)
    total = (s * weight).sum(axis=0)
    # exactly 1 where it fits (the bisection leaves it a hair above)
    return np.where(total >= 1.0, s / np.where(total > 0, total, 1.0), s)
