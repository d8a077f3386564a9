"""Whether the plan is what runs: NCCL's own account of each collective (the profiler's records) against the
plan's choice for its key.

``compare`` is pure: it takes the drained records, the plan, and the group of each communicator hash
(``drain.group_names``), and returns one ``KeyRun`` per planned key that ran, plus the records it could not
place. ``mismatch_lines`` gives one line per key where NCCL ran something else, with the reason where it is
known; ``markdown`` the report's what-ran table.

What is compared, per key:
  - a key the tuner plugin has a rule for (``config.by_tuner``): NCCL's algorithm, protocol and channels;
    a different algorithm or protocol means the rule did not fire; fewer channels than planned is NCCL's
    own trimming (small messages use fewer channels; ring and tree are capped by the communicator's count);
    and the chunk, where NCCL's network proxy reported it (``CollectiveRecord.chunk_bytes``: calls between
    nodes only, no profiler version gives the chunk of a transfer inside a node): a smaller one is NCCL's clamp.
  - a key planned on copy engines (CTA policy ZERO): whether NCCL ran it on copy engines.
  - any other key, the send/recv keys among them (a send or a receive is placed on its transfer's send_recv
    key, as ``lagom.model.reconcile`` counts it): NCCL decides, and the table only says what it chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from lagom.nccl_profiler.drain import CollectiveRecord, GroupMatch, joined
from lagom.nccl_tuner.live import PluginCounters
from lagom.plan.comm_config import CTAPolicy, Decomposition
from lagom.plan.plan import Plan, PlanEntry


@dataclass(frozen=True)
class Planned:
    """The plan's choice for a key, in the profiler's names (lowercase NCCL names)."""

    algorithm: str
    protocol: str
    channels: int
    by_tuner: bool
    copy_engine: bool
    chunk_bytes: int

    @classmethod
    def of(cls, entry: PlanEntry) -> Planned:
        c = entry.config
        return cls(str(c.algorithm).lower(), str(c.protocol).lower(), c.channels, c.by_tuner,
                   c.cta_policy == CTAPolicy.ZERO, c.chunk_bytes)


class Ran(NamedTuple):
    """What NCCL ran for one call: ``chunk_bytes`` 0 where its proxy reported none."""

    algorithm: str | None
    protocol: str | None
    channels: int
    copy_engine: bool
    p2p: bool
    chunk_bytes: int

    @classmethod
    def of(cls, record: CollectiveRecord) -> Ran:
        return cls(record.algorithm, record.protocol, record.channels, record.copy_engine, record.p2p,
                   record.chunk_bytes)


@dataclass
class KeyRun:
    """What NCCL ran for one planned key: the calls seen and each choice's count."""

    key: str
    planned: Planned
    calls: int = 0
    ran: Counter[Ran] = field(default_factory=Counter)
    mismatched: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def most_run(self) -> Ran:
        return self.ran.most_common(1)[0][0]


@dataclass
class Comparison:
    """``keys``: the planned keys that ran, in plan order. ``unplaced``: records of a communicator no group
    was matched to (counted by its hash). ``unplanned``: records of a known group that no key covers."""

    keys: list[KeyRun]
    unplaced: Counter[int] = field(default_factory=Counter)
    unplanned: int = 0


def _not_fired(tuner: PluginCounters | None) -> str:
    """Why a tuner rule did not fire, as far as the tuner's counters tell."""
    if tuner is not None and tuner.inits == 0:
        return "NCCL never initialised Lagom's tuner plugin in this process (NCCL_TUNER_PLUGIN unset or set too late)"
    return ("plugin not loaded, no rule for this communicator's rank and node counts, or an NCCL group asked once at "
            "its members' total size")


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"


