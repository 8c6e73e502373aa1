"""Console tables (rich): plans with their evaluation, strategy comparisons, profiles.
Rendering only: every number comes from the value passed in."""

from __future__ import annotations

import copy
import os
import shutil
import sys
from collections import defaultdict
from collections.abc import Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from cephalo.advise.results import Advice, FrontierPoint, Marginal
from cephalo.costmodel.results import PlanEvaluation
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.plan import Plan
from cephalo.specs.catalog import derived
from cephalo.specs.catalog import devices as catalog_devices
from cephalo.specs.catalog import models as catalog_models
from cephalo.specs.catalog import published as catalog_published
from cephalo.specs.profile import MeasuredProfiles

GIB = 1024**3


PIPE_WIDTH = 160
"""Tables' width where the output is piped and COLUMNS is unset (text lines are not wrapped)."""
MIN_WIDTH = 80
"""The narrowest terminal the tables are fitted to."""


def console_width() -> int | None:
    """The width to fit to: COLUMNS where set, else the terminal's; None where the output is
    not a terminal (a pipe or file: nothing to fit, and wrapping it would break lines mid-phrase)."""
    raw = os.environ.get("COLUMNS", "")
    if raw.strip().isdigit():
        return max(int(raw), MIN_WIDTH)
    if not sys.stdout.isatty():
        return None
    return max(shutil.get_terminal_size((MIN_WIDTH, 24)).columns, MIN_WIDTH)


def make_console(stderr: bool = False) -> Console:
    """The commands' console: as wide as the terminal (at least 80 columns), the wide tables
    fitted to it (`fitted`); piped output soft-wrapped (lines are never broken) with tables up
    to `PIPE_WIDTH` columns."""
    width = console_width()
    if width is None:
        return Console(width=PIPE_WIDTH, soft_wrap=True, stderr=stderr)
    return Console(width=width, stderr=stderr)


def _cell_width(cell: object) -> int:
    if isinstance(cell, str):
        return max((Text.from_markup(line).cell_len for line in cell.split("\n")), default=0)
    if isinstance(cell, Text):
        return cell.cell_len
    return 0


def _longest_word(cell: object) -> int:
    text = Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)
    return max((len(word) for word in text.split()), default=0)


class Fitted:
    """A table fitted to the console's width when printed: the `keep` columns (what one types:
    device names) are never cut or wrapped; the `drop` columns are left out in that order while
    the table is wider than the console (a note names them); then the `wrap` columns (text)
    wrap at spaces rather than being cut with an ellipsis. Numbers are neither."""

    def __init__(
        self,
        table: Table,
        keep: Sequence[str] = (),
        drop: Sequence[str] = (),
        wrap: Sequence[str] = (),
    ):
        self.table, self.keep, self.drop = table, tuple(keep), tuple(drop)
        self.wrap = tuple(wrap)

    def fit(self, width: int, console: Console) -> tuple[Table, list[str]]:
        """A copy of the table that fits `width` columns and the headers it left out."""
        table = copy.deepcopy(self.table)
        options = console.options.update_width(10**5)

        def cells(col: Column) -> list[object]:
            return [col.header, *col._cells]

        def slack() -> int:  # what wrapping the `wrap` columns at spaces can save
            return sum(
                max(map(_cell_width, cells(c))) - max(map(_longest_word, cells(c)))
                for c in table.columns
                if str(c.header) in self.wrap
            )

        def natural() -> int:
            return Measurement.get(console, options, table).maximum

        for col in table.columns:
            if str(col.header) not in self.wrap:  # typed names and numbers: never cut
                col.no_wrap = True
                col.min_width = max(map(_cell_width, cells(col)))
        dropped: list[str] = []
        for name in self.drop:
            if natural() - slack() <= width:
                break
            for i, col in enumerate(table.columns):
                if str(col.header) == name:
                    del table.columns[i]
                    dropped.append(name)
                    break
        # rich shrinks the wrapping columns only while one is wider than the rest, then cuts
        # every column: the widest wrapping column gives up one character at a time instead
        wraps = [c for c in table.columns if str(c.header) in self.wrap]
        widths = [max(map(_cell_width, cells(c))) for c in wraps]
        least = [max(map(_longest_word, cells(c))) for c in wraps]
        excess = natural() - width
        while excess > 0 and wraps:
            i = max(range(len(wraps)), key=lambda k: widths[k] - least[k])
            if widths[i] <= least[i]:
                break
            widths[i] -= 1
            excess -= 1
        for col, w in zip(wraps, widths, strict=True):
            col.no_wrap, col.overflow, col.width = False, "fold", w
        return table, dropped

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table, dropped = self.fit(options.max_width, console)
        yield table
        if dropped:
            yield Text(
                f"(left out at {options.max_width} columns: {', '.join(dropped)}; widen the "
                "terminal to see them)",
                style="dim",
            )


