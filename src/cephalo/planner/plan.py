"""Plan: what each rank does in one training step. A plain value, saved as versioned JSON.

The planner writes it, `cephalo simulate` evaluates it, the runtime executes it. The format is
documented in docs/plan-format.md; `Plan.from_json` validates everything a hand-written plan
can get wrong and raises `CephaloError` with a message that names the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError

PLAN_FORMAT_VERSION = 3
"""Version 2 added `shard_groups` and `cross_group_reduce_dtype` (hierarchical sharding),
version 3 `stages`, `schedule` and `num_micro_batches` (pipeline stages, issue 40)."""
READABLE_VERSIONS = (1, 2, 3)
"""Versions this cephalo reads: a version-1 or -2 plan is one stage (no `stages`)."""
REDUCE_DTYPES = ("fp32", "bf16")
SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules a staged plan may name: GPipe (every micro-batch's forward, then every
backward: a stage holds all M micro-batches' boundaries) and 1F1B (one forward, one backward
in the steady state: stage s of S holds min(M, S - s))."""
STRATEGIES = ("cephalo", "even", "proportional", "manual")
DTYPES = ("fp32", "bf16", "fp16")
# state fractions must sum to 1 within this tolerance (JSON round-trips floats exactly,
# hand-written plans write 0.33 + 0.33 + 0.34)
FRACTION_SUM_TOL = 1e-4


@dataclass
class RankPlan:
    """One rank's share of the step."""

    rank: int
    """Global rank (position in the cluster's device list)."""
    device: str
    """Device type key, e.g. `l4`, `a6000`, `cpu:slowdown=2`."""
    batch_size: int
    """Samples of the global batch this rank processes (may be 0: a memory-only rank)."""
    micro_batch_size: int
    """Samples per micro-batch (>= 1)."""
    num_micro_batches: int
    """ceil(batch_size / micro_batch_size); the last micro-batch may be smaller."""
    state_fraction: float
    """Fraction of every unit's parameters / gradients / optimizer state this rank owns."""
    offload_activations: bool = False
    """Keep layer-boundary activations on the host instead of the device."""
    host_state_fraction: float = 0.0
    """Part of this rank's state shard (fp32 master, gradient, Adam moments) kept in host memory
    and updated by the host CPU: 0 = all on the device, 1 = all on the host. The device keeps
    only the compute-dtype copy of that part, for the all-gathers."""
    overlap_reduce: bool = True
    """Reduce-scatter a unit's gradient while the next unit's backward computes (one more fp32
    unit gradient on the device); False: wait for it at once (a rank short of memory)."""
    fuse_tail: bool = True
    """Run the last block's forward and backward in the head's pass where the model and this
    rank allow it (costmodel/rules.py: no recompute of the last block, more memory in that
    pass); False: the unfused order. The planner chooses it per rank."""
    predicted_step_s: float | None = None
    """Cost-model step time of this rank alone (busy time), seconds."""
    predicted_peak_memory_bytes: int | None = None
    """Cost-model peak device memory of this rank, bytes."""
    predicted_host_bytes: int | None = None
    """Cost-model host memory of this rank (host state and offloaded activations), bytes."""

    def micro_batch_sizes(self) -> list[int]:
        """The micro-batches the engine runs, in order: full ones of `micro_batch_size`, the
        last one what is left (24 in micro-batches of 15: [15, 9])."""
        m = self.micro_batch_size
        return [min(m, self.batch_size - a) for a in range(0, self.batch_size, m)]

    def micro_batches_text(self) -> str:
        """The micro-batches as a table shows them: `8x3` when they are equal, `15+9` or
        `15x3+5` when the last is smaller (never `15x2` for a batch of 24), `-` for none."""
        sizes = self.micro_batch_sizes()
        if not sizes:
            return "-"
        full = sizes.count(sizes[0])
        text = f"{sizes[0]}x{full}" if full > 1 or len(sizes) == 1 else f"{sizes[0]}"
        return text + (f"+{sizes[-1]}" if sizes[-1] != sizes[0] else "")