def _reason(planned: Planned, ran: Ran, tuner: PluginCounters | None = None) -> str:
    """Why one call differs from the plan; '' when it does not."""
    algorithm, protocol, channels, copy_engine = ran.algorithm, ran.protocol, ran.channels, ran.copy_engine
    if planned.copy_engine and not copy_engine:
        return ("planned on copy engines (CTA policy ZERO), ran as a kernel: NCCL uses copy engines only for "
                "buffers registered in a symmetric window on one NVLink domain")
    if not planned.by_tuner:
        return ""
    if copy_engine:
        return "planned for the tuner's kernel, ran on copy engines (the communicator's CTA policy is ZERO)"
    if (algorithm, protocol) != (planned.algorithm, planned.protocol):
        return f"the tuner rule did not fire: NCCL ran {algorithm}/{protocol} ({_not_fired(tuner)})"
    if channels < planned.channels:
        return (f"NCCL ran {channels} channels of the planned {planned.channels} (too little data to fill them, or "
                "capped by the communicator's channels" + (", NVLS's own count" if algorithm == "nvls" else "") + ")")
    if channels > planned.channels:
        return f"NCCL ran {channels} channels, more than the planned {planned.channels}"
    if ran.chunk_bytes and ran.chunk_bytes < planned.chunk_bytes:
        return (f"NCCL clamped the chunk to {_size(ran.chunk_bytes)} of the planned {_size(planned.chunk_bytes)} (it "
                "caps a tuner's chunk at what its buffer holds, NCCL_BUFFSIZE / 8 steps times the algorithm's chunk "
                "steps, and rounds it down to the protocol's grain)")
    if ran.chunk_bytes > planned.chunk_bytes:
        return (f"NCCL ran a {_size(ran.chunk_bytes)} chunk, more than the planned {_size(planned.chunk_bytes)}: the "
                "tuner's getChunkSize did not set it (rules of different chunks for this call, or a tuner before v3)")
    return ""


def compare(records: Iterable[CollectiveRecord], plan: Plan, groups: Mapping[int, GroupMatch],
            tuner: PluginCounters | None = None) -> Comparison:
    """Each record placed on its plan key (by group, collective and whole-buffer size, as the recorder places calls;
    the collectives of one coalesced launch joined into NCCL's aggregates first, a send or receive on its transfer's
    send_recv key) and checked against the plan's choice for that key. ``tuner``: the tuner plugin's counters
    (``lagom.nccl_tuner.live.counters()``), which say whether NCCL loaded it at all."""
    runs: dict[str, KeyRun] = {}
    out = Comparison(keys=[])
    for record in joined(list(records)):  # a coalesced launch's collectives as the aggregates NCCL tuned
        match = groups.get(record.comm_hash)
        if match is None or match.group is None or record.function is None:
            out.unplaced[record.comm_hash] += 1
            continue
        entry = plan.lookup(match.group, "send_recv" if record.p2p else record.function, record.bytes)
        if entry is None or entry.config.decomposition != Decomposition.COLLECTIVE:
            out.unplanned += 1
            continue
        run = runs.get(entry.key)
        if run is None:
            run = runs[entry.key] = KeyRun(entry.key, Planned.of(entry))
        run.calls += 1
        ran = Ran.of(record)
        run.ran[ran] += 1
        reason = _reason(run.planned, ran, tuner)
        if reason:
            run.mismatched += 1
            run.reasons[reason] += 1
    order = {e.key: i for i, e in enumerate(plan.entries)}
    out.keys = sorted(runs.values(), key=lambda r: order[r.key])
    return out


def mismatch_lines(comparison: Comparison) -> list[str]:
    """One line per key where NCCL did not run the plan, with its most frequent reason."""
    lines = []
    for run in comparison.keys:
        if run.mismatched:
            reason, _ = run.reasons.most_common(1)[0]
            lines.append(f"{run.key}: {run.mismatched} of {run.calls} calls not as planned: {reason}")
    if comparison.unplaced:
        lines.append(f"{sum(comparison.unplaced.values())} calls on {len(comparison.unplaced)} communicators "
                     "matched to no group (several groups of that size, none named): not compared")
    return lines


def _choice(ran: Ran) -> str:
    if ran.copy_engine:
        return "copy engines"
    what = "send/recv" if ran.p2p else f"{ran.algorithm or '?'}/{ran.protocol or '?'}"
    return f"{what} x{ran.channels}" + (f", chunk {_size(ran.chunk_bytes)}" if ran.chunk_bytes else "")


def markdown(comparison: Comparison) -> str:
    """The report's what-ran table: per key, the plan's choice, what NCCL ran most, and the calls that differ."""
    rows = ["| key | planned | NCCL ran (most calls) | calls | not as planned |", "|---|---|---|---:|---:|"]
    for run in comparison.keys:
        p = run.planned
        planned = ("copy engines" if p.copy_engine else
                   f"{p.algorithm}/{p.protocol} x{p.channels}, chunk {_size(p.chunk_bytes)}" if p.by_tuner else
                   "NCCL decides")
        rows.append(f"| {run.key} | {planned} | {_choice(run.most_run())} | {run.calls} | {run.mismatched} |")
    return "\n".join(rows) + "\n"
