"""What every process of the service does at start and at exit: logging, signals, a quick exit."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# The engine thread retakes the GIL after every torch op: shorten each handover's wait
GIL_SWITCH_INTERVAL_S = 0.001


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def setup_child(level: str, name: str) -> None:
    """Logs; SIGINT (it hits the whole group) left to the supervisor; exit when it is gone."""
    setup_logging(level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    parent = multiprocessing.parent_process()
    assert parent is not None, "setup_child runs in a process the supervisor started"

    def watch() -> None:
        # NOTE: the parent's sentinel: getppid() stays 1 if the parent died before this line
        parent.join()
        logging.getLogger(name).error("the supervisor is gone: exiting")
        exit_now(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def freeze_heap() -> None:
    """Freeze start-up's objects: full collections then walk only what requests allocate."""
    gc.collect()
    gc.freeze()
    # NOTE: resets the next full collection's threshold (a quarter of the last's survivors)
    gc.collect()


def exit_now(code: int) -> None:
    """Flush the logs and end the process without waiting for other threads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