@dataclass
class ShardGroup:
    """Ranks that hold one whole replica of the training state between them (uneven shards over
    the group's links); groups all-reduce their gradient shards once per step. An object, not a
    bare list, so a later stage (pipeline parallelism) can carry more per group."""

    ranks: list[int]
    """Global ranks of the group, ascending; their `state_fraction`s sum to 1."""


@dataclass
class Stage:
    """One pipeline stage of a staged plan: whole nodes (a shard group) running a contiguous
    range of the model's units (embedding = 0, blocks 1..L, head = L + 1) on every
    micro-batch; inside it the ranks split each micro-batch (`RankPlan.micro_batch_size`) and
    shard the stage's state unevenly (their `state_fraction`s sum to 1 within the stage)."""

    ranks: list[int]
    """Global ranks of the stage, ascending."""
    units: list[int]
    """[first, last]: the stage's units, both included (uneven: any contiguous range)."""
    keep_gathered: bool = True
    """Keep the stage's weights gathered and its fp32 gradients unsharded across the step's
    micro-batches (ZeRO-2-like: one all-gather and one reduce-scatter per step); False: gather
    and reduce-scatter each unit per micro-batch (less memory, more traffic)."""


@dataclass
class Predicted:
    """Whole-step prediction of the cost model."""

    step_s: float
    samples_per_s: float
    tokens_per_s: float


