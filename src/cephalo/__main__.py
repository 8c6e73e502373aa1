"""`python -m cephalo ...` (how `cephalo run`, the elastic launcher and torchrun start every
rank): the command line, then a quick exit.

Python's own exit tears every module down one by one; with torch and the trainer loaded that
is 0.5-1 s of CPU per process (measured on a 2-core machine), paid by every rank of every job
after its work is done. None of it is needed once the command has returned: so the exit does
what an ordinary one does that matters (waits for non-daemon threads, runs the `atexit`
handlers: logging's flush and close, multiprocessing's clean-up; collects garbage, closing
files left in reference cycles; flushes stdout and stderr) and then ends the process with
`os._exit`. An uncaught exception still takes the ordinary path (its traceback, exit 1).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading

from cephalo.cli import main


def _exit_code(code: object) -> int:
    """`sys.exit(code)`'s exit status (a message is printed to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def quick_exit(code: object) -> None:
    """End the process as `sys.exit(code)` would, without tearing the modules down."""
    status = _exit_code(code)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    try:
        result: object = main()
    except SystemExit as e:  # argparse's errors and --help
        result = e.code
    quick_exit(result)