def plan_table(plan: Plan, ev: PlanEvaluation, title: str, memory_unit: str = "GiB") -> Fitted:
    """One row per rank; the slowest rank's step time in bold, ranks over their memory in red.
    `memory_unit` "MiB" suits emulated budgets far below a GiB. `on host`: the part of the
    rank's state shard in host memory (`host_state_fraction`); `rs`: `ovl` where the rank
    overlaps its reduce-scatters, `wait` where it waits for each (a unit gradient less); `tail`:
    `fused` where the rank runs the last block in the head's pass (not recomputed)."""
    unit = {"GiB": GIB, "MiB": 2**20}[memory_unit]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    grouped = plan.hierarchical or plan.staged
    label = "stage" if plan.staged else "group"
    for col in (
        *((label,) if grouped else ()),
        "rank",
        "device",
        "batch",
        "micro-batches",
        "state",
        "on host",
        "act",
        "rs",
        "tail",
        "step s",
        "busy s",
        f"{memory_unit} used/cap",
        "fits",
    ):
        left = col in ("device", "act", "rs", "tail")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for r, c in zip(plan.ranks, ev.ranks, strict=True):
        slowest = abs(c.step_s - ev.step_s) <= 1e-12 * max(ev.step_s, 1.0)
        table.add_row(
            *((str(_group_index(plan, r.rank)),) if grouped else ()),
            str(r.rank),
            r.device,
            str(r.batch_size),
            r.micro_batches_text(),
            f"{r.state_fraction:.3f}",
            f"{r.host_state_fraction:.2f}" if r.host_state_fraction and r.state_fraction else "-",
            "host" if r.offload_activations else "dev",
            "ovl" if r.overlap_reduce else "wait",
            "fused" if c.fused_tail else "-",
            f"[bold]{c.step_s:.3f}[/bold]" if slowest else f"{c.step_s:.3f}",
            f"{c.busy_s:.3f}",
            f"{c.peak_bytes / unit:.1f}/{c.capacity_bytes / unit:.1f}",
            "yes" if c.fits else f"[red]NO -{c.shortfall_bytes / unit:.2f}[/red]",
        )
    # narrow terminals: the per-rank diagnostics go first, the split and the memory stay
    return Fitted(
        table,
        keep=("group", "stage", "rank", "device"),
        drop=("busy s", "rs", "tail", "act", "on host", "state"),
    )


def _group_index(plan: Plan, rank: int) -> int:
    """The rank's pipeline stage in a staged plan, else its shard group."""
    if plan.staged:
        return next(i for i, st in enumerate(plan.stages or []) if rank in st.ranks)
    return plan.group_of(rank)


def host_memory_lines(ev: PlanEvaluation, memory_unit: str = "GiB") -> list[str]:
    """One line per node: host memory its ranks use (host state, offloaded activations) of what
    it has; empty where the cost model knows no hosts."""
    unit = {"GiB": GIB, "MiB": 2**20}[memory_unit]
    lines = []
    for node, (used, cap, ranks) in sorted(ev.host_by_node().items()):
        if cap is None:
            continue
        flag = "" if used <= cap else "  [red]TOO SMALL[/red]"
        lines.append(
            f"host memory of node {node} (ranks {', '.join(map(str, ranks))}): "
            f"{used / unit:.1f} of {cap / unit:.1f} {memory_unit} used{flag}"
        )
    return lines


def strategy_line(name: str, plan: Plan | PlanDoesNotFit, even: Plan | PlanDoesNotFit) -> str:
    if isinstance(plan, PlanDoesNotFit):
        return f"{name:>12}: does not fit ({plan})"
    p = plan.predicted
    ratio = (
        f"{p.samples_per_s / even.predicted.samples_per_s:.2f}x even"
        if isinstance(even, Plan)
        else "even does not fit"
    )
    return f"{name:>12}: {p.samples_per_s:.4g} samples/s, {p.tokens_per_s:.4g} tokens/s, step {p.step_s:.4g} s, {ratio}"


