"""Live tuning: the priority search with the job's own steps as its evaluator.

The cost model ranks each key's candidates and orders the keys, as offline; each move the search wants
checked is put in force on the running job (through the tuner plugin's live table and the Flash-Overlap
routing, the settings that can change between steps) and judged by the steps that follow. The search
runs in a thread on rank 0 (``LiveSearch``): its ``evaluate`` hands a candidate to the step loop and
waits; the step loop (``after_step``, called once per agreed step with the step's slowest-rank
measurements) runs the candidate for ``window`` steps, then the reference for ``window`` steps, and
answers. Every rank puts the same settings in force at the same step because rank 0's decision reaches
every rank through Lagom's agreement channel before the next step is issued (the session does that).

Measuring:
- noise: the reference (the settings in force when tuning began) runs ``noise_steps`` steps first; the
  spread of its steps about their window's mean, pooled with every later reference window's, is the
  step-to-step noise (drift between windows does not count);
- windows: each window has as many steps as a gain of ``DETECT`` needs to be found with ``POWER`` under
  that noise (at least ``window``, at most a twelfth of the step budget): more steps on a noisy job;
- drift: reference windows alternate with candidate windows (A/B/A); a candidate is judged against the
  mean of the reference windows before and after it, and reported on the first reference's scale;
- acceptance: a candidate is reported faster only when a one-sided t-test of its gain rejects "no faster" at
  ``alpha`` (``ALPHA``, 2%): a setting that changes nothing is accepted in that share of its trials. The test's
  spread is the trial's own (its candidate window and the reference window after it), not the pooled noise:
  the pooled noise chose the windows' length, short where it read low, so testing with it accepted 2.4-3.0%
  of trials of a setting that changed nothing. The windows are sized for the test's own degrees of freedom.
  A candidate the test does not find faster is reported no faster than the best so far, so the search does
  not take it;
- calls: a trial whose changed keys had no calls in its window measured nothing, and is refused unscored;
- guard: a candidate step slower than ``GUARD`` times the reference ends its window at once;
- budget: once ``budget_steps`` steps (less four windows: the windows under way and the final check) or
  ``budget_s`` seconds are spent, every further candidate is answered "no gain" without running, so the
  search ends with what it has measured, within its budget; a step the loop could not judge (a device
  clock further behind than budgeted) spends budget too;
- no wait: the step loop never waits for the search thread. While it thinks, the reference stays in
  force and its steps lengthen the reference window the next candidate is judged against;
- last: the search's final settings run once more against the reference; if they are not faster, the
  reference stays. The job never ends tuning on settings slower than the measured baseline.
"""

from __future__ import annotations

import logging
import math
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field, fields, replace
from statistics import NormalDist
from typing import Any

from scipy.special import stdtr, stdtrit

from lagom.model.simulator import Configs, Simulator, StepResult
from lagom.plan.capability import channel_cap
from lagom.plan.comm_config import CommConfig
from lagom.runtime.online.tuner import Observation
from lagom.search.base import Problem, SearchResult
from lagom.search.driver import refine

log = logging.getLogger("lagom.online")

LIVE_FIELDS = ("algorithm", "protocol", "channels", "chunk_bytes", "decomposition", "num_chunks", "by_tuner")
ROUTED_FIELDS = ("decomposition", "num_chunks")  # what Lagom routes itself: live even where NCCL ignores the plugin
GUARD = 2.0  # a candidate step this many times the reference's is switched back at once
ALPHA = 0.02  # false-accept rate of one trial of a setting no faster than the reference (one-sided t-test)
DETECT = 0.03  # the gain (a share of the step) a window is sized to find ...
POWER = 0.8  # ... with this probability
WINDOW = 2  # the fewest steps per candidate window and per reference window
SEARCH_STEPS = 2  # steps a spent budget keeps for the search thread to answer its last request itself
NOISE_STEPS = 4  # reference steps measured before the first candidate
DEFAULT_BUDGET_S = 300.0  # wall-clock budget of the live search (steps: the tune_steps option)
ANSWER_TIMEOUT_S = 600.0  # the search thread's longest think between two candidates (the job runs on meanwhile)