@dataclass
class Plan:
    """A complete plan for one model, sequence length, global batch and cluster."""

    strategy: str
    """How it was made: `cephalo`, `even`, `proportional` or `manual` (hand-written)."""
    model: str
    """Model name (catalog name or a config's model name)."""
    seq_len: int
    global_batch_size: int
    dtype: str
    """Compute dtype: `fp32`, `bf16` or `fp16`."""
    ranks: list[RankPlan]
    predicted: Predicted | None = None
    version: int = PLAN_FORMAT_VERSION
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (cluster spec, planner time, profile source, ...)."""
    shard_groups: list[ShardGroup] | None = None
    """Hierarchical sharding: the groups, each holding a replica (state fractions sum to 1 within
    each group). None (or one group of every rank): the flat plan, one replica over all ranks."""
    cross_group_reduce_dtype: str = "fp32"
    """Dtype of the once-per-step gradient all-reduce between groups: `fp32` (exact) or `bf16`
    (half the bytes; accumulated in fp32 either way). Only read when there are several groups."""
    stages: list[Stage] | None = None
    """Pipeline stages (format 3), in pipeline order; None: one stage of every unit (the plans
    of formats 1 and 2). The cost model and `cephalo simulate` evaluate them, the runtime runs
    them (runtime/pipeline/; what it cannot run yet: `check_stages_runnable`)."""
    schedule: str | None = None
    """A staged plan's schedule: `gpipe` or `1f1b` (SCHEDULES); None without stages."""
    num_micro_batches: int | None = None
    """A staged plan's micro-batches per step, M: the global batch is M micro-batches of
    global_batch_size / M samples, each split over every stage's ranks."""

    # ---------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> list[int]:
        return [r.batch_size for r in self.ranks]

    @property
    def state_fractions(self) -> list[float]:
        return [r.state_fraction for r in self.ranks]

    @property
    def groups(self) -> list[list[int]]:
        """The shard groups' ranks; one group of every rank for a flat plan."""
        if not self.shard_groups:
            return [list(range(len(self.ranks)))]
        return [list(g.ranks) for g in self.shard_groups]

    @property
    def hierarchical(self) -> bool:
        return len(self.groups) > 1 and not self.staged

    @property
    def staged(self) -> bool:
        """Whether the plan has pipeline stages (more than one)."""
        return bool(self.stages) and len(self.stages) > 1

    def replica_groups(self) -> list[list[int]]:
        """The rank sets whose state fractions sum to 1: the stages' (each holds its units'
        state once), else the shard groups."""
        if self.stages:
            return [list(st.ranks) for st in self.stages]
        return self.groups

    def group_of(self, rank: int) -> int:
        """Index of the shard group `rank` belongs to."""
        for i, g in enumerate(self.groups):
            if rank in g:
                return i
        raise CephaloError(f"rank {rank} is in no shard group of the plan")

    def micro_batch_slices(self, stage: int) -> list[tuple[int, int, int]]:
        """A staged plan's layout of every micro-batch in stage `stage`: (rank, start, size) per
        rank of the stage, its samples `start..start+size` of each micro-batch, the stage's ranks
        in ascending order taking consecutive slices. Micro-batch j is samples
        j x B/M .. (j+1) x B/M of the global batch, so a boundary crossing from stage s to s + 1
        re-partitions each micro-batch from one stage's slices to the next one's (the contract a
        pipeline runtime follows; docs/plan-format.md)."""
        if not self.stages:
            raise CephaloError("the plan has no stages")
        out, start = [], 0
        for r in self.stages[stage].ranks:
            rp = self.ranks[r]
            size = rp.micro_batch_size if rp.batch_size else 0
            out.append((r, start, size))
            start += size
        return out

    def batch_offsets(self) -> list[int]:
        """Start of each rank's slice of the global batch (ranks take consecutive slices)."""
        offsets, start = [], 0
        for r in self.ranks:
            offsets.append(start)
            start += r.batch_size
        return offsets

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # version first: it is what a reader checks before anything else
        return {"version": d.pop("version"), **d}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> Plan:
        return _parse_plan(d, source)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """Load a plan from a JSON string or a file path, validating it."""
        source = "plan"
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            path = Path(text_or_path)
            source = str(path)
            try:
                text = path.read_text()
            except FileNotFoundError:
                raise CephaloError(
                    f"plan file {path} does not exist; write one with `cephalo plan --json {path}`"
                ) from None
            except (
                OSError,
                ValueError,
            ) as e:  # a directory, unreadable, a name the OS rejects, not UTF-8
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                raise CephaloError(
                    f"cannot read plan file {str(path)[:200]!r}: {reason}; give the path of a "
                    "plan JSON (`cephalo plan --json plan.json`)"
                ) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CephaloError(
                f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from None
        except RecursionError:
            raise CephaloError(f"{source}: not a plan (JSON nested too deeply)") from None
        return _parse_plan(d, source)

    def validate(
        self,
        world_size: int | None = None,
        model: str | None = None,
        model_shape: str | None = None,
    ) -> None:
        """Check the plan's invariants (and optionally that it is for this world size / model).

        The model is matched by its shape where both sides know it (`model_shape`, a
        `ModelSpec.shape_fingerprint`, against the plan's `meta["model_shape"]`): a plan made
        on a laptop for `./data/x` runs on the lab node's `/home/me/data/x`. A plan file
        without a fingerprint (written before it existed, or by hand) is matched by name, a
        path by the directory it names."""
        _validate(self, "plan")
        if world_size is not None and world_size != self.world_size:
            raise CephaloError(
                f"the plan is for {self.world_size} ranks but the job has {world_size}; "
                "make a plan for this cluster (`cephalo plan`) or launch the matching number of processes"
            )
        recorded = self.meta.get("model_shape")
        if model_shape is not None and isinstance(recorded, str) and recorded:
            if recorded != model_shape:
                raise CephaloError(
                    f"the plan is for model {self.model!r}, whose shape differs from the job's "
                    f"model {model!r} (shape fingerprint {recorded} vs {model_shape}: other "
                    "layers, widths or vocabulary); make a plan for this model with "
                    f"`cephalo plan --model {model or 'NAME|DIR'} ... --json PLAN.json`"
                )
            return
        if model is not None and not same_model_name(model, self.model):
            raise CephaloError(
                f"the plan is for model {self.model!r} but the job trains {model!r}; make a plan for this model"
            )


def same_model_name(a: str, b: str) -> bool:
    """Two spellings of one model: equal names, or paths naming the same directory
    (`./data/x` and `data/x`)."""
    if a == b:
        return True
    try:
        pa, pb = Path(a).expanduser(), Path(b).expanduser()
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split into integers in proportion to `weights` (finite, >= 0, not all 0),
    summing exactly to `total`: each part floored, the rest handed out one by one to the
    largest fractional parts, ties to the lower index. Every rank computes the same split,
    so it serves batch splits and shard layouts alike."""
    weight_sum = math.fsum(weights)
    ideal = [total * w / weight_sum for w in weights]
    parts = [math.floor(x) for x in ideal]
    # sorted() is stable, so among equal remainders the lower index comes first
    order = sorted(range(len(ideal)), key=lambda i: -(ideal[i] - parts[i]))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


# -------------------------------------------------------------------- parsing helpers
def _need(d: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in d:
        raise CephaloError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CephaloError(f"{where}: field {key!r} must be {_tname(types)}, got {v!r}")
    if not isinstance(v, types):
        raise CephaloError(
            f"{where}: field {key!r} must be {_tname(types)}, got {type(v).__name__} {v!r}"
        )
    return v


def _optional_number(d: dict, key: str, where: str, kind: type = float) -> Any:
    """An optional prediction field: absent or null -> None, else a finite number >= 0."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise CephaloError(f"{where}: field {key!r} must be a number >= 0 or null, got {v!r}")
    return kind(v)


def _fraction(d: dict, key: str, where: str) -> float:
    """An optional fraction field (absent: 0), a number in [0, 1]."""
    if key not in d:
        return 0.0
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CephaloError(f"{where}: field {key!r} must be a number in [0, 1], got {v!r}")
    if not 0.0 <= v <= 1.0:
        raise CephaloError(
            f"{where}: {key} must be in [0, 1] (0: all state on the device, 1: all on the host), got {v}"
        )
    return float(v)


def _tname(types: type | tuple) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(
        {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "true/false",
            list: "a list",
            dict: "an object",
            type(None): "null",
        }.get(t, t.__name__)
        for t in ts
    )


def _parse_plan(d: Any, source: str) -> Plan:
    if not isinstance(d, dict):
        raise CephaloError(f"{source}: a plan must be a JSON object, got {type(d).__name__}")
    version = _need(d, "version", int, source)
    if version not in READABLE_VERSIONS:
        raise CephaloError(
            f"{source}: plan format version {version} is not supported (this cephalo reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); re-create the plan with `cephalo plan`"
        )
    ranks_raw = _need(d, "ranks", list, source)
    ranks = []
    for i, r in enumerate(ranks_raw):
        where = f"{source}: ranks[{i}]"
        if not isinstance(r, dict):
            raise CephaloError(f"{where}: must be an object")
        ranks.append(
            RankPlan(
                rank=_need(r, "rank", int, where),
                device=_need(r, "device", str, where),
                batch_size=_need(r, "batch_size", int, where),
                micro_batch_size=_need(r, "micro_batch_size", int, where),
                num_micro_batches=_need(r, "num_micro_batches", int, where),
                state_fraction=float(_need(r, "state_fraction", (int, float), where)),
                offload_activations=bool(_need(r, "offload_activations", bool, where))
                if "offload_activations" in r
                else False,
                host_state_fraction=_fraction(r, "host_state_fraction", where),
                overlap_reduce=bool(_need(r, "overlap_reduce", bool, where))
                if "overlap_reduce" in r
                else True,
                fuse_tail=bool(_need(r, "fuse_tail", bool, where)) if "fuse_tail" in r else True,
                predicted_step_s=_optional_number(r, "predicted_step_s", where),
                predicted_peak_memory_bytes=_optional_number(
                    r, "predicted_peak_memory_bytes", where, int
                ),
                predicted_host_bytes=_optional_number(r, "predicted_host_bytes", where, int),
            )
        )
    pred = d.get("predicted")
    predicted = None
    if pred is not None:
        if not isinstance(pred, dict):
            raise CephaloError(f"{source}: field 'predicted' must be an object or null")
        predicted = Predicted(
            step_s=float(_need(pred, "step_s", (int, float), f"{source}: predicted")),
            samples_per_s=float(_need(pred, "samples_per_s", (int, float), f"{source}: predicted")),
            tokens_per_s=float(_need(pred, "tokens_per_s", (int, float), f"{source}: predicted")),
        )
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise CephaloError(f"{source}: field 'meta' must be an object")
    groups = None
    raw_groups = d.get("shard_groups")
    if raw_groups is not None:
        if not isinstance(raw_groups, list) or not raw_groups:
            raise CephaloError(
                f"{source}: field 'shard_groups' must be a non-empty list of objects or null"
            )
        groups = []
        for i, g in enumerate(raw_groups):
            where = f"{source}: shard_groups[{i}]"
            if not isinstance(g, dict):
                raise CephaloError(f"{where}: must be an object with 'ranks'")
            members = _need(g, "ranks", list, where)
            if not members or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in members
            ):
                raise CephaloError(f"{where}: 'ranks' must be a non-empty list of integers")
            groups.append(ShardGroup(ranks=list(members)))
    reduce_dtype = d.get("cross_group_reduce_dtype", "fp32")
    stages = _parse_stages(d, source)
    schedule = d.get("schedule")
    if schedule is not None and not isinstance(schedule, str):
        raise CephaloError(f"{source}: field 'schedule' must be a string or null, got {schedule!r}")
    micro = d.get("num_micro_batches")
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int)):
        raise CephaloError(
            f"{source}: field 'num_micro_batches' must be an integer or null, got {micro!r}"
        )
    plan = Plan(
        strategy=_need(d, "strategy", str, source),
        model=_need(d, "model", str, source),
        seq_len=_need(d, "seq_len", int, source),
        global_batch_size=_need(d, "global_batch_size", int, source),
        dtype=_need(d, "dtype", str, source),
        ranks=ranks,
        predicted=predicted,
        version=version,
        meta=meta,
        shard_groups=groups,
        cross_group_reduce_dtype=reduce_dtype,
        stages=stages,
        schedule=schedule,
        num_micro_batches=micro,
    )
    _validate(plan, source)
    return plan


