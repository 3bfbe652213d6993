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
    """A child of the supervisor: logs; SIGINT (Ctrl-C hits the whole group) left to the
    supervisor's ordered shutdown; exit when the parent is gone."""
    setup_logging(level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    parent = multiprocessing.parent_process()
    assert parent is not None, "setup_child runs in a process the supervisor started"

    def watch() -> None:
        # NOTE: the parent's sentinel, not getppid(): a parent that died before this line would
        # leave getppid() at 1 for good
        parent.join()
        logging.getLogger(name).error("the supervisor is gone: exiting")
        exit_now(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def freeze_heap() -> None:
    """Move what start-up built (modules, the model's Python objects) out of the garbage
    collector's sight: full collections then walk only what requests allocate."""
    gc.collect()
    gc.freeze()
    # NOTE: automatic full collections wait for new long-lived objects to reach a quarter of the
    # last one's survivors (here, the frozen heap): collecting the emptied heap resets that to 0
    gc.collect()


def exit_now(code: int) -> None:
    """Flush the logs and end the process without waiting for other threads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
