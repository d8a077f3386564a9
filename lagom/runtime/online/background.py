"""Rank 0's searches beside the running job: a daemon thread, a bounded share of one core, a budget.

No step hook waits for one of these: the session asks at each agreed step whether the search is ``done``
(one flag in the per-step agreement) and every rank adopts its result together at the step where it is.

Why a thread and not a process: the search works on what the session holds in this process (the step graph,
its simulator, the calibrated model: hundreds of MB at cluster scale), which a process would have to pickle
or build again, and a child process can outlive a job that crashes unless something reaps it. A daemon
thread shares all of it, ends with the process, and stops at its next evaluation when told to
(``Budget.stop``). One thread of Python runs at a time, so the search yields between evaluations: it sleeps
``(1 - share) / share`` times as long as it has just computed, which holds it to ``share`` of one core and
hands the interpreter back to the training loop that often.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lagom.search.driver import Budget

SHARE = 0.5  # of one core, at most, for a search beside the job
DEFAULT_SEARCH_S = 1200.0  # a search's wall-clock budget: room for a slower machine than ours (the 1,024-GPU search, about
# 75 s of one core here, takes about 150 s at half a core) and for the 2,048-GPU one
JOIN_S = 5.0  # how long ``stop`` waits for the thread to leave its evaluation


class Pacer:
    """Sleeps between evaluations so that the time computed is at most ``share`` of the time passed."""

    def __init__(self, share: float = SHARE) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self.slept = 0.0
        self._since = time.perf_counter()

    def pause(self) -> None:
        busy = time.perf_counter() - self._since
        rest = busy * (1 - self.share) / self.share
        if rest > 0:
            time.sleep(rest)
            self.slept += rest
        self._since = time.perf_counter()


class SearchThread:
    """A search running beside the job: ``search(budget)`` in a daemon thread; ``done`` once its payload (a dict
    every rank can receive) is ready. ``budget.cut`` says afterwards whether it stopped early."""

    def __init__(self, search: Callable[[Budget], dict[str, Any]], seconds: float | None = DEFAULT_SEARCH_S,
                 share: float = SHARE, name: str = "lagom-search") -> None:
        self.pacer = Pacer(share)
        self.budget = Budget(seconds, threading.Event(), self.pacer.pause)
        self.payload: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, args=(search,), name=name, daemon=True)
        self._thread.start()

    def _run(self, search: Callable[[Budget], dict[str, Any]]) -> None:
        self.payload = search(self.budget)

    @property
    def done(self) -> bool:
        return self.payload is not None

    def stop(self, wait: bool = True) -> None:
        """Stop the search at its next evaluation; ``wait``: a little, for the thread to end (idempotent)."""
        assert self.budget.stop is not None
        self.budget.stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_S)