def _parse_stages(d: dict, source: str) -> list[Stage] | None:
    raw = d.get("stages")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise CephaloError(f"{source}: field 'stages' must be a non-empty list of objects or null")
    stages = []
    for i, st in enumerate(raw):
        where = f"{source}: stages[{i}]"
        if not isinstance(st, dict):
            raise CephaloError(f"{where}: must be an object with 'ranks' and 'units'")
        members = _need(st, "ranks", list, where)
        if not members or not all(isinstance(r, int) and not isinstance(r, bool) for r in members):
            raise CephaloError(f"{where}: 'ranks' must be a non-empty list of integers")
        units = _need(st, "units", list, where)
        if len(units) != 2 or not all(
            isinstance(u, int) and not isinstance(u, bool) for u in units
        ):
            raise CephaloError(
                f"{where}: 'units' must be [first, last], two unit indices (embedding 0, "
                f"blocks 1..L, head L+1), got {units!r}"
            )
        keep = _need(st, "keep_gathered", bool, where) if "keep_gathered" in st else True
        stages.append(Stage(ranks=list(members), units=list(units), keep_gathered=bool(keep)))
    return stages


def _validate(plan: Plan, source: str) -> None:
    if plan.strategy not in STRATEGIES:
        raise CephaloError(
            f"{source}: strategy {plan.strategy!r} is not one of {', '.join(STRATEGIES)}"
        )
    if plan.dtype not in DTYPES:
        raise CephaloError(f"{source}: dtype {plan.dtype!r} is not one of {', '.join(DTYPES)}")
    if plan.seq_len < 1:
        raise CephaloError(f"{source}: seq_len must be >= 1, got {plan.seq_len}")
    if plan.global_batch_size < 1:
        raise CephaloError(
            f"{source}: global_batch_size must be >= 1, got {plan.global_batch_size}"
        )
    if not plan.ranks:
        raise CephaloError(f"{source}: 'ranks' is empty; a plan needs at least one rank")
    for i, r in enumerate(plan.ranks):
        where = f"{source}: ranks[{i}]"
        if r.rank != i:
            raise CephaloError(
                f"{where}: rank is {r.rank} but ranks must be listed in order 0..{len(plan.ranks) - 1}"
            )
        if r.batch_size < 0:
            raise CephaloError(f"{where}: batch_size must be >= 0, got {r.batch_size}")
        if r.micro_batch_size < 1:
            raise CephaloError(f"{where}: micro_batch_size must be >= 1, got {r.micro_batch_size}")
        expect = math.ceil(r.batch_size / r.micro_batch_size)
        if r.num_micro_batches != expect:
            raise CephaloError(
                f"{where}: num_micro_batches is {r.num_micro_batches} but ceil(batch_size / micro_batch_size) "
                f"= ceil({r.batch_size} / {r.micro_batch_size}) = {expect}"
            )
        if not (0.0 <= r.state_fraction <= 1.0) or not math.isfinite(r.state_fraction):
            raise CephaloError(f"{where}: state_fraction must be in [0, 1], got {r.state_fraction}")
        h = r.host_state_fraction
        if isinstance(h, bool) or not isinstance(h, int | float) or not (0.0 <= h <= 1.0):
            raise CephaloError(
                f"{where}: host_state_fraction must be in [0, 1] (0: all state on the device, 1: all "
                f"on the host), got {h}"
            )
    if plan.stages:
        _validate_stages(plan, source)
    total = sum(plan.batch_sizes)
    if not plan.stages and total != plan.global_batch_size:
        raise CephaloError(
            f"{source}: rank batch sizes {plan.batch_sizes} sum to {total}, not global_batch_size "
            f"{plan.global_batch_size}"
        )
    if plan.cross_group_reduce_dtype not in REDUCE_DTYPES:
        raise CephaloError(
            f"{source}: cross_group_reduce_dtype {plan.cross_group_reduce_dtype!r} is not one of "
            f"{', '.join(REDUCE_DTYPES)}"
        )
    if plan.shard_groups:
        seen: list[int] = sorted(r for g in plan.shard_groups for r in g.ranks)
        if seen != list(range(len(plan.ranks))):
            raise CephaloError(
                f"{source}: shard_groups {[g.ranks for g in plan.shard_groups]} must hold every rank "
                f"0..{len(plan.ranks) - 1} exactly once"
            )
        for i, g in enumerate(plan.shard_groups):
            if g.ranks != sorted(g.ranks):
                raise CephaloError(
                    f"{source}: shard_groups[{i}]: list the ranks in ascending order"
                )
    staged = bool(plan.stages)
    for i, members in enumerate(plan.replica_groups()):
        fr = [plan.ranks[r].state_fraction for r in members]
        fsum = sum(fr)
        if abs(fsum - 1.0) > FRACTION_SUM_TOL:
            what = "stage" if staged else "shard group"
            many = staged or plan.hierarchical
            where = "" if not many else f" of {what} {i} (ranks {members})"
            raise CephaloError(
                f"{source}: state fractions {fr}{where} sum to {fsum:.6g}, not 1"
                + (f" (each {what} holds a whole replica of its state)" if many else "")
            )


