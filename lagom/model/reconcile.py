"""The step as measured: a modelled step graph reconciled with the collectives a job really issued.

The workload model describes a framework's buckets, gathers and transfers from the model's shape; a stock
model, another framework version or a custom layer issues other calls. A plan whose keys the job never calls
tunes nothing that runs. So after the first measured steps the graph is made to match them:

- a measured call that matches no modelled key (``KeyIndex``: same group and collective, size within the
  tolerance) becomes a point of its own, with its measured size, once per call of the step, placed on the
  compute stream by its measured start and end relative to the step: released by the compute segment that
  runs at its start, waited for by the segment that runs after its end (or the step's end);
- modelled keys that no call matched are dropped (their points go): the search spends nothing on them;
- what still cannot be placed (a collective or group the model has no notion of) is listed, unplanned;
- a receive is the same transfer as its sender's send/recv: it counts under that key and is never a
  point of its own.

Placement reads the modelled compute timeline of a phase that runs once per step (repeating phases, such as
a pipeline's steady state, keep their modelled points), scaled to the measured step. ``coverage`` says what
share of the measured calls and bytes per step are keys of a graph, before and after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from lagom.hardware import Hardware
from lagom.model.cost_model import CostModel
from lagom.step.calls import SIZE_TOLERANCE, CallRecord, KeyIndex
from lagom.step.graph import Collective, Group, OverlapPoint, Phase, StepGraph, group_span

COLLECTIVES = {c.value: c for c in Collective}
RECEIVE = "recv"  # the receiving half of a send/recv: the same transfer as its sender's send_recv key


def _key(r: CallRecord) -> str:
    """The key a measured call is counted under: a receive under its transfer's send_recv key."""
    return f"{r.group}/{Collective.SEND_RECV.value}/{r.nbytes}" if r.collective == RECEIVE else r.key


@dataclass(frozen=True)
class Coverage:
    """Share of the measured calls and bytes per step that are keys of a graph."""

    calls: float
    bytes: float

    def describe(self) -> str:
        return f"{self.calls:.0%} of calls, {self.bytes:.0%} of bytes"


@dataclass
class Reconciled:
    """The reconciled graph and what reconciliation did."""

    graph: StepGraph
    before: Coverage
    after: Coverage
    added: list[str] = field(default_factory=list)  # keys made from measured calls
    dropped: list[str] = field(default_factory=list)  # modelled keys no call matched
    unplanned: list[str] = field(default_factory=list)  # measured keys that could not be placed

    def summary(self) -> dict[str, object]:
        return {"before": {"calls": self.before.calls, "bytes": self.before.bytes},
                "after": {"calls": self.after.calls, "bytes": self.after.bytes},
                "added": self.added, "dropped": self.dropped, "unplanned": self.unplanned}


def coverage(keys: Iterable[str], records: Iterable[CallRecord], tolerance: float = SIZE_TOLERANCE) -> Coverage:
    """Share of ``records`` (calls and bytes) whose key matches one of ``keys`` (a receive: its transfer's)."""
    index = KeyIndex(keys, tolerance)
    calls = matched_calls = 0
    nbytes = matched_bytes = 0
    for r in records:
        calls += 1
        nbytes += r.nbytes
        if index.match(_key(r)) is not None:
            matched_calls += 1
            matched_bytes += r.nbytes
    return Coverage(matched_calls / calls if calls else 1.0, matched_bytes / nbytes if nbytes else 1.0)


def _group(name: str, graph: StepGraph, hw: Hardware) -> Group | None:
    """The graph's group of that name, or one made from a name that says its ranks ("world", "ranks0-2-4")."""
    if name in graph.groups:
        return graph.groups[name]
    gpus_per_node, world = hw.cluster.gpus_per_node, hw.cluster.world_size
    ranks: list[int] | None = None
    if name == "world":
        ranks = list(range(world))
    elif name.startswith("ranks") and all(part.isdigit() for part in name[5:].split("-")):
        ranks = [int(part) for part in name[5:].split("-")]
    if not ranks or len(ranks) < 2:
        return None
    stride = ranks[1] - ranks[0]
    per_node, nodes = group_span(len(ranks), max(1, stride), gpus_per_node)
    return Group(name, len(ranks), per_node, nodes)