def profile_tables(measured: MeasuredProfiles) -> list[Table]:
    """One table per device type: forward / backward ms and activation MiB per micro-batch size."""
    tables = []
    for key, p in measured.profiles.items():
        t = Table(
            title=f"{key}: {measured.model}, seq {measured.seq_len}, {measured.dtype} ({p.source})",
            caption=f"optimizer {p.optimizer_s_per_param * 1e9:.2f} ns/param, host copy "
            f"{p.host_copy_bytes_per_s / 1e9:.1f} GB/s"
            + (
                f", host AdamW {p.host_optimizer_s_per_param * 1e9:.2f} ns/param"
                if p.host_optimizer_s_per_param is not None
                else ""
            )
            + f", {p.meta.get('torch_threads', '?')} thread(s)",
        )
        t.add_column("micro-batch", justify="right")
        for kind in ("embedding", "block", "head"):
            t.add_column(f"{kind} fwd/bwd ms", justify="right")
        t.add_column("block act MiB", justify="right")
        t.add_column("head act MiB", justify="right")
        for m in p.units["block"].fwd_s.xs:
            row = [f"{m:g}"]
            for kind in ("embedding", "block", "head"):
                u = p.units[kind]
                row.append(f"{u.fwd_s(m) * 1e3:.2f} / {u.bwd_s(m) * 1e3:.2f}")
            row.append(f"{p.units['block'].activation_bytes(m) / 2**20:.2f}")
            row.append(f"{p.units['head'].activation_bytes(m) / 2**20:.2f}")
            t.add_row(*row)
        tables.append(t)
    return tables


