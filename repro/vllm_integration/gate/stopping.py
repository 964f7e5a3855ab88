"""A gate run's case threads, waited for and stopped. The main thread alone receives Ctrl-C (and SIGTERM or SIGHUP,
which the gate takes as Ctrl-C); a case thread waits on its process until it ends. So on Ctrl-C, or an error in one
case, the run stops what is in flight instead of waiting for it: no further case starts (the launcher refuses, each
thread's next launch raises Stopped), the forkservers are closed (their children killed), and every case process a
thread watches is killed, again and again while an attempt or a rerun starts after a kill, until the threads (and the
MPS thread) end or STOP_S passes. A second Ctrl-C, SIGTERM or hang-up is held off meanwhile: it would cut the stop
short and leave processes running."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from repro.run.process import undisturbed
from repro.run.runner import stop_watched

STOP_S = 20.0  # how long a stop waits for the threads of the killed case processes to end


def results_in_order(futures: list[Future]) -> None:
    """Wait for every future; the first one in order that raised (among those done when one raised) raises here at
    once, not after the futures before it ended."""
    wait(futures, return_when=FIRST_EXCEPTION)
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    for f in futures:
        f.result()


def stop_in_flight(
    futures: list[Future],
    executors: list[ThreadPoolExecutor],
    close_launcher: Callable[[], None],
    busy: Callable[[], bool] = lambda: False,
    within_s: float = STOP_S,
) -> None:
    """Stop the run's case threads (see the module): the executors' pending cases cancelled and the executors let go
    without waiting, the launcher closed, the watched processes killed until every future is done and `busy`
    (another thread of cases) says no, within `within_s`."""
    with undisturbed():
        for ex in executors:  # the pending cases cancelled, the threads let go without waiting for them
            ex.shutdown(wait=False, cancel_futures=True)
        close_launcher()
        end = time.time() + within_s
        while (not all(f.done() for f in futures) or busy()) and time.time() < end:
            stop_watched()
            time.sleep(0.1)
