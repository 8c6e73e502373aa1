"""The switch that runs the equivalence suites with compiled blocks (issue 39):
`CEPHALO_TEST_COMPILE=inductor` makes every engine the tests build compile its blocks
(`parallel.compile = "inductor"`, runtime/capture/) where it would have run eagerly (`off`,
`auto`), in the pytest process (tests/conftest.py) and on every rank of the shared pools
(tests/dist_harness.py's `_fresh_state`). `make test-compiled` runs the plan-invariance,
equivalence and FSDP2 / reference comparisons under it (docs/testing.md).

Engines whose blocks cannot run compiled with the engine's results (runtime/capture/apply.py's
refusals: MoE, LoRA / QLoRA, dropout from the global generator) stay eager, as `auto` keeps
them, and are counted (`REFUSED`): the switch never changes what a test compares against.
Calls to the module pools wait `TIMEOUT_FACTOR` times longer: each rank compiles its own
blocks, on two cores minutes cold.
"""

from __future__ import annotations

import os

ENV = "CEPHALO_TEST_COMPILE"
"""The switch's variable: the `parallel.compile` mode the tests' engines run (`inductor`)."""

TIMEOUT_FACTOR = 6
"""Pool call timeouts under the switch (a rank's first step compiles its block types)."""

COMPILED: list[str] = []
"""This process's engines whose blocks compiled under the switch (model names)."""
REFUSED: list[str] = []
"""This process's engines left eager under the switch, with the reason."""


def mode() -> str | None:
    """The mode the switch asks for (None: the switch is off)."""
    return os.environ.get(ENV) or None


def install() -> None:
    """Under the switch, wrap the engine's `apply_compile` (once per process) so an engine
    configured `off` or `auto` compiles its blocks as `mode()` says."""
    forced = mode()
    if forced is None:
        return
    import cephalo.runtime.engine.engine as engine_module
    from cephalo.runtime.capture import apply

    if getattr(engine_module.apply_compile, "switched", False):
        return

    def apply_compile(model, device, requested: str, per_sample_dropout: bool = True):
        if requested in ("off", "auto"):
            refusal = apply._refusal(model, per_sample_dropout)
            if refusal is not None:
                REFUSED.append(f"{os.path.basename(model.spec.name)}: {refusal}")
                return None
            requested = forced
        compiled = apply.apply_compile(model, device, requested, per_sample_dropout)
        if compiled is not None:
            COMPILED.append(model.spec.name)
        return compiled

    apply_compile.switched = True  # type: ignore[attr-defined]
    engine_module.apply_compile = apply_compile


RANKS: list[str] = []
"""What the shared pools' ranks compiled, gathered at the end of the session (`gather`)."""


def counts() -> tuple[int, list[str]]:
    """On a rank: (engines compiled under the switch, the reasons others stayed eager)."""
    return len(COMPILED), sorted(set(REFUSED))


def gather(pools: dict) -> None:
    """Ask every shared pool's ranks what they compiled (before the pools stop) into `RANKS`."""
    for size, pool in sorted(pools.items()):
        try:
            answers = pool.run(counts, timeout_s=60)
        except Exception as err:  # a dead pool: say so, the tests have reported already
            RANKS.append(f"{size}-rank pool: no answer ({type(err).__name__})")
            continue
        for rank, (compiled, refused) in enumerate(answers):
            RANKS.append(f"{size}-rank pool, rank {rank}: {compiled} compiled, eager: {refused}")


def timeout(seconds: float) -> float:
    """A pool call's timeout, longer under the switch."""
    return seconds * TIMEOUT_FACTOR if mode() else seconds