# ---------------------------------------------------------------- the catalog (`cephalo catalog`)
CATALOG_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch sizes `cephalo catalog --model` shows."""


def _profiles_by(index: int) -> dict[str, set[str]]:
    """device -> models (index 1) or model -> devices (index 0) with a published profile."""
    out: dict[str, set[str]] = defaultdict(set)
    for entry in catalog_published.available_profiles():
        out[entry[index]].add(entry[1 - index])
    return out


def catalog_devices_table() -> Fitted:
    """One row per device type: its data-sheet figures and how many models it has profiles for."""
    models_on = _profiles_by(1)
    t = Table(
        title="Device types (`--cluster 2xl4,a6000,p40`)", title_justify="left", box=box.SIMPLE_HEAD
    )
    for col in ("type", "name", "memory", "mem BW", "PCIe", "link", "aliases", "models"):
        right = col in ("memory", "mem BW", "PCIe", "link", "models")
        t.add_column(col, justify="right" if right else "left", no_wrap=col != "aliases")
    for key, d in catalog_devices.DEVICES.items():
        t.add_row(
            key,
            d.name,
            f"{d.memory_gib:g} GiB",
            f"{d.memory_bandwidth_gb_s:g} GB/s",
            f"gen{d.pcie_gen}",
            f"{catalog_devices.intra_node_bytes_per_s(key) / 1e9:g} GB/s",
            ", ".join(d.aliases),
            str(len(models_on.get(key, ()))) + ("*" if key in derived.DERIVED else ""),
        )
    t.add_row(
        "cpu",
        "emulated (CPU)",
        f"{catalog_devices.CPU_DEFAULT_MEMORY_BYTES / catalog_devices.GiB:g} GiB",
        "-",
        "-",
        f"{catalog_devices.CPU_LINK_BYTES_PER_S / 1e9:g} GB/s",
        "cpu:slowdown=2,mem=1GiB",
        "measure",
    )
    t.caption = (
        "models: how many catalog models have published profiles on the device; *: derived "
        "from a measured card of the same architecture by spec ratios (specs/catalog/derived.py; its "
        "measured error is printed with a plan)"
    )
    # the type is what one types (`--cluster 2xl4,...`): never cut
    return Fitted(t, keep=("type",), drop=("aliases", "link", "PCIe"), wrap=("name",))


def catalog_models_table() -> Fitted:
    """One row per catalog model: its shape and the device types with its profiles."""
    devices_for = _profiles_by(0)
    order = catalog_devices.list_device_types()
    t = Table(title="Models (`--model gpt-2.7b`)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("name", "arch", "layers", "hidden", "params", "aliases", "devices with profiles"):
        right = col in ("layers", "hidden", "params")
        t.add_column(col, justify="right" if right else "left", no_wrap=right or col == "name")
    for spec in catalog_models.list_models():
        devices = sorted(devices_for.get(spec.name, ()), key=order.index)
        t.add_row(
            spec.name,
            spec.arch,
            str(spec.num_layers),
            str(spec.hidden_size),
            f"{spec.total_params / 1e9:.2f} B",
            ", ".join(spec.aliases),
            ", ".join(devices) or "-",
        )
    return Fitted(
        t, keep=("name",), drop=("aliases", "arch"), wrap=("aliases", "devices with profiles")
    )


def catalog_device_table(device: str) -> Table:
    """The published profiles of one device type: per model, its sequence lengths and dtypes."""
    key = catalog_devices.resolve_device_type(device)
    d = catalog_devices.DEVICES[key]
    by_model: dict[str, list[str]] = defaultdict(list)
    for model, dev, seq, dtype in catalog_published.available_profiles():
        if dev == key:
            by_model[model].append(f"{seq}/{dtype}")
    t = Table(
        title=f"{key}: {d.name}, {d.memory_gib:g} GiB, {d.memory_bandwidth_gb_s:g} GB/s",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        caption="per-layer times and memory for `cephalo catalog --model NAME`",
    )
    for col in ("model", "params", "profiles (seq/dtype)"):
        t.add_column(col, justify="right" if col == "params" else "left")
    names = [s.name for s in catalog_models.list_models()]
    for model in sorted(by_model, key=lambda m: names.index(m) if m in names else len(names)):
        spec = catalog_models.get_model_spec(model)
        t.add_row(model, f"{spec.total_params / 1e9:.2f} B", ", ".join(by_model[model]))
    if not by_model:
        t.caption = f"no published profiles for {key}: measure it with `cephalo profile`"
    return t


def catalog_model_table(name: str, seq_len: int | None, dtype: str | None) -> Fitted:
    """One model's block forward / backward times on every device with its profiles."""
    spec = catalog_models.get_model_spec(name)
    data_dtype = None if dtype is None else ("fp32" if dtype == "fp32" else "fp16")
    rows = [
        e
        for e in catalog_published.available_profiles()
        if e[0] == spec.name
        and (seq_len is None or e[2] == seq_len)
        and (data_dtype is None or e[3] == data_dtype)
    ]
    batches = ", ".join(map(str, CATALOG_BATCHES))
    t = Table(
        title=f"{spec.name}: one block's forward / backward ms at micro-batch {batches}",
        title_justify="left",
        caption="source: measured arrays, fitted lines (fit), or a split forward+backward line (fit-total)",
    )
    columns = ("device", "seq", "dtype", "source", *[f"b={b}" for b in CATALOG_BATCHES])
    for col in (*columns, "act MiB/sample"):
        t.add_column(col, justify="left" if col in ("device", "dtype", "source") else "right")
    for _, device, seq, dt in sorted(
        rows, key=lambda e: (catalog_devices.list_device_types().index(e[1]), e[2], e[3])
    ):
        p = catalog_published.catalog_profile(device, spec, seq, dt)
        block = p.units["block"]
        cells = [
            f"{block.fwd_s(b) * 1e3:.1f} / {block.bwd_s(b) * 1e3:.1f}" for b in CATALOG_BATCHES
        ]
        act = block.activation_bytes(1) / 2**20
        t.add_row(
            device,
            str(seq),
            dt,
            p.meta["timing_source"],
            *cells,
            f"{act:.0f} ({p.meta['activation_source']})",
        )
    if not rows:
        t.caption = (
            f"no published profile of {spec.name} matches; `cephalo catalog` lists what exists"
        )
    return Fitted(
        t,
        keep=("device",),
        drop=("act MiB/sample", "source"),
        wrap=tuple(f"b={b}" for b in CATALOG_BATCHES),
    )


def catalog_skipped_table() -> Table:
    """The published entries the catalog converter could not use, and why."""
    skipped = catalog_published.skipped_entries()
    t = Table(title=f"{len(skipped)} published entries not used", title_justify="left")
    for col in ("key", "device", "seq", "dtype", "reason"):
        t.add_column(col)
    for s in skipped:
        t.add_row(s["key"], s["device"], str(s["seq_len"]), s["dtype"], s["reason"])
    return t