def live_part(cfg: CommConfig, running: CommConfig, max_channels: int | None,
              live_fields: tuple[str, ...] = LIVE_FIELDS) -> tuple[CommConfig, bool]:
    """``cfg``'s live-settable fields on ``running``'s fixed ones (threads, buffer, priority, CTA policy
    wait for the next start); channels above ``max_channels`` (what NCCL runs on the communicator:
    ``capability.channel_cap``) are clamped (the bool says so)."""
    live = replace(running, **{name: getattr(cfg, name) for name in live_fields})
    if max_channels is not None and live.channels > max_channels:
        return replace(live, channels=max_channels), True
    return live, False


def changed(configs: Configs, reference: Configs) -> dict[str, dict[str, Any]]:
    """Keys whose live fields differ from the reference: their configs, as dicts (the report's form)."""
    return {k: cfg.to_dict() for k, cfg in configs.items()
            if any(getattr(cfg, n) != getattr(reference[k], n) for n in LIVE_FIELDS)}


def describe_live(configs: Configs, reference: Configs) -> list[str]:
    """One line per key whose live fields moved: what was put in force on the running job."""
    out = []
    for key, cfg in configs.items():
        before = reference.get(key)
        moved = [f"{n} {getattr(before, n)} -> {getattr(cfg, n)}" for n in LIVE_FIELDS
                 if before is not None and getattr(cfg, n) != getattr(before, n)]
        if moved:
            out.append(f"{key}: {', '.join(moved)} (measured live)")
    return out


def trial_note(decision: str, step_s: float, reference_s: float, p: float, alpha: float, *,
               final: bool = False) -> str:
    """The sentence a trial's decision is reported with, built from the figures its row prints (the window's mean
    step and the reference it was judged against) and the test's p-value of "no faster"."""
    change = step_s / reference_s - 1 if reference_s > 0 else 0.0
    direction = f"{-change:.1%} faster" if change < 0 else f"{change:.1%} slower"
    figures = f"{step_s * 1e3:.2f} ms against {reference_s * 1e3:.2f} ms, {direction}"
    if decision == "refused":
        return f"{figures}: refused unscored, its changed keys had no calls in its window"
    if decision == "reverted" and not final:
        return f"a step took over {GUARD:g}x the reference: switched back at once ({figures})"
    if final:
        return figures + ("" if decision == "kept" else ": not faster, the reference stays")
    if decision == "kept":
        return f"{figures}: significant (p {p:.2g} < {alpha:g})"
    if change >= 0:
        return figures
    if p >= alpha:
        return f"{figures}: within the noise (p {p:.2g}, needs < {alpha:g})"
    return f"{figures}: not faster than the best setting so far"


class Noise:
    """The reference's step-to-step spread, relative to each window's own mean, pooled over its windows: drift
    between windows does not count. ``sd`` is one step's relative standard deviation, with ``dof`` degrees of
    freedom."""

    def __init__(self) -> None:
        self.squares, self.dof = 0.0, 0

    def add(self, window: Window) -> None:
        mean = window.mean if window.step_s else 0.0
        if len(window.step_s) < 2 or mean <= 0:
            return
        self.squares += sum((x / mean - 1) ** 2 for x in window.step_s)
        self.dof += len(window.step_s) - 1

    @property
    def sd(self) -> float:
        return math.sqrt(self.squares / self.dof) if self.dof else 0.0

    def p_no_gain(self, gain: float, candidate: int, reference: float) -> float:
        """One-sided p-value of "the candidate is no faster" for a measured relative ``gain`` of a candidate window
        of ``candidate`` steps against a reference of ``reference`` steps (the mean of two windows of b and a
        steps counts as 4 / (1/b + 1/a))."""
        se = self.sd * math.sqrt(1 / candidate + 1 / reference)
        if self.dof == 0 or se == 0:
            return 0.0 if gain > 0 else 1.0
        return float(stdtr(self.dof, -gain / se))

    def steps_to_find(self, gain: float, alpha: float, power: float) -> int:
        """Steps per window (at least 2) for a candidate window and two reference windows of as many steps to find
        ``gain`` with probability ``power`` at false-accept rate ``alpha``, where the test's spread comes from the
        candidate window and one reference window (``judge``): 2 (steps - 1) degrees of freedom."""
        if self.dof == 0 or self.sd == 0:
            return 2
        beta = NormalDist().inv_cdf(power)
        steps = max(2, math.ceil(1.5 * (self.sd * (NormalDist().inv_cdf(1 - alpha) + beta) / gain) ** 2))
        while 1.5 * (self.sd * (float(stdtrit(2 * (steps - 1), 1 - alpha)) + beta) / gain) ** 2 > steps:
            steps += 1
        return steps


