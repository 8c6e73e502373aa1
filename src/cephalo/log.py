"""The project's one logger. Modules do `from cephalo.log import logger`."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

from cephalo import envvars

logger = logging.getLogger("cephalo")


def init_logging(level: str | int | None = None) -> None:
    """Configure the cephalo logger once (rank-aware prefix under torchrun)."""
    if logger.handlers:
        return
    level = level or os.environ.get(envvars.LOG_LEVEL, "INFO")
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None else ""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Third-party loggers that talk while their package is imported: torchao's "Failed to load
..._C_mxfp8...so" (C++ extensions built for another torch, which the NF4 tensor never uses),
torch's pytree deprecation notes for the Enums torchao registers."""

_shown: set[str] = set()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            with contextlib.suppress(Exception):
                self.messages.append(f"{record.name}: {record.getMessage()}")


def verbose() -> bool:
    """`cephalo --verbose` (or `CEPHALO_VERBOSE=1` for the workers and under torchrun)."""
    return os.environ.get(envvars.VERBOSE, "") not in ("", "0")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Import optional packages without their warnings on the console: what their loggers
    (`QUIET_LOGGERS`) and Python's warnings say during the block is captured, and shown once
    per process under `--verbose` (they are about the package, not the job: every rank of
    every command would print them otherwise)."""
    capture = _Capture()
    saved = []
    for name in QUIET_LOGGERS:
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers, log.propagate = [capture], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for log, handlers, propagate in saved:
            log.handlers, log.propagate = handlers, propagate
    messages = capture.messages + [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
    ]
    if verbose():
        for message in messages:
            if message not in _shown:
                _shown.add(message)
                logger.warning("on import: %s", message)
