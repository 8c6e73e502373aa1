"""`cephalo profile`: measure the devices of a cluster and the links between them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from cephalo.errors import CephaloError
from cephalo.profiling.database import default_db_path
from cephalo.profiling.local import profile_local_ranks, profile_rank
from cephalo.profiling.settings import ProfileSettings
from cephalo.specs.catalog.devices import DTYPES
from cephalo.specs.cluster import Cluster
from cephalo.specs.profile import MeasuredProfiles
from cephalo.views.tables import profile_tables

EPILOG = """\
examples:
  cephalo profile --devices cpu,cpu:slowdown=2,cpu:slowdown=4,mem=1GiB --model gpt-tiny --seq-len 32
  cephalo profile --devices cpu,cpu:slowdown=2 --model gpt-nano --out profile.json
  cephalo plan --cluster cpu,cpu:slowdown=2 --model gpt-nano --profile profile.json ...
  torchrun --nproc-per-node 4 -m cephalo profile --devices 4xl4 --model gpt2-124m --seq-len 1024 --dtype bf16

Without torchrun the command starts one local gloo rank per device (CPU emulation: a
`slowdown=` device stretches its compute, `mem=` is its memory budget). Results are kept
in a profile database (default ~/.cache/cephalo/profiles.json, or $CEPHALO_PROFILE_DB), so
a second run with the same devices, model, sequence length and dtype is instant;
--refresh measures again. One rank measures at a time, so ranks do not slow each other.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure devices and collectives (profile database)",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--devices",
        "--cluster",
        dest="devices",
        required=True,
        metavar="SPEC",
        help="one device per rank: a cluster spec (cpu,cpu:slowdown=2,...) or a cluster file",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|DIR",
        help="a runnable model: a preset (gpt-tiny, hf-llama-tiny) or a transformers model "
        "directory (measured on random weights: timings do not depend on them)",
    )
    p.add_argument(
        "--seq-len", type=int, metavar="N", help="sequence length (default: the model's)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute dtype (default fp32)")
    p.add_argument(
        "--out",
        metavar="PATH",
        help="also write the profiles to this JSON file (for `cephalo plan --profile`)",
    )
    p.add_argument(
        "--cache", metavar="PATH", help=f"profile database (default {default_db_path()})"
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the database")
    p.add_argument(
        "--refresh", action="store_true", help="measure again even if the database has the profiles"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repetitions per measurement (median kept)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument(
        "--time-cap",
        type=float,
        default=60.0,
        metavar="S",
        help="per device type: stop measuring larger micro-batches after S seconds",
    )
    p.add_argument(
        "--max-micro-batch", type=int, default=32, metavar="M", help="largest micro-batch measured"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="give up after S seconds"
    )
    p.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> ProfileSettings:
    settings = ProfileSettings(
        repeats=args.repeats,
        warmup=args.warmup,
        time_cap_s=args.time_cap,
        max_micro_batch=args.max_micro_batch,
    )
    if settings.problems():
        raise CephaloError(
            "--repeats and --max-micro-batch must be >= 1, --warmup >= 0, --time-cap > 0"
        )
    return settings


def run(args: argparse.Namespace) -> int:
    from cephalo.modeling.registry import build_model

    console = Console()
    cluster = Cluster.from_any(args.devices)
    spec = build_model(args.model, init="random").spec
    seq_len = args.seq_len or spec.max_seq_len
    settings = _settings(args)
    common = (
        args.model,
        seq_len,
        args.dtype,
        args.devices,
        settings,
        args.cache,
        not args.no_cache,
        args.refresh,
    )
    if "RANK" in os.environ:  # inside torchrun: this process is one rank
        from cephalo.runtime.collectives.dist import init_distributed, shutdown

        comm = init_distributed(timeout_s=args.timeout)
        failed = True
        try:
            result = profile_rank(comm, *common)
            failed = False
        finally:
            shutdown(failed)  # a failing rank aborts: its peers may hold unmatched work
        if comm.rank != 0:
            return 0
    elif (hit := _cached(args, cluster, seq_len)) is not None:
        result = hit.to_dict()  # everything known: no ranks to start
    else:
        result = profile_local_ranks(console, cluster, common, args.timeout)
    measured = MeasuredProfiles.from_dict(result)
    for table in profile_tables(measured):
        console.print(table)
    if measured.comm is not None:
        console.print(
            f"collectives (all_gather_v / reduce_scatter_v over {cluster.world_size} ranks): "
            f"{measured.comm.bytes_per_s / 1e9:.2f} GB/s, latency {measured.comm.latency_s * 1e6:.0f} us"
        )
    what = f"measured {', '.join(measured.measured)}" if measured.measured else "nothing measured"
    if measured.cached:
        what += f"; from the database: {', '.join(measured.cached)}"
    console.print(f"{what} ({measured.elapsed_s:.1f} s)")
    if args.out:
        measured.save(args.out)
        console.print(f"wrote {Path(args.out)}")
    return 0


def _cached(args: argparse.Namespace, cluster: Cluster, seq_len: int) -> MeasuredProfiles | None:
    if args.no_cache or args.refresh:
        return None
    from cephalo.profiling.profiler import cached_profiles

    return cached_profiles(
        args.model, seq_len, args.dtype, cluster, backend="gloo", cache=args.cache
    )
