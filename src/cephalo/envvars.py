"""Environment variables set for a stretch of code (the processes it starts inherit them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_environ(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in `os.environ` inside the block; restore what was there (or its absence)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
