"""What identifies a collective (TuningKey), one measured call (CallRecord), and the one rule that
matches a measured size to a planned one (KeyIndex).

Frameworks pad buffers (megatron rounds buckets up, DeepSpeed aligns partitions), so a measured
call is the planned key of the same communicator and collective whose size is nearest, when that
size is within ``SIZE_TOLERANCE``. Plans, the runtime, the monitor, the online tuner, the reports
and the NCCL tuner rules all match through this rule. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lagom.errors import ConfigError

SIZE_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class TuningKey:
    """(communicator, collective, message bytes): the finest grain stock NCCL can configure.

    ``str(key)`` is the text form used in plans and reports: ``group/collective/bytes``.
    """

    group: str
    collective: str
    nbytes: int

    def __str__(self) -> str:
        return f"{self.group}/{self.collective}/{self.nbytes}"

    @classmethod
    def parse(cls, text: str) -> TuningKey:
        parts = str(text).rsplit("/", 2)
        if len(parts) != 3 or not parts[2].isdigit() or not parts[0] or not parts[1]:
            raise ConfigError("tuning key", f"'{text}' is not group/collective/bytes")
        return cls(parts[0], parts[1], int(parts[2]))

    def within(self, nbytes: int, tolerance: float = SIZE_TOLERANCE) -> bool:
        """Whether a call of ``nbytes`` is close enough to be this key."""
        return abs(self.nbytes - nbytes) <= tolerance * max(self.nbytes, 1)


class CallRecord(NamedTuple):
    """One collective call: times in seconds from the start of the step it was issued in.

    ``exact`` is False when the work had no completion callback, so ``end_s`` is when its caller
    waited for it or the step ended: an upper bound. ``tensors``: how many tensors of one coalesced
    operation NCCL runs as this one call (``nccl_aggregates``); ``nbytes`` is their total.

    A named tuple: the recorder makes one per call of the job, every step, and a tuple of the recorder's row is made
    in one C call (``tuple.__new__(CallRecord, row)``), where a dataclass ran a Python ``__init__`` (about 0.1 us
    more a call). Fields, their order, keyword construction, equality of two records and the repr are a dataclass's;
    a record is also a tuple of its fields (iterable, comparable, hashable, read-only).
    """

    group: str
    collective: str
    nbytes: int
    seq: int  # issue order within the step
    step: int
    start_s: float
    end_s: float
    exact: bool = True
    tensors: int = 1

    @property
    def tuning_key(self) -> TuningKey:
        return TuningKey(self.group, self.collective, self.nbytes)

    @property
    def key(self) -> str:
        return str(self.tuning_key)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


AGGREGATE_RATIO = 4  # NCCL joins a call to an aggregate while it is under this many times the smallest's bytes


def nccl_aggregates(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The calls NCCL makes of collectives issued in one group (one ncclGroupStart/End: a coalesced
    operation) that share function, reduction and data type: (total bytes, how many), smallest first.

    NCCL (2.30, ``src/enqueue.cc``) takes a group's tasks of one function, op and type smallest
    first and joins to the smallest not yet joined every next one of under 4x its bytes; it plans,
    and asks the tuner's getCollInfo, once per aggregate at its total size. Its order is by bins of a
    quarter power of two, so a call within 25% of the 4x edge may land on the other side there.
    """
    out: list[tuple[int, int]] = []
    ordered = sorted(int(s) for s in sizes)
    i = 0
    while i < len(ordered):
        first, j = ordered[i], i + 1
        while j < len(ordered) and ordered[j] < AGGREGATE_RATIO * first:
            j += 1
        out.append((sum(ordered[i:j]), j - i))
        i = j
    return out


class KeyIndex:
    """Matches a measured key to a known one: same group and collective, nearest size within tolerance."""

    def __init__(self, keys: Iterable[str | TuningKey], tolerance: float = SIZE_TOLERANCE) -> None:
        self.tolerance = tolerance
        self._keys: dict[tuple[str, str], list[TuningKey]] = {}
        for key in keys:
            k = key if isinstance(key, TuningKey) else TuningKey.parse(key)
            self._keys.setdefault((k.group, k.collective), []).append(k)

    def match_key(self, key: str | TuningKey) -> TuningKey | None:
        k = key if isinstance(key, TuningKey) else TuningKey.parse(key)
        known = self._keys.get((k.group, k.collective))
        if not known:
            return None
        best = min(known, key=lambda c: abs(c.nbytes - k.nbytes))
        return best if best.within(k.nbytes, self.tolerance) else None

    def match(self, key: str | TuningKey) -> str | None:
        """The known key's text form, or None."""
        found = self.match_key(key)
        return None if found is None else str(found)


def mean_per_call(records: Iterable[CallRecord], key_of: Callable[[str], str | None]) -> dict[str, float]:
    """Each key's mean seconds per call over ``records``; ``key_of`` names a record's key (None: left out)."""
    calls: dict[str, list[float]] = {}
    for r in records:
        key = key_of(r.key)
        if key is not None:
            row = calls.setdefault(key, [0, 0.0])
            row[0] += 1
            row[1] += r.duration_s
    return {key: total / n for key, (n, total) in calls.items()}