def estimate_lines(cost_model) -> list[str]:
    """One line per device type whose block times were estimated by FLOP scaling (a model
    the catalog never measured): from what, and that estimate's leave-one-out error; and one
    per derived card (no published measurements): its method and that method's measured error."""
    lines = []
    for key, profile in cost_model.profiles.items():
        meta = profile.meta
        if "derived_method" in meta:
            lines.append(
                f"{key}: "
                + (
                    "not measured for this model"
                    if meta.get("derived_fills_gaps")
                    else "no published measurements"
                )
                + f"; {meta['derived_method']}. Measured error of "
                f"this derivation ({meta['derived_error_scope']}, predicting measured cards "
                f"from their siblings): {meta['derived_error']}."
            )
        if meta.get("timing_source") != "flop-scaled":
            continue
        lines.append(
            f"{key}: no published profile of {cost_model.model.name}; block times scaled by "
            f"FLOPs from the published {meta['estimated_from']} ({meta['estimate_group']} "
            f"blocks). Leave-one-out error of this estimate on the published data "
            f"({meta['estimate_error_scope']}): {meta['estimate_error']}. Measure the real "
            "devices with `cephalo profile` for a better plan."
        )
    return lines


def moe_lines(cost_model) -> list[str]:
    """A mixture-of-experts model: what its memory and its compute count (nothing for a
    dense model)."""
    m = cost_model.model
    if not m.num_experts:
        return []
    return [
        f"{m.name}: mixture of experts, {m.num_experts} experts per layer, {m.experts_per_token} "
        f"per token. Memory counts every expert: {m.params_per_block / 1e6:,.1f} M parameters "
        f"per layer ({m.total_params / 1e9:,.2f} B in all); compute counts the active ones: "
        f"{m.compute_params_per_block / 1e6:,.1f} M per layer per token (FLOP-scaled "
        "catalog times; measured profiles time the real layer). Tokens are assumed to spread "
        "evenly over the experts."
    ]


def adapter_lines(cost_model) -> list[str]:
    """What an adapter plan trains and what it costs per parameter (nothing for full
    fine-tuning): the numbers `costmodel/layout.py` feeds the cost model."""
    adapter, layout = cost_model.adapter, cost_model.layout
    if not adapter.frozen_base:
        return []
    gib = 1024**3
    base = layout.frozen_bytes / cost_model.total_params
    block = layout.units["block"]
    return [
        f"{adapter.describe()}: {layout.trained_params:,} adapter parameters "
        f"({layout.trained_params / cost_model.total_params:.2%} of {cost_model.total_params:,}) "
        f"at 16 B; frozen base {layout.frozen_bytes / gib:.2f} GiB ({base:.3f} B/param; full "
        f"fine-tuning's state: {cost_model.total_params * 16 / gib:.1f} GiB); a block gathers "
        f"{block.gather_bytes / 2**20:.1f} MiB, reduces {block.trained * 4 / 2**20:.1f} MiB; "
        f"backward x{block.bwd_factor:.2f} of the profiled (frozen weights get no gradient)"
    ]


# ---------------------------------------------------------------------- the advisor
def _counts(p: FrontierPoint) -> str:
    return " + ".join(f"{n}x {name}" for name, n in p.counts.items())


def frontier_rows(advice: Advice, max_rows: int) -> list[int]:
    """Indices of the frontier points to show: all when few, else the ends, the marked ones
    and evenly spaced others."""
    n = len(advice.frontier)
    if n <= max_rows:
        return list(range(n))
    marked = {
        i
        for i, p in enumerate(advice.frontier)
        if p in (advice.chosen, advice.best_under_budget, advice.cheapest_meeting_target)
    }
    keep = marked | {0, n - 1}
    step = (n - 1) / max(1, max_rows - len(keep) - 1)
    keep |= {round(i * step) for i in range(max_rows - len(keep))}
    return sorted(keep)[: max_rows + len(marked)]