def _validate_stages(plan: Plan, source: str) -> None:
    """A staged plan's invariants that need no model: every rank in one stage, contiguous
    non-empty unit ranges in order from unit 0, a schedule the plan can run, every stage's
    ranks splitting each micro-batch. (That the last stage ends at the head, the model's last
    unit, is the cost model's check: it knows the model.)"""
    stages = plan.stages or []
    if plan.shard_groups and len(plan.shard_groups) > 1:
        raise CephaloError(
            f"{source}: a plan has either 'stages' or several 'shard_groups', not both "
            "(each stage is one shard group of its own)"
        )
    seen = sorted(r for st in stages for r in st.ranks)
    if seen != list(range(len(plan.ranks))):
        raise CephaloError(
            f"{source}: stages {[st.ranks for st in stages]} must hold every rank "
            f"0..{len(plan.ranks) - 1} exactly once"
        )
    expect_first = 0
    for i, st in enumerate(stages):
        where = f"{source}: stages[{i}]"
        if st.ranks != sorted(st.ranks):
            raise CephaloError(f"{where}: list the ranks in ascending order")
        first, last = st.units
        if last < first:
            raise CephaloError(
                f"{where}: units [{first}, {last}] is empty: a stage runs at least one unit "
                "(give it [first, last] with last >= first, or drop the stage and give its "
                "ranks to another)"
            )
        if first != expect_first:
            raise CephaloError(
                f"{where}: starts at unit {first} but the previous stage ends at unit "
                f"{expect_first - 1}: the stages' units must follow on, from unit 0 "
                "(the embedding)"
            )
        expect_first = last + 1
    if plan.schedule not in SCHEDULES:
        raise CephaloError(
            f"{source}: a staged plan needs 'schedule', one of {', '.join(SCHEDULES)}; got "
            f"{plan.schedule!r}"
        )
    M = plan.num_micro_batches
    S = len(stages)
    if M is None or M < 1:
        raise CephaloError(f"{source}: a staged plan needs 'num_micro_batches' >= 1, got {M!r}")
    if S > 1 and M < S:
        raise CephaloError(
            f"{source}: {M} micro-batches cannot fill a pipeline of {S} stages (a stage would "
            f"always idle): give num_micro_batches >= {S}"
        )
    if plan.global_batch_size % M:
        raise CephaloError(
            f"{source}: num_micro_batches {M} does not divide global_batch_size "
            f"{plan.global_batch_size}: every micro-batch has the same samples in a staged plan"
        )
    per = plan.global_batch_size // M
    for i, st in enumerate(stages):
        sizes = [
            plan.ranks[r].micro_batch_size if plan.ranks[r].batch_size else 0 for r in st.ranks
        ]
        batches = [plan.ranks[r].batch_size for r in st.ranks]
        if sum(sizes) != per or any(
            b not in (0, m * M) for b, m in zip(batches, sizes, strict=True)
        ):
            raise CephaloError(
                f"{source}: stages[{i}]: its ranks' micro-batches {sizes} must sum to "
                f"global_batch_size / num_micro_batches = {per}, each rank's batch_size its "
                f"micro_batch_size x {M} (or 0), got batch sizes {batches}"
            )


def check_stages_runnable(plan: Plan, source: str = "plan", more: Sequence[str] = ()) -> None:
    """The one message for a staged plan the pipeline runtime (runtime/pipeline/) cannot run:
    host state or offloaded boundaries inside a stage (the plan's), and `more` (the job's:
    the runtime's `check_runnable` adds the standard mode, compiled blocks, DPO, adapters and
    MoE). Nothing for a plan without stages."""
    if not plan.staged:
        return
    assert plan.stages is not None
    why = []
    if any(r.host_state_fraction > 0 for r in plan.ranks):
        why.append("host state (host_state_fraction > 0)")
    if any(r.offload_activations for r in plan.ranks):
        why.append("offloaded boundary activations (offload_activations)")
    why += list(more)
    if why:
        raise CephaloError(
            f"{source} has {len(plan.stages)} pipeline stages ({plan.schedule}, "
            f"{plan.num_micro_batches} micro-batches), which cannot run with "
            + ", ".join(why)
            + " inside a stage yet: make a plan without stages (`cephalo plan --stages off`, "
            "or parallel.stages = off for an automatic plan) or drop those options"
        )
