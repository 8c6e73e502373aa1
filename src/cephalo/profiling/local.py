"""Profile an emulated cluster from one process: one local rank per device, each running
`profile_rank` (what `cephalo profile` and the demo do when they are not under torchrun)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cephalo.launch.ranks import run_ranks
from cephalo.profiling.profiler import profile_devices
from cephalo.profiling.settings import ProfileSettings
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.specs.cluster import Cluster


def profile_rank(
    comm,
    model: str,
    seq_len: int,
    dtype: str,
    spec: str,
    settings: ProfileSettings,
    cache: str | None,
    use_cache: bool,
    refresh: bool,
    overrides: dict | None = None,
    progress=None,
) -> dict | None:
    """One profiling rank, for `cephalo profile` and the demo (top level: the local launcher
    pickles it). `overrides` are the model's config overrides."""
    measured = profile_devices(
        model,
        seq_len,
        dtype,
        Cluster.from_any(spec),
        comm,
        settings=settings,
        cache=cache,
        use_cache=use_cache,
        refresh=refresh,
        progress=progress,
        **(overrides or {}),
    )
    return measured.to_dict() if comm.rank == 0 else None


def profile_local_ranks(
    console: Console, cluster: Cluster, rank_args: tuple, timeout_s: float
) -> dict:
    """Start one local rank per device, run `profile_rank(comm, *rank_args)` on each behind a
    spinner that shows what each rank measures, and return rank 0's result."""

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(f"profiling {cluster.describe()} ...", total=None)

        def show(rank: int, text: str) -> None:
            bar.update(task, description=f"rank {rank}: {text}")

        if cluster.world_size == 1:
            return profile_rank(LocalComm(), *rank_args, progress=lambda t: show(0, t))
        return run_ranks(
            profile_rank, cluster.world_size, *rank_args, timeout_s=timeout_s, on_progress=show
        )[0]