def judge(candidate: Window, before: Window, after: Window) -> tuple[float, float, float]:
    """The reference (the mean of its windows before and after the candidate: drift cancels), the candidate's step
    over it, and the one-sided p-value of "no faster". The spread is measured on the candidate window and the
    window after it, data that did not choose the windows' length, so the t-test is exact whatever the length."""
    reference = (before.mean + after.mean) / 2
    ratio = candidate.mean / reference if reference > 0 else 1.0
    spread = Noise()
    spread.add(candidate)
    spread.add(after)
    return reference, ratio, spread.p_no_gain(1 - ratio, len(candidate.step_s),
                                              4 / (1 / len(before.step_s) + 1 / len(after.step_s)))


@dataclass
class Window:
    """Steps run under one setting: each step's time and each key's collective seconds per call."""

    steps: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    keys: list[dict[str, float]] = field(default_factory=list)

    def add(self, step: int, step_s: float, keys: dict[str, float]) -> None:
        self.steps.append(step)
        self.step_s.append(step_s)
        self.keys.append(keys)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.step_s)

    def key_means(self) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for row in self.keys:
            for k, v in row.items():
                out.setdefault(k, []).append(v)
        return {k: statistics.fmean(v) for k, v in out.items()}


@dataclass
class Trial:
    """One tried setting, as the report keeps it (``validate --measured`` reads these)."""

    id: str
    steps: list[int]
    changed: dict[str, dict[str, Any]]
    predicted: dict[str, Any]  # {"step_s", "collectives_s": {key: s}}
    measured: dict[str, Any]  # {"step_s", "collectives_s": {key: s}, "reference_step_s"}
    decision: str  # kept | rejected | reverted
    confidence: float  # probability that the setting is faster than the reference, from the measured noise
    note: str = ""


class MeasuredStep(StepResult):
    """A step as the search sees it live: the model's prediction for the settings (exposure, the windows the
    search ranks by) with the measured step time and per-key collective seconds put in."""

    measured_keys: dict[str, float]

    def per_key(self) -> dict[str, dict[str, float]]:
        rows = super().per_key()
        for key, seconds in self.measured_keys.items():
            if key in rows and rows[key]["count"]:
                rows[key] = {**rows[key], "time": seconds * rows[key]["count"]}
        return rows


def measured_step(predicted: StepResult, step_s: float, keys: dict[str, float]) -> MeasuredStep:
    out = MeasuredStep(**{f.name: getattr(predicted, f.name) for f in fields(StepResult)})
    out.step_s = step_s
    out.measured_keys = keys
    return out


class _Stopped(Exception):
    """The search thread is told to end."""


@dataclass
class Decision:
    """What rank 0 tells every rank after a step: the settings for the next step (None: unchanged), and
    when tuning is over, the settings it ends on."""

    configs: Configs | None = None
    done: bool = False


