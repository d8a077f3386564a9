"""A progress line for planning calls (tune, compare, reproduce): steps simulated and the best step so
far, shown once a call has run for more than a second (a quick plan prints nothing extra) and on
stderr, so JSON on stdout stays clean."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import Progress as Bar
from rich.progress import SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from lagom.tune import Progress

SHOW_AFTER_S = 1.0


def describe(what: str, progress: Progress) -> str:
    """The line: what is being planned, steps simulated so far, the best step of the strategy searching."""
    return f"{what}: {progress.evaluations} steps simulated, {progress.strategy} best {progress.best_step_s * 1e3:.2f} ms"


class PlanningProgress:
    """Pass as ``progress=`` to make_plan / compare_strategies inside ``with``."""

    def __init__(self, what: str, console: Console | None = None, show_after_s: float = SHOW_AFTER_S) -> None:
        self.what, self.show_after_s = what, show_after_s
        self.console = console or Console(stderr=True)
        self.started = time.perf_counter()
        self.shown: tuple[Bar, TaskID] | None = None  # the bar, once the call has run long enough
        self.last: Progress | None = None

    def __enter__(self) -> PlanningProgress:
        self.started = time.perf_counter()
        return self

    def __call__(self, progress: Progress) -> None:
        self.last = progress
        if self.shown is None:
            if time.perf_counter() - self.started < self.show_after_s:
                return
            bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=self.console, transient=True)
            bar.start()
            self.shown = (bar, bar.add_task(self.what))
        bar, task = self.shown
        bar.update(task, description=self.describe(progress))

    def describe(self, progress: Progress) -> str:
        return describe(self.what, progress)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self.shown is not None:
            self.shown[0].stop()
