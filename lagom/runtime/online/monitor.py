"""Watches a running job and says when its plan has gone stale.

Two signs: the overlap efficiency (the physical bound of a step over its measured time) falls
clearly below what it was when the plan went into force, or the job issues collectives the plan
never saw (another batch size, sequence length or bucket layout). Each is reported once; after a
drift the baseline is measured afresh, so a re-tune is asked for once per change, not every step.

A fall in efficiency is put down to the keys whose collectives got slower per call, against their own
time over the baseline's steps, by more than the threshold (``drifted``): online mode re-tunes those
keys on live steps and leaves the rest as they are. A drift no key accounts for, or new sizes the plan
never saw, asks for a whole re-tune (``drifted`` None).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.plan import Plan
from lagom.step.calls import SIZE_TOLERANCE, CallRecord, KeyIndex, mean_per_call
from lagom.step.workload import Workload

log = logging.getLogger("lagom.monitor")
MAX_KEYS_SHOWN = 5


class Monitor:
    """``bound_s``: the step's physical limit, max(uncontended compute, comm at link peak).

    The baseline efficiency is the mean of the first ``warmup`` observations; later ones are
    smoothed over the last ``window`` steps (at least ``warmup`` of them before judging, so one
    slow step — a checkpoint, a GC pause — is not a drift). ``keys``: the plan's tuning keys; without
    them, the keys seen during the first warm-up are the reference. Sizes within ``size_tolerance``
    of a reference key (framework padding) count as that key.
    """

    def __init__(self, expected_step_s: float, bound_s: float, threshold: float = 0.1, warmup: int = 3,
                 window: int = 20, *, keys: Iterable[str] | None = None, size_tolerance: float = SIZE_TOLERANCE) -> None:
        for name, value in (("expected_step_s", expected_step_s), ("bound_s", bound_s)):
            if not value > 0:
                raise ConfigError(f"Monitor.{name}", f"must be positive, got {value}")
        if not 0 < threshold < 1:
            raise ConfigError("Monitor.threshold", f"must be between 0 and 1, got {threshold}", "e.g. 0.1 for 10%")
        if warmup < 1 or window < 1:
            raise ConfigError("Monitor.warmup" if warmup < 1 else "Monitor.window", "must be at least 1")
        self.expected_step_s, self.bound_s, self.threshold = expected_step_s, bound_s, threshold
        self.warmup, self.window, self.size_tolerance = warmup, window, size_tolerance
        self.baseline: float | None = None
        self._warm_sum = self._warm_step_sum = 0.0
        self._warm_n = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._recent_sum = 0.0
        self._from_plan = keys is not None
        self._reference: set[str] = set(keys or ())
        self._index: KeyIndex | None = KeyIndex(self._reference, size_tolerance) if keys is not None else None
        self._seen: set[str] = set()  # keys already judged (matched or reported)
        self.drifted: frozenset[str] | None = None  # after a drift: the keys it is put down to (None: no key)
        self._key_base: dict[str, list[float]] = {}  # key -> [sum of per-call seconds, steps] over the baseline
        self._key_recent: dict[str, deque[float]] = {}  # key -> its per-call seconds over the recent steps

    @property
    def efficiency(self) -> float | None:
        """The smoothed efficiency since the baseline was set (None before)."""
        return self._recent_sum / len(self._recent) if self._recent else None

    @classmethod
    def for_plan(cls, workload: Workload, hw: Hardware, plan: Plan, **kwargs) -> Monitor:
        """A monitor whose expectations are the plan simulated on the job as it runs under it."""
        from lagom.model.simulator import simulate
        from lagom.tune import problem_for, running_workload

        problem = problem_for(running_workload(workload, plan), hw)
        result = simulate(problem.graph, plan.configs(), problem.model)
        return cls(result.step_s, max(result.compute_s, result.comm_peak_s), **kwargs)

    def observe(self, step_s: float, records: Iterable[CallRecord] | None = None) -> str | None:
        """Take one step; return (and log) why the plan should be re-tuned, or None."""
        if not step_s > 0:
            raise ConfigError("Monitor.observe step_s", f"must be positive, got {step_s}")
        reasons = []
        new = None
        if records is not None:
            records = list(records)
            new = self._new_keys(records)
            if new:
                reasons.append(new)
            self._per_key(records)
        slower = self._slower_keys()
        drift = self._efficiency(self.bound_s / step_s, step_s)
        if drift:
            reasons.append(drift)
        if not reasons:
            return None
        self.drifted = frozenset(slower) if drift and not new and slower else None
        if self.drifted:
            reasons.append(f"slower per call: {self._shown(sorted(self.drifted))}")
        reason = "; ".join(reasons)
        log.warning("%s", reason)
        return reason

    def _efficiency(self, eff: float, step_s: float) -> str | None:
        if self.baseline is None:
            self._warm_sum += eff
            self._warm_step_sum += step_s
            self._warm_n += 1
            if self._warm_n == self.warmup:
                self._set_baseline()
            return None
        if len(self._recent) == self._recent.maxlen:
            self._recent_sum -= self._recent[0]
        self._recent.append(eff)
        self._recent_sum += eff
        if len(self._recent) < min(self.warmup, self.window):
            return None
        smoothed = self._recent_sum / len(self._recent)
        if smoothed >= self.baseline * (1 - self.threshold):
            return None
        reason = (f"overlap efficiency {smoothed:.2f} < baseline {self.baseline:.2f} - {self.threshold:.0%}: "
                  "re-tune (workload or network changed)")
        self.baseline, self._warm_sum, self._warm_step_sum, self._warm_n = None, 0.0, 0.0, 0
        self._recent.clear()
        self._recent_sum = 0.0
        self._key_base.clear()
        self._key_recent.clear()
        return reason

    def _per_key(self, records: list[CallRecord]) -> None:
        """Each key's mean seconds per call this step: into its baseline while that is measured, else into
        its recent steps. Keys are the plan's, or while the reference is still learned, the step's own."""
        index = self._index
        for key, seconds in mean_per_call(records, (lambda k: k) if index is None else index.match).items():
            if self.baseline is None:
                base = self._key_base.setdefault(key, [0.0, 0.0])
                base[0] += seconds
                base[1] += 1
            elif key in self._key_base:
                self._key_recent.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def _slower_keys(self) -> list[str]:
        """Keys whose recent calls are slower than over the baseline by more than the threshold."""
        out = []
        for key, recent in self._key_recent.items():
            total, steps = self._key_base[key]
            if len(recent) >= min(self.warmup, self.window) and \
                    sum(recent) / len(recent) > total / steps * (1 + self.threshold):
                out.append(key)
        return out

    @staticmethod
    def _shown(keys: list[str]) -> str:
        more = len(keys) - MAX_KEYS_SHOWN
        return ", ".join(keys[:MAX_KEYS_SHOWN]) + (f" and {more} more" if more > 0 else "")

    def _set_baseline(self) -> None:
        self.baseline = self._warm_sum / self._warm_n
        step = self._warm_step_sum / self._warm_n
        log.info("baseline overlap efficiency %.2f over %d steps (%.4g s/step measured, %.4g s predicted by the plan)",
                 self.baseline, self._warm_n, step, self.expected_step_s)
        if self._index is None:
            self._index = KeyIndex(self._reference, self.size_tolerance)
            self._seen |= self._reference

    def _new_keys(self, records: Iterable[CallRecord]) -> str | None:
        keys = {r.key for r in records}
        if self._index is None:  # still learning the reference from the warm-up
            self._reference |= keys
            return None
        unseen = keys - self._seen
        if not unseen:
            return None
        self._seen |= unseen
        new = sorted(k for k in unseen if self._index.match(k) is None)
        if not new:
            return None
        return f"new collective sizes seen: {self._shown(new)} ({'not in the plan' if self._from_plan else 'not seen during warm-up'})"