def frontier_table(advice: Advice, max_rows: int = 30) -> Fitted:
    """The Pareto frontier, cheapest first; the budget's, the target's and the chosen cluster marked."""
    rows = frontier_rows(advice, max_rows)
    shown = (
        ""
        if len(rows) == len(advice.frontier)
        else f" ({len(rows)} of {len(advice.frontier)} shown; all in --json)"
    )
    table = Table(
        title=f"Pareto frontier: price per hour vs throughput{shown}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("$/h", "GPUs", "cluster", "samples/s", "tokens/s", "$/M tokens", ""):
        table.add_column(col, justify="left" if col in ("cluster", "") else "right")
    for i in rows:
        p = advice.frontier[i]
        marks = []
        if p is advice.best_under_budget:
            marks.append("best within budget")
        if p is advice.cheapest_meeting_target:
            marks.append("cheapest meeting target")
        if p is advice.chosen and not marks:
            marks.append(advice.chosen_why)
        style = "bold" if p is advice.chosen else None
        table.add_row(
            f"{p.price_per_hour:,.2f}",
            str(p.gpus),
            _counts(p),
            f"{p.samples_per_s:,.2f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.usd_per_million_tokens:,.3f}",
            ", ".join(marks),
            style=style,
        )
    return Fitted(table, drop=("$/M tokens", "samples/s"), wrap=("cluster", ""))


def marginal_tables(m: Marginal, seq_len: int) -> list[Fitted]:
    """What each device of a cluster is worth, and what one more unit of each offer would add."""
    name = "the chosen cluster" if m.base == "chosen" else "your cluster (--have)"
    price = f", ${m.price_per_hour:,.2f}/h" if m.price_per_hour is not None else ""
    devices = Table(
        title=f"Marginal value of each device of {name}: {m.label}, {m.tokens_per_s:,.0f} tokens/s{price}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("device", "count", "$/h each", "tokens/s without one", "lost", "pays for itself"):
        devices.add_column(col, justify="left" if col in ("device", "pays for itself") else "right")
    for d in m.devices:
        pays = {True: "yes", False: "[red]no[/red]", None: "- (no price)"}[d.pays_for_itself]
        devices.add_row(
            d.offer or d.type,
            str(d.count),
            "-" if d.price_per_hour is None else f"{d.price_per_hour:,.2f}",
            f"{d.samples_per_s_without * seq_len:,.0f}",
            f"{d.tokens_per_s_lost:,.0f} ({100 * d.share_lost:.1f}%)",
            pays,
        )
    adds = Table(
        title=f"One more unit of each offer for {name}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("offer", "+GPUs", "+$/h", "tokens/s with it", "gained", "tokens/s per $/h", ""):
        adds.add_column(col, justify="left" if col in ("offer", "") else "right")
    best = m.best_to_add
    for a in m.additions:
        adds.add_row(
            a.offer,
            str(a.gpus),
            f"{a.price_per_hour:,.2f}",
            f"{a.samples_per_s_with * seq_len:,.0f}",
            f"{a.tokens_per_s_gained:+,.0f}",
            f"{a.tokens_per_s_per_usd:,.0f}",
            "best to add next" if a is best else "",
            style="bold" if a is best else None,
        )
    return [
        Fitted(
            devices,
            keep=("device",),
            drop=("$/h each",),
            wrap=("tokens/s without one", "lost", "pays for itself"),
        ),
        Fitted(
            adds,
            keep=("offer",),
            drop=("+$/h",),
            wrap=("tokens/s with it", "tokens/s per $/h", ""),
        ),
    ]


def calibration_table(title: str, rows: list[list[str]]) -> Table:
    """One row per calibration of a running job (the demo's re-planning run): after which
    step, measured / predicted compute of each rank, the re-made plan's predicted gain, the
    decision, the batches, re-plan + switch seconds; every cell formatted by the caller."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in (
        "after step",
        "compute meas./pred.",
        "gain",
        "decision",
        "batches",
        "re-plan+switch s",
    ):
        left = col in ("decision", "batches")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


DOCTOR_STYLES = {"ok": "green", "FAIL": "bold red", "warn": "yellow"}


def doctor_table(checks: list, title: str) -> Table:
    """`cephalo doctor`'s rows (train/doctor.py `Check`): check, status, what was found and,
    for a row that is not ok, the fix; fits 80 columns (long cells wrap)."""
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_lines=True
    )
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found / fix", overflow="fold")
    for c in checks:
        cell = Text(c.found)
        if c.fix:
            cell.append("\nfix: ", style="bold")
            cell.append(c.fix)
        table.add_row(c.name, Text(c.status, style=DOCTOR_STYLES.get(c.status, "")), cell)
    return table
