"""Measure, on this machine as loaded right now, the two timing margins the tests rely on.

    python scripts/measure_test_margins.py profiler --runs 8     # tests/test_profiler.py
    python scripts/measure_test_margins.py heartbeats --runs 3   # tests/test_elastic.py

- profiler: the median slowdown ratio `cpu:slowdown=2` / `cpu` that `test_two_rank_profiling`
  bounds (two ranks measured together, by the wall clock, as in training) next to the one
  `test_slowdown_is_measured` bounds (one process, by the thread's CPU time).
- heartbeats: the age of each node's last rendezvous heartbeat during a two-node elastic job
  (the tests' gpt-tiny job, `--nnodes 1:2`, 2 + 1 ranks), read from the c10d store every
  0.1 s. The tests declare a node dead when its heartbeat is older than
  keep_alive_interval x keep_alive_max_attempt; here that is set far out of reach so the
  job runs to the end whatever the load.

Both print one line per run and a summary with the load average; the numbers say what the
machine does under its current load, so run it while the machine is as busy as it gets.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from base64 import b64decode
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (1 min) {five:.1f} (5 min) on {os.cpu_count()} cores"


def profiler(runs: int, slowdown: float) -> None:
    import torch

    from cephalo.launch.pool import RankPool
    from cephalo.specs.profile import MeasuredProfiles

    sys.path.insert(0, str(TESTS))
    import test_profiler as tp

    torch.set_num_threads(1)
    pairs, singles = [], []
    with RankPool(2, timeout_s=240.0) as pool, tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            results = pool.run(
                tp._profile_on_ranks, str(Path(tmp) / f"db{i}.json"), slowdown, timeout_s=240
            )
            first = MeasuredProfiles.from_dict(results[0]["first"])
            pairs.append(tp._slowdown_ratio(first, f"cpu:slowdown={slowdown:g}", "cpu"))
            single = tp.profile_devices(
                "gpt-tiny",
                tp.SEQ,
                "fp32",
                tp.Cluster.parse(f"cpu,cpu:slowdown={slowdown:g}"),
                settings=tp.ProfileSettings(
                    repeats=3,
                    warmup=1,
                    max_micro_batch=8,
                    optimizer_numel=1 << 16,
                    host_copy_bytes=1 << 20,
                ),
                use_cache=False,
            )
            singles.append(tp._slowdown_ratio(single, f"cpu:slowdown={slowdown:g}", "cpu"))
            print(
                f"run {i}: 2 ranks (slowdown {slowdown:g}) {pairs[-1]:.2f} in "
                f"{results[0]['first_s']:.1f} s, 1 process {singles[-1]:.2f}; {_load()}",
                flush=True,
            )
    print(
        f"2 ranks: min {min(pairs):.2f} median {statistics.median(pairs):.2f} max {max(pairs):.2f}; "
        f"1 process: min {min(singles):.2f} median {statistics.median(singles):.2f} "
        f"max {max(singles):.2f} ({runs} runs; {_load()})"
    )


def _watch(port: int, rdzv_id: str, ages: dict[str, float], stop: threading.Event) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    key = f"torch.rendezvous.{rdzv_id}"
    while not stop.is_set():
        try:
            raw = store.get(key) if store.check([key]) else b""
            state = pickle.loads(b64decode(raw)) if raw else None
        except Exception:  # noqa: BLE001 - the store goes away with node 0 at the end
            break
        now = datetime.datetime.now(datetime.timezone.utc)
        for node, beat in getattr(state, "last_heartbeats", {}).items():
            name = f"{node.addr}:{node.pid}"
            ages[name] = max(ages.get(name, 0.0), (now - beat).total_seconds())
        time.sleep(0.1)


def heartbeats(runs: int) -> None:
    sys.path.insert(0, str(TESTS))
    import test_elastic as te
    from cephalo.launch.elastic import free_port
    from procs import started_processes

    # the tests' settings, but a node is never dropped: we want the ages, not a verdict
    te.RDZV_CONF = re.sub(r"keep_alive_max_attempt=\d+", "keep_alive_max_attempt=600", te.RDZV_CONF)
    worst = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp, started_processes() as procs:
            run, port, rdzv = Path(tmp) / "run", free_port(), uuid.uuid4().hex[:8]
            logs = [Path(tmp) / "node0.log", Path(tmp) / "node1.log"]
            started = time.monotonic()
            node0 = te.torchrun(procs, "1:2", 2, port, rdzv, run, logs[0], max_restarts=2)
            time.sleep(1.0)
            node1 = te.torchrun(procs, "1:2", 1, port, rdzv, run, logs[1])
            ages: dict[str, float] = {}
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(port, rdzv, ages, stop), daemon=True)
            watcher.start()
            codes = [p.wait(timeout=300) for p in (node0, node1)]
            stop.set()
            watcher.join(timeout=5)
            took = time.monotonic() - started
        worst.append(max(ages.values(), default=float("nan")))
        print(
            f"run {i}: exit codes {codes}, {took:.0f} s; oldest heartbeat per node "
            + ", ".join(f"{n} {a:.2f} s" for n, a in sorted(ages.items()))
            + f"; {_load()}",
            flush=True,
        )
    print(f"oldest heartbeat over {runs} runs: {max(worst):.2f} s (interval 1 s); {_load()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["profiler", "heartbeats"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--slowdown", type=float, default=6.0, help="profiler: the slow device's slowdown"
    )
    args = ap.parse_args()
    if args.what == "profiler":
        profiler(args.runs, args.slowdown)
    else:
        heartbeats(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