class LiveSearch:
    """Rank 0's live search: the priority search in a thread, the step loop's state, the trials."""

    def __init__(self, problem: Problem, simulator: Simulator, reference: Configs, *,
                 max_channels: dict[str, int] | None = None, budget_steps: int = 100,
                 budget_s: float = DEFAULT_BUDGET_S, window: int = WINDOW, noise_steps: int = NOISE_STEPS,
                 alpha: float = ALPHA, only: set[str] | None = None, first_trial: int = 1,
                 fields: tuple[str, ...] | None = None) -> None:
        self.problem, self.simulator = problem, simulator
        self.only = only  # the keys searched (those that drifted); None: every key
        self.first_trial = first_trial  # trial ids go on from an earlier round's in the same job
        self.reference = dict(reference)
        self.max_channels = max_channels or {}
        # the chunk is live only where the plugin sets it per size; else it is NCCL_BUFFSIZE, per process.
        # ``fields``: fewer (only what Lagom routes, where NCCL does not consult the plugin)
        self.fields = tuple(f for f in fields or LIVE_FIELDS if f not in problem.cap.process_fields())
        self.budget_steps, self.budget_s, self.noise_steps, self.alpha = budget_steps, budget_s, noise_steps, alpha
        self.min_window = max(2, window)  # the test needs two steps a window to measure its spread
        self.max_window = max(self.min_window, budget_steps // 12)
        self.window = self.min_window  # steps per window now: sized from the noise measured so far (``_size_windows``)
        self.refused = 0  # trials whose changed keys had no calls in their window
        self.accepted = 0  # trials the test found faster (some are superseded later)
        self.evaluations = 0
        self.trials: list[Trial] = []
        self.observations: list[Observation] = []  # every window measured: what ``online.refit`` fits to
        self.clamped: set[str] = set()
        self.result: SearchResult | None = None
        self.error: BaseException | None = None
        self.final: Configs = dict(reference)
        self.steps_used = 0
        self.steps_s = 0.0  # the live steps' measured time, all of them
        self.waited = 0  # steps that ran the reference while the search thread thought
        self._waiting_since: float | None = None
        self._started = time.perf_counter()
        self._requests: queue.Queue[Configs | None] = queue.Queue(maxsize=1)
        self._answers: queue.Queue[tuple[float, dict[str, float]] | None] = queue.Queue(maxsize=1)  # None: stop
        self._cache: dict[tuple, tuple[float, dict[str, float]]] = {}
        self._floor = math.inf  # the smallest step reported to the search so far (its best)
        self._ref0 = 0.0  # the reference's mean over the noise steps: the scale every report is on
        self._noise = Noise()
        self._state = "noise"
        self._window = Window()
        self._before: Window | None = None  # the reference window before the candidate
        self._candidate: Configs | None = None
        self._candidate_window: Window | None = None
        self._thread: threading.Thread | None = None
        self.spent = False

    # -- the search thread's side --------------------------------------------------------------------------
    def live_configs(self, configs: Configs) -> Configs:
        """What of ``configs`` runs live: their live fields, channels clamped to what NCCL runs on the key's
        communicator (the topology, the CTA range it was made with, NVLS CTAs)."""
        out, nccl = {}, self.problem.hw.nccl
        for key, cfg in configs.items():
            group = self.problem.keys[key][0].group if key in self.problem.keys else None
            most = None if group is None else channel_cap(
                str(cfg.algorithm), group.nodes, nccl.max_channels, max_ctas=self.max_channels.get(group.name),
                nvls_channels=nccl.nvls_channels)
            out[key], clamped = live_part(cfg, self.reference.get(key, cfg), most, self.fields)
            if clamped:
                self.clamped.add(key)
        return out

    def evaluate(self, configs: Configs) -> StepResult:
        self.evaluations += 1
        live = self.live_configs(configs)
        predicted = self.simulator.run(live, self.problem.model)
        frozen = tuple(sorted((k, tuple(getattr(c, n) for n in LIVE_FIELDS)) for k, c in live.items()))
        answer = self._cache.get(frozen)
        if answer is None:
            if self.spent:
                answer = (self._floor, {})  # the budget is spent: no gain, nothing run
            else:
                self._requests.put(live)
                got = self._answers.get()
                if got is None:
                    raise _Stopped("the session ended while the live search ran")
                answer = self._cache[frozen] = got
        return measured_step(predicted, *answer)

    def _search(self) -> None:
        try:
            start = SearchResult("live", dict(self.reference), self.evaluate(self.reference), 0)
            self.result = refine(self.problem, self, start, self.only)
        except BaseException as err:  # noqa: BLE001 - told to the step loop, which ends tuning on the reference
            self.error = err
        finally:
            try:
                self._requests.put_nowait(None)
            except queue.Full:  # stopped with a request unread: the step loop is gone, nobody reads it
                pass

    # -- the step loop's side ------------------------------------------------------------------------------
    def after_step(self, step: int, step_s: float, keys: dict[str, float]) -> Decision:
        """One measured step (the slowest rank's); the settings for the next one."""
        self.steps_used += 1
        self.steps_s += step_s
        self._spend()
        self._window.add(step, step_s, keys)
        if self._state == "waiting":  # the reference ran: it lengthens the window the next candidate is judged against
            assert self._before is not None
            self._before.add(step, step_s, keys)
            self._window = Window()
            return self._next()
        if self._state == "noise":
            if len(self._window.step_s) < self.noise_steps:
                return Decision()
            self._noise_measured(self._window)
            return self._next()
        if self._state in ("candidate", "final"):
            too_slow = step_s > GUARD * self._ref_mean()
            if len(self._window.step_s) < self.window and not too_slow:
                return Decision()
            self._candidate_window, self._window = self._window, Window()
            self._reverted = too_slow
            self._state = "after_" + self._state
            return Decision(configs=dict(self.reference))
        if len(self._window.step_s) < self.window:  # a reference window after a candidate
            return Decision()
        after, self._window = self._window, Window()
        if self._state == "after_final":
            return self._settle(after)
        self._answers.put(self._judge(after))
        self._before = after
        return self._next()

    def _spend(self) -> None:
        """Spent once what is left of the step budget is what the windows under way and the final check may
        still take (four windows), and the steps the search thread may still think for: the loop ends within
        its budget."""
        self.spent = self.spent or self.steps_used + 4 * self.window + SEARCH_STEPS >= self.budget_steps or \
            time.perf_counter() - self._started >= self.budget_s

    def unjudged_step(self) -> None:
        """A step the loop could not judge (its device time not known yet on some rank, or it ran other settings):
        it still spends the step budget."""
        self.steps_used += 1
        self._spend()

    def _noise_measured(self, window: Window) -> None:
        self._ref0 = window.mean
        self._noise.add(window)
        self._size_windows()
        self._floor = self._ref0
        self._cache[tuple(sorted((k, tuple(getattr(c, n) for n in LIVE_FIELDS)) for k, c in self.reference.items()))] = \
            (self._ref0, window.key_means())
        self._before = window
        self._window = Window()
        self._thread = threading.Thread(target=self._search, name="lagom-live-search", daemon=True)
        self._thread.start()

    def _size_windows(self) -> None:
        """Steps per window from the noise measured so far: a gain of ``DETECT`` found with ``POWER``."""
        self.window = max(self.min_window, min(self.max_window, self._noise.steps_to_find(DETECT, self.alpha, POWER)))

    def _ref_mean(self) -> float:
        return self._before.mean if self._before is not None else self._ref0

    def _next(self) -> Decision:
        """The search's next candidate in force, or (search over) the final check, or the end; while the search
        thread is still thinking, the reference for one more step (never a wait)."""
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            now = time.perf_counter()
            self._waiting_since = self._waiting_since or now
            if now - self._waiting_since < ANSWER_TIMEOUT_S:
                self._state = "waiting"
                self.waited += 1
                return Decision()
            self.error = TimeoutError(f"the live search thought for over {ANSWER_TIMEOUT_S:g} s")
            request = None
        self._waiting_since = None
        if request is not None and self.spent:  # asked before the budget ran out: answered "no gain", not run
            self._answers.put((self._floor, {}))
            self._state = "waiting"
            return Decision()
        if request is not None:
            self._candidate, self._state = request, "candidate"
            return Decision(configs=dict(request))
        found = self.result.configs if self.result is not None and self.error is None else self.reference
        self._candidate = self.live_configs(found)
        if not changed(self._candidate, self.reference):
            return self._end(self.reference, "the search kept the settings in force")
        self._state = "final"
        return Decision(configs=dict(self._candidate))

    def _judge(self, after: Window) -> tuple[float, dict[str, float]]:
        """The candidate's step on the first reference's scale, if the test finds it faster; its trial recorded."""
        window, candidate = self._candidate_window, self._candidate
        assert window is not None and candidate is not None and self._before is not None
        reference, ratio, p = judge(window, self._before, after)
        self._noise.add(after)
        value = self._ref0 * ratio
        moved = set(changed(candidate, self.reference))
        if moved and not moved & set(window.key_means()):
            decision = "refused"  # none of its keys was called: the window measured nothing of it
            self.refused += 1
        elif self._reverted:
            decision = "reverted"
        elif p < self.alpha and value < self._floor:
            decision = "kept"
            self.accepted += 1
        else:
            decision = "rejected"
        reported = value if decision == "kept" else max(value, self._floor)
        self._floor = min(self._floor, reported)
        note = trial_note(decision, window.mean, reference, p, self.alpha)
        self._record(window, candidate, after, reference, decision, 1 - p, note, observed=decision != "refused")
        self._size_windows()
        return reported, window.key_means()

    def _record(self, window: Window, configs: Configs, after: Window, reference_s: float, decision: str,
                confidence: float, note: str, observed: bool = True) -> None:
        predicted = self.simulator.run(configs, self.problem.model)
        per_key = predicted.per_key()
        if observed:
            self.observations += [Observation(dict(configs), window.mean, window.key_means()),
                                  Observation(dict(self.reference), after.mean, after.key_means())]
        self.trials.append(Trial(
            f"t{self.first_trial + len(self.trials)}", window.steps, changed(configs, self.reference),
            {"step_s": predicted.step_s,
             "collectives_s": {k: r["time"] / r["count"] for k, r in per_key.items() if r["count"]}},
            {"step_s": window.mean, "collectives_s": window.key_means(), "reference_step_s": reference_s},
            decision, confidence, note))

    def _settle(self, after: Window) -> Decision:
        """The final settings against the reference: kept only when faster."""
        window, candidate = self._candidate_window, self._candidate
        assert window is not None and candidate is not None
        faster = not self._reverted and window.mean < after.mean
        decision = "kept" if faster else "reverted"
        gain = 1 - window.mean / after.mean
        p = self._noise.p_no_gain(gain, len(window.step_s), len(after.step_s))
        self._record(window, candidate, after, after.mean, decision, 1 - p,
                     "final check: " + trial_note(decision, window.mean, after.mean, p, self.alpha, final=True))
        return self._end(candidate if faster else self.reference,
                         "the search's settings confirmed faster" if faster else "the reference was faster")

    def _end(self, configs: Configs, why: str) -> Decision:
        self.final = dict(configs)
        ending = changed(self.final, self.reference)
        for trial in self.trials:  # a gain the search later beat is not what the job keeps
            if trial.decision == "kept" and trial.changed != ending:
                trial.decision, trial.note = "rejected", trial.note + "; superseded by a faster setting"
        self._state = "done"
        if self.error is not None:
            why += f" (the search stopped early: {type(self.error).__name__}: {self.error})"
        self.why = why
        return Decision(configs=dict(configs), done=True)

    def stop(self) -> None:
        """End the search thread (the session is closing or Lagom switched off); idempotent."""
        if self._thread is None or not self._thread.is_alive():
            return
        try:
            self._answers.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)

    @property
    def noise(self) -> float:
        """Relative standard deviation of one window's mean step, as measured under the reference."""
        return self._noise.sd / math.sqrt(self.window)

    @property
    def reference_step_s(self) -> float:
        return self._ref0

    def cost_s(self) -> float:
        """What the live steps took beyond as many steps at the reference's mean (negative: they gained)."""
        return self.steps_s - self.steps_used * self._ref0

    @property
    def done(self) -> bool:
        return self._state == "done"

    def confidence(self) -> float:
        """Of the final settings: the last trial's, or 1.0 when the reference stayed."""
        return self.trials[-1].confidence if self.trials and self.final != self.reference else 1.0
