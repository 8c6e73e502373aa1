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
                REFUSED.append(f"{model.spec.name}: {refusal}")
                return None
            requested = forced
        compiled = apply.apply_compile(model, device, requested, per_sample_dropout)
        if compiled is not None:
            COMPILED.append(model.spec.name)
        return compiled

    apply_compile.switched = True  # type: ignore[attr-defined]
    engine_module.apply_compile = apply_compile


def timeout(seconds: float) -> float:
    """A pool call's timeout, longer under the switch."""
    return seconds * TIMEOUT_FACTOR if mode() else seconds