def _once_per_step(graph: StepGraph) -> Phase | None:
    """The phase measured calls are placed in: the last that runs once per step (all of a step without a
    pipeline; the drain and optimizer of one with)."""
    once = [ph for ph in graph.phases if ph.repeat == 1 and ph.segments.get(0)]
    return once[-1] if once else None


def _placement(phase: Phase, model: CostModel) -> list[tuple[float, str]]:
    """(end as a share of the phase's compute, segment name) of device 0's segments, in stream order."""
    segments = phase.segments[0]
    times = [model.compute_solo(s) for s in segments]
    total = sum(times) or 1.0
    out, elapsed = [], 0.0
    for seg, t in zip(segments, times):
        elapsed += t
        out.append((elapsed / total, seg.name))
    return out


def _segment_at(timeline: list[tuple[float, str]], share: float) -> int:
    """Index of the segment running at ``share`` of the phase."""
    for i, (end, _) in enumerate(timeline):
        if share <= end:
            return i
    return len(timeline) - 1


def reconcile(graph: StepGraph, hw: Hardware, records: list[CallRecord], steps: dict[int, float],
              tolerance: float = SIZE_TOLERANCE) -> Reconciled:
    """``graph`` made to match the measured steps: ``records`` of all of them (``steps``: each step's number and
    time, the one to place calls from first) decide which modelled keys are called and what the coverage is. A
    key no modelled one matches is placed from the first of ``steps`` that called it, once per call there."""
    modelled = list(graph.keys())
    index = KeyIndex(modelled, tolerance)
    called = {index.match(_key(r)) for r in records} - {None}
    phase = _once_per_step(graph)
    timeline = _placement(phase, CostModel(hw)) if phase is not None else []
    added: list[OverlapPoint] = []
    unplanned: set[str] = set()
    placed: set[str] = set()
    for step, step_s in steps.items():
        # a receive is placed by its sender's record (on the sending rank): never a point of its own
        calls = sorted((r for r in records if r.step == step and r.collective != RECEIVE and index.match(r.key) is None),
                       key=lambda r: (r.start_s, r.seq))
        new_keys = {r.key for r in calls} - placed - unplanned
        for r in calls:
            if r.key not in new_keys:
                continue
            group, collective = _group(r.group, graph, hw), COLLECTIVES.get(r.collective)
            if group is None or collective is None or phase is None or not timeline or step_s <= 0:
                unplanned.add(r.key)
                continue
            first = _segment_at(timeline, min(1.0, max(0.0, r.start_s / step_s)))
            last = _segment_at(timeline, min(1.0, max(0.0, r.end_s / step_s)))
            before = timeline[last + 1][1] if r.exact and last + 1 < len(timeline) else None
            added.append(OverlapPoint(f"{phase.name}.measured{len(added)}.{r.collective}", collective, group, r.nbytes,
                                      after=timeline[first][1] if first > 0 or r.start_s > 0 else None, before=before,
                                      phase=phase.name))
        placed |= new_keys - unplanned
    dropped = [k for k in modelled if k not in called]
    gone = set(dropped)
    phases = []
    for ph in graph.phases:
        points = [p for p in ph.points if p.key not in gone]
        if ph is phase:
            points += added
        phases.append(replace(ph, points=points))
    groups = {**graph.groups, **{p.group.name: p.group for p in added}}
    reconciled = replace(graph, phases=phases, groups=groups)
    return Reconciled(reconciled, coverage(modelled, records, tolerance),
                      coverage(reconciled.keys(), records, tolerance), sorted({p.key for p in added}), dropped,
                      sorted(unplanned))
