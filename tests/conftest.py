"""Suite-wide: the equivalence checks' margins (tests/equivalence.py); the shared rank pools
(tests/dist_harness.py) stopped at the end."""

from __future__ import annotations

import compiled_suites

compiled_suites.install()  # CEPHALO_TEST_COMPILE=inductor: every engine's blocks compiled


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The worst comparison of each equivalence check: how close to its bound it came, and
    the noise the bound was derived from (the figures issue 36 asks to report)."""
    import sys

    if compiled_suites.mode():
        terminalreporter.section(f"{compiled_suites.ENV}={compiled_suites.mode()}")
        terminalreporter.write_line(
            f"engines compiled in the pytest process: {len(compiled_suites.COMPILED)}; left "
            f"eager: {sorted(set(compiled_suites.REFUSED)) or 'none'}"
        )
        for line in compiled_suites.RANKS:
            terminalreporter.write_line(f"  {line}")
    equivalence = sys.modules.get("equivalence")
    record = getattr(equivalence, "RECORD", None)
    if not record:
        return
    terminalreporter.section("equivalence margins (distance / bound of the worst comparison)")
    worst = max(r[1] for r in record)
    passed = [r for r in record if r[1] <= 1]
    terminalreporter.write_line(
        f"{len(record)} checks ({len(passed)} within their bound); largest distance / bound "
        f"among those passing: {max((r[1] for r in passed), default=0):.2f}; overall {worst:.3g}"
    )
    for label, ratio, what, distance, noise in sorted(record, key=lambda r: -r[1])[:25]:
        terminalreporter.write_line(
            f"  {ratio:8.3g}  {label}: {what}: distance {distance:.2e}, noise {noise:.2e}"
        )


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools the modules shared (dist_harness.py), if any module used one."""
    import sys

    harness = sys.modules.get("dist_harness")
    if harness is not None and compiled_suites.mode():
        compiled_suites.gather(harness._POOLS)
    if harness is not None:
        harness.close_shared_pools()
