"""Lagom's priority search over the whole step.

Priority of a move for collective j: H_j = (Y' - Y) / (X_j - X_j'), the compute time it adds per
unit of comm time it saves (X: the collective's time, Y: the compute beside it, inflated by the
SMs and HBM the collective takes). Comm-bound collectives (exposed in the last evaluation) are
tuned first, cheapest speed-up (smallest H) first; then compute-bound ones give resources back,
the largest compute saving per unit of comm slowdown first. Each collective is tuned once: the cost
model ranks its candidates on its own windows, the evaluator (simulator or live steps) checks the
best few on the whole step. Then a joint revisit of collectives on different communicators that hold
up the same compute segment (or phase end): one tuned before such another one changed gets its best
few checked again; and each is moved together with the next such one (the pairings of both one's best
few that the cost model's joint estimate, as for groups below, says gain), since two of them may only pay
off together. Last, the keys that run beside one compute segment
move as a group (``sharing_compute``), since the GEMM there gets a wave back only when all of them give
SMs back: the cost model costs each group's moves jointly (the compute beside them slowed by all of them
at once, plus their comm it cannot hide), groups are taken by the gain it foresees, and only moves it
says gain are checked, the best GROUP_CHECKS. Each key is revisited at most once and is the first of at most one pair, and there are at
most as many groups as keys, so a search takes at most 1 + ``max_checks_per_key`` evaluations per
key: linear in the number of keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from lagom.model.choices import candidates
from lagom.model.cost_model import CostModel
from lagom.model.phase_index import NONE, PointColumns, first_seen, index_of, places
from lagom.model.simulator import Configs, StepResult
from lagom.model.windows import (
    Estimate,
    KeyOf,
    Window,
    estimate,
    running_instance,
    windows,
)
from lagom.plan.comm_config import CommConfig, channel_choices, with_communicator_value
from lagom.search.base import Evaluator, Problem, SearchResult, nccl_configs
from lagom.step.graph import ComputeSegment
from lagom.step.points import collector_paused

CHECKED_PER_KEY = 4  # candidates per collective confirmed with the evaluator
WINDOW_CHECKS = 2  # extra checks for a comm-bound collective, from the window ranking
REVISIT_CHECKS = 2  # checks for a key revisited after a key blocking the same compute changed
JOINT_WIDTH = 2  # candidates per key in a joint move of two keys (JOINT_WIDTH ** 2 evaluations per pair)
GROUP_CHECKS = 2  # moves of a set of keys sharing compute checked, the best the cost model foresees
GAIN_FLOOR = 1e-9  # a move the cost model says saves less than this share of the set's cost is not checked
MAX_CHECKS_PER_KEY = CHECKED_PER_KEY + WINDOW_CHECKS + REVISIT_CHECKS + JOINT_WIDTH**2



def priority(cur: Estimate, new: Estimate) -> float:
    """H = (Y' - Y) / (X - X'): compute added per unit of comm time saved."""
    saved = cur.comm - new.comm
    return (new.compute - cur.compute) / saved if saved else math.inf


def _predicted(est: Estimate) -> tuple[float, float]:
    """What an estimate predicts, as candidates are told apart: comm and compute, to the picosecond."""
    return round(est.comm, 12), round(est.compute, 12)


def _distinct(ranked: list[tuple[Estimate, CommConfig]], k: int, seen: set) -> list[tuple[Estimate, CommConfig]]:
    """The first k candidates whose predictions differ from each other and from ``seen``: checks go to
    distinct predictions, not to knobs the model says are moot. Of settings differing only in priority,
    only the best ranked is checked (the other differs only by the launch wait)."""
    out: list[tuple[Estimate, CommConfig]] = []
    for est, cfg in ranked:
        if len(out) == k:
            break
        predicted = _predicted(est)
        family = replace(cfg, priority=0)
        if predicted not in seen and family not in seen:
            seen.update((predicted, family))
            out.append((est, cfg))
    return out


def _checks(key: str, current: CommConfig, cur: Estimate, exposed: float, problem: Problem, graph: _Graph,
            options: list[CommConfig]) -> list[tuple[Estimate, CommConfig]]:
    """The candidates to evaluate for one key (now at ``current``, estimated ``cur``), best first, of its
    ``options``.

    Compute-bound: the smallest time the windows add (exposed comm plus slowdown). Comm-bound
    (``exposed`` > 0, the step's exposed comm): first the cheapest speed-ups, ranked by the exposed comm a
    move removes net of the compute it slows, since queueing on a communicator exposes more than each
    window alone shows; then the best of the window ranking (e.g. a decomposition, whose comm is longer
    but hidden). Last, ``current`` on the fewest channels the windows predict alike (``_fewest_channels``).
    """
    scored = [(graph.estimate(key, c, problem.model), c) for c in options]
    by_window = sorted(scored, key=lambda ec: (ec[0].added, ec[0].comm))
    seen = {_predicted(cur)}
    if exposed <= 0:
        checks = _distinct(by_window, CHECKED_PER_KEY, seen)
    else:
        by_speed = sorted(scored, key=lambda ec: (ec[0].compute - cur.compute - min(exposed, cur.comm - ec[0].comm), ec[0].comm))
        checks = _distinct(by_speed, CHECKED_PER_KEY, seen) + _distinct(by_window, WINDOW_CHECKS, seen)
    return checks + _fewest_channels(current, cur, scored, checks)


def _fewest_channels(current: CommConfig, cur: Estimate, scored: list[tuple[Estimate, CommConfig]],
                     checks: list[tuple[Estimate, CommConfig]]) -> list[tuple[Estimate, CommConfig]]:
    """``current`` on the fewest channels (any chunk) its windows predict the same comm and compute for, unless
    it is checked already: a window holds the compute between a collective's release and its need on the
    device that waits, while its CTAs also slow compute the window does not hold (a pipeline send runs
    beside the sender's next micro-batch), which only the step's simulation sees; the channels the windows
    call moot are the ones this frees."""
    alike = [(est, cfg) for est, cfg in scored if cfg.channels < current.channels
             and _predicted(est) == _predicted(cur)
             and replace(cfg, channels=current.channels, chunk_bytes=current.chunk_bytes) == current]
    fewest = min(alike, key=lambda ec: ec[1].channels, default=None)
    return [fewest] if fewest is not None and all(fewest[1] != cfg for _, cfg in checks) else []


def search(problem: Problem, evaluator: Evaluator, start: SearchResult | None = None,
           only: set[str] | None = None) -> SearchResult:
    """Tune every key (or only those in ``only``, the rest keeping ``start``'s configs, else NCCL's): one
    pass key by key, then the joint revisit (``revisits``, then ``pairs`` moved together)."""
    configs = nccl_configs(problem)
    notes: dict[str, str] = {}
    if start is not None:
        kept = {k: cfg for k, cfg in start.configs.items() if k in configs and (only is None or k not in only)}
        configs.update(kept)
        notes.update({k: start.notes[k] for k in kept if k in start.notes})
    graph = prepared(problem)
    tuning = _Tuning(problem, evaluator, configs, notes, evaluator.evaluate(configs), graph)
    per_key = tuning.best.per_key()
    plans = []
    for key in problem.keys if only is None else [k for k in problem.keys if k in only]:
        cur, checks, comm_bound = tuning.checks(key, per_key)
        h = priority(cur, checks[0][0]) if checks else math.inf
        # Comm-bound first, smallest H first; then compute-bound, largest compute saving per comm added.
        plans.append(((0, h) if comm_bound else (1, -h if math.isfinite(h) else 0.0), key, cur, checks, comm_bound))
    order, changed = [], set()
    for _, key, cur, checks, comm_bound in sorted(plans, key=lambda p: p[0]):
        order.append(key)
        if tuning.apply(key, cur, checks, comm_bound):
            changed.add(key)
        else:
            notes[key] = "kept NCCL's choice: no candidate improved the step"
    blocking = graph.blocking
    for key in revisits(blocking, order, changed):  # revisits and pairs are among the keys of the pass
        cur, checks, comm_bound = tuning.checks(key, tuning.best.per_key())
        tuning.apply(key, cur, checks[:REVISIT_CHECKS], comm_bound, "revisited after a collective blocking the "
                     "same compute changed: ")
    for first, second in pairs(blocking, order):
        tuning.joint(first, second)
    # groups by the gain the cost model gives their best move, none where it foresees none; with ``only``,
    # each set's keys among them (two at least) move, the others keep what they have
    shared = graph.shared if only is None else {keys & only: v for keys, v in graph.shared.items() if len(keys & only) > 1}
    gains = {keys: tuning.group_gain(keys, shared[keys][1]) for keys in shared}
    for keys in sorted((keys for keys in shared if gains[keys] > 0), key=gains.__getitem__, reverse=True)[:len(problem.keys)]:
        tuning.together(keys, shared[keys][1])
    return SearchResult("lagom", configs, tuning.best, evaluator.evaluations, notes)


@dataclass
class _Graph:
    """What every search of one step graph under one model works out once (the per-process passes search
    one graph twice): the (group, collective, bytes) -> key map, each key's windows, the keys blocking one
    compute, the sets sharing compute, and each (key, config)'s estimate."""

    key_of: KeyOf
    wins: dict[str, list[Window]]
    blocking: Blocking
    shared: dict[frozenset[str], tuple[float, Shared]]
    estimates: dict[tuple[str, CommConfig], Estimate] = field(default_factory=dict)

    def estimate(self, key: str, cfg: CommConfig, model: CostModel) -> Estimate:
        found = self.estimates.get((key, cfg))
        if found is None:
            found = self.estimates[(key, cfg)] = estimate(cfg, self.wins[key], model)
        return found


def prepared(problem: Problem) -> _Graph:
    """The problem's ``_Graph``: built on its first search, kept with it (``Problem.derived``)."""
    graph = problem.derived.get("priority")
    if graph is None:
        key_of = KeyOf()
        with collector_paused():
            graph = problem.derived["priority"] = _Graph(key_of, windows(problem.graph, key_of), blocked_together(problem, key_of),
                                                         shared_segments(problem, key_of))
    return graph


@dataclass
class _Tuning:
    """A search under way: the configs so far and the best step they gave."""

    problem: Problem
    evaluator: Evaluator
    configs: Configs
    notes: dict[str, str]
    best: StepResult
    graph: _Graph
    _candidates: dict[str, list[CommConfig]] = field(default_factory=dict)

    def estimate(self, key: str, cfg: CommConfig) -> Estimate:
        return self.graph.estimate(key, cfg, self.problem.model)

    def candidates(self, key: str) -> list[CommConfig]:
        """The key's candidates in this search's space, worked out once: every check and group move asks."""
        found = self._candidates.get(key)
        if found is None:
            found = self._candidates[key] = candidates(self.problem.keys[key][0], self.problem.hw, self.problem.space)
        return found

    def checks(self, key: str, per_key: dict[str, dict[str, float]]) -> tuple[Estimate, list[tuple[Estimate, CommConfig]], bool]:
        """The key's estimate under its config now, its candidates best first, and whether it is comm-bound."""
        cur = self.estimate(key, self.configs[key])
        exposed = per_key[key]["exposed"]
        return cur, _checks(key, self.configs[key], cur, self.best.exposed_comm_s if exposed > 0 else 0.0, self.problem,
                            self.graph, self.candidates(key)), exposed > 0

    def apply(self, key: str, cur: Estimate, checks: list[tuple[Estimate, CommConfig]], comm_bound: bool,
              why: str = "") -> bool:
        """Evaluate the checks with the other keys as they are; keep the best if it improves the step."""
        chosen = None
        for est, cfg in checks:
            result = self.evaluator.evaluate({**self.configs, key: cfg})
            if result.step_s < self.best.step_s:
                self.best, chosen = result, (cfg, est)
        if chosen is None:
            return False
        cfg, est = chosen
        self.configs[key] = cfg
        window = "comm-bound" if comm_bound else "compute-bound"
        if cfg.decomposition == "p2p":
            note = (f"{window}: Flash-Overlap P2P decomposition ({cfg.num_chunks} chunk(s) per peer), "
                    "all but the first step hidden under the GEMM it feeds")
        elif est.comm < cur.comm:
            note = f"{window}: faster comm, H={priority(cur, est):.3g} compute s added per comm s saved"
        else:
            note = f"{window}: resources given back, {cur.compute - est.compute:.3g} s compute saved per step"
        self.notes[key] = why + note
        return True

    def joint(self, first: str, second: str) -> None:
        """Move two keys together: each one's best JOINT_WIDTH candidates (ranked as in the first pass, with
        the exposure they have now), every pairing the cost model says gains (``group_cost`` of the pair
        and every key beside the compute both run beside). Two collectives that hold up the same compute
        may only pay off together: the SMs they take free a wave of a GEMM only when both give them back,
        and a faster one is no use while the other still blocks."""
        per_key = self.best.per_key()
        choices = {key: [cfg for _, cfg in self.checks(key, per_key)[1][:JOINT_WIDTH]] for key in (first, second)}
        pair = frozenset((first, second))
        segments = list({id(seg): (seg, within, n) for keys, (_, shared) in self.graph.shared.items() if pair <= keys
                         for seg, within, n in shared if pair <= within}.values())
        beside = pair.union(*(within for _, within, _ in segments))
        now = self.group_cost(beside, {}, segments)
        chosen = None
        for a in choices[first]:
            for b in choices[second]:
                # pruned only where the two share compute: the joint estimate leaves out what one key slows alone
                if segments and now - self.group_cost(beside, {first: a, second: b}, segments) <= GAIN_FLOOR * now:
                    continue
                result = self.evaluator.evaluate({**self.configs, first: a, second: b})
                if result.step_s < self.best.step_s:
                    self.best, chosen = result, (a, b)
        if chosen is None:
            return
        for key, cfg, other in ((first, chosen[0], second), (second, chosen[1], first)):
            self.configs[key] = cfg
            self.notes[key] = f"moved together with {other} (both hold up the same compute): {cfg.describe()}"

    def group_moves(self, keys: frozenset[str], segments: Shared) -> list[tuple[float, Configs]]:
        """The moves of a set of keys that run beside the same compute, each with the seconds the cost
        model says it saves (``group_cost``), best first; only those it says save some. A move takes every key
        to its best-ranked candidate, or all of them to one channel count below the most any has
        (``_on_channels``). None for a set whose collectives are all exposed: they hold the step up, and fewer
        channels only slow them."""
        per_key = self.best.per_key()
        if all(per_key[key]["exposed"] > 0 for key in keys):
            return []
        ranked = {key: self.checks(key, per_key)[1] for key in keys}
        moves = [{key: checks[0][1] for key, checks in ranked.items() if checks}]
        most = max(self.configs[key].channels for key in keys)
        for channels in channel_choices(self.problem.hw, self.problem.space):
            if channels < most:
                moves.append({key: self._on_channels(key, channels) for key in keys})
        now = self.group_cost(keys, {}, segments)
        scored = [(now - self.group_cost(keys, move, segments), n, move) for n, move in enumerate(moves)
                  if any(self.configs[key] != cfg for key, cfg in move.items())]
        return [(gain, move) for gain, _, move in sorted(scored, key=lambda g: (-g[0], g[1])) if gain > GAIN_FLOOR * now]

    def _on_channels(self, key: str, channels: int) -> CommConfig:
        """The key's setting on ``channels`` channels for a group move: its current one on that many, unless the
        window estimate ranks another of its candidates on that many better (a tree chosen on 8 channels
        across nodes may be slower than a ring on 2, where the ring was not)."""
        point = self.problem.keys[key][0]
        now = with_communicator_value("channels", channels, point, self.configs[key], self.problem.cap)
        alike = [cfg for cfg in self.candidates(key) if cfg.channels == channels]
        return min([now, *alike], key=lambda cfg: (self.estimate(key, cfg).added, self.estimate(key, cfg).comm))

    def group_gain(self, keys: frozenset[str], segments: Shared) -> float:
        """The most seconds the cost model says a move of the set saves (0: none)."""
        moves = self.group_moves(keys, segments)
        return moves[0][0] if moves else 0.0

    def group_cost(self, keys: frozenset[str], move: Configs, segments: Shared) -> float:
        """Seconds the set's collectives cost the step under ``move`` (the rest as now), by the cost model:
        the compute they all run beside, slowed by all of them at once (a GEMM gets a wave back only when
        every one gives SMs back), plus each one's comm beyond the compute that hides it."""
        model = self.problem.model
        involved = keys.union(*(within for _, within, _ in segments))  # with ``only``, keys beside that stay put
        configs = {key: move.get(key, self.configs[key]) for key in involved}
        util = max((model.hbm_util(seg) for seg, _, _ in segments), default=0.0)
        running = {key: running_instance(cfg, self.problem.keys[key][0], False, util, True, model)[2]
                   for key, cfg in configs.items()}
        beside = sum(n * model.compute_time(seg, tuple(running[key] for key in sorted(within)))
                     for seg, within, n in segments)
        return beside + sum(self.estimate(key, configs[key]).beyond for key in keys)

    def together(self, keys: frozenset[str], segments: Shared) -> None:
        """Move every key that runs beside one compute segment at once, to the best GROUP_CHECKS moves the
        cost model says gain (``group_moves``). The GEMM there loses the SMs of all of them together, so a
        wave it gets back may need every one to give some back, which no move of one key (or two) shows."""
        chosen = None
        for _, move in self.group_moves(keys, segments)[:GROUP_CHECKS]:
            result = self.evaluator.evaluate({**self.configs, **move})
            if result.step_s < self.best.step_s:
                self.best, chosen = result, move
        if chosen is None:
            return
        for key, cfg in chosen.items():
            if cfg != self.configs[key]:
                self.configs[key] = cfg
                self.notes[key] = (f"moved with {', '.join(sorted(keys - {key}))} (all run beside the same "
                                   f"compute): {cfg.describe()}")


def group_moves(problem: Problem) -> int:
    """The most evaluations one ``_Tuning.together`` makes: GROUP_CHECKS of the best-ranked move and one per
    channel count."""
    return min(GROUP_CHECKS, 1 + len(channel_choices(problem.hw, problem.space)))


def max_checks_per_key(problem: Problem) -> int:
    """Evaluations per key a search makes at most (after the first): the key-by-key pass, its revisit,
    one pair, and one group move (at most as many groups as keys)."""
    return MAX_CHECKS_PER_KEY + group_moves(problem)


def sharing_compute(problem: Problem, key_of: KeyOf | None = None) -> list[frozenset[str]]:
    """The sets of two or more keys whose collectives may run beside one compute segment (released before
    it, needed after it) on one device, the most compute seconds covered first. Only the largest: a set
    within another is the same competition for that GEMM's SMs with fewer of its competitors moved."""
    shared = shared_segments(problem, key_of)
    return sorted(shared, key=lambda keys: shared[keys][0], reverse=True)


Shared = list[tuple[ComputeSegment, frozenset[str], int]]  # a segment, the keys beside it, occurrences per step


def shared_segments(problem: Problem, key_of: KeyOf | None = None) -> dict[frozenset[str], tuple[float, Shared]]:
    """The largest sets of ``sharing_compute``, each with the compute seconds it covers and every segment
    that two or more of its keys run beside (distinct segments, with those keys and the occurrences per
    step): a move of the set frees SMs on all of them.

    On each device a key runs beside the segments of its collectives' spans (``PointColumns.lo`` to ``hi``;
    sends run beside nothing here): counting, between consecutive span ends, how many of each key's spans are open
    gives the set of keys beside each stretch of segments, on the phase index's arrays."""
    key_of = KeyOf() if key_of is None else key_of
    beside_segments: dict[frozenset[str], dict[tuple, list]] = {}  # signature -> [segment, count]
    for phase in problem.graph.phases:
        ix = index_of(phase)
        c = ix.columns
        keys = key_of.numbered(phase)
        kinds, signatures = ix.kind_arrays
        for device, segs in phase.segments.items():
            mine = np.flatnonzero((c.device == device) & (c.peer == NONE))
            if not len(mine):
                continue
            numbered, at, of = _beside(c, mine, len(segs))
            sets = [frozenset(keys[k] for k in numbers.tolist()) for numbers in numbered]
            for keyset in sets:  # in the order they first run, stretches without a segment included
                beside_segments.setdefault(keyset, {})
            pair, pair_first = first_seen(of, kinds[device][at])
            times = np.bincount(pair, minlength=len(pair_first)) * phase.repeat
            for f, n in zip(pair_first.tolist(), times.tolist()):
                seg = segs[at[f]]
                beside_segments[sets[of[f]]].setdefault(signatures[kinds[device][at[f]]], [seg, 0])[1] += n
    covered = {beside: sum(problem.model.compute_solo(seg) * n for seg, n in found.values())  # once per distinct segment
               for beside, found in beside_segments.items()}
    return {keys: (seconds, [(seg, within, n) for within, found in beside_segments.items() if within <= keys
                             for seg, n in found.values()])
            for keys, seconds in covered.items() if not any(keys < other for other in covered)}


def _beside(c: PointColumns, mine: np.ndarray, count: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """On one device of ``count`` segments, from its collectives ``mine``: the distinct sets of two keys or more
    running beside a stretch between two span ends (as key numbers, in the order they first run), and each
    segment of such a stretch, in order, with its set's place among them."""
    bounds, stretch = np.unique(np.concatenate([c.lo[mine], c.hi[mine]]), return_inverse=True)  # i: [bounds[i], bounds[i + 1])
    present, local = np.unique(c.key[mine], return_inverse=True)
    opened = np.zeros((len(bounds), len(present)), dtype=np.int64)
    np.add.at(opened, (stretch, np.concatenate([local, local])), np.repeat([1, -1], len(mine)))
    running = np.cumsum(opened, axis=0) > 0  # per stretch and key: one of the key's spans holds it
    shared = np.flatnonzero(running.sum(axis=1) > 1)
    which, firsts = first_seen(*running[shared].T)
    ends = np.minimum(np.append(bounds[1:], count)[shared], count)
    starts = np.minimum(bounds[shared], ends)
    lengths = ends - starts
    at = np.repeat(starts, lengths) + places(lengths)
    return [present[running[shared[f]]] for f in firsts.tolist()], at, np.repeat(which, lengths)


Blocking = tuple[list[set[str]], dict[str, str]]  # key sets blocking one segment each; each key's communicator


def blocked_together(problem: Problem, key_of: KeyOf | None = None) -> Blocking:
    """The distinct sets of keys whose collectives block one compute segment (or one phase's end) of one
    device (a send blocks its receiver), and each key's communicator."""
    key_of = KeyOf() if key_of is None else key_of
    sets: dict[frozenset[str], None] = {}
    for phase in problem.graph.phases:
        ix = index_of(phase)
        c = ix.columns
        keys = key_of.numbered(phase)
        blocked, _ = first_seen(np.where(c.peer != NONE, c.peer, c.device), c.before)
        _, firsts = first_seen(blocked, c.key)  # each (blocked segment, key) once
        several = np.flatnonzero(np.bincount(blocked[firsts]) > 1)
        members = np.isin(blocked[firsts], several)
        found: dict[int, set[str]] = {}
        for b, k in zip(blocked[firsts[members]].tolist(), c.key[firsts[members]].tolist()):
            found.setdefault(b, set()).add(keys[k])
        sets.update(dict.fromkeys(frozenset(keyset) for keyset in found.values()))
    return [set(keys) for keys in sets], {key: points[0].group.name for key, points in problem.keys.items()}


def revisits(blocking: Blocking, order: list[str], changed: set[str]) -> list[str]:
    """Keys to tune once more after the key-by-key pass, in ``order`` (the pass's): those tuned before a key
    on another communicator whose collective blocks the same compute segment (or the same phase end) as one
    of theirs changed its config. Such a key was tuned while the other still held that segment up, so a
    faster collective of its own gained nothing then; it may now. Each key comes back at most once."""
    sets, group = blocking
    position = {key: n for n, key in enumerate(order)}
    out: set[str] = set()
    for keys in sets:
        moved = sorted((position[k] for k in keys if k in changed), reverse=True)  # latest first
        for key in keys:
            if key not in position or key in out:
                continue
            for later in moved:
                if later <= position[key]:
                    break
                if group[order[later]] != group[key]:
                    out.add(key)
                    break
    return sorted(out, key=position.__getitem__)


def pairs(blocking: Blocking, order: list[str]) -> list[tuple[str, str]]:
    """Pairs of keys on different communicators that block the same compute, to move together: each key
    with the next such key in ``order``, so at most one pair per key."""
    sets, group = blocking
    position = {key: n for n, key in enumerate(order)}
    partner: dict[str, str] = {}
    for keys in sets:
        tuned = sorted((k for k in keys if k in position), key=position.__getitem__)
        for n, key in enumerate(tuned):
            if key in partner:
                continue
            other = next((k for k in tuned[n + 1:] if group[k] != group[key]), None)
            if other is not None:
                partner[key] = other
    return sorted(partner.items(), key=lambda pair: position[pair[0]])
