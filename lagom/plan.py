"""A plan: the chosen config per tuning key, versioned, fingerprinted, saved as JSON.

A plan is made for one workload on one machine; loading it for another world size, workload or
hardware profile is an error that says which, so a stale plan never runs silently.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lagom.calls import KeyIndex, TuningKey
from lagom.comm_config import CommConfig
from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.workload import Workload

PLAN_VERSION = 1


@dataclass
class PlanEntry:
    """One tuning key: a communicator, a collective, a message size, and the points that share it."""

    key: str
    group: str
    group_size: int
    group_nodes: int
    collective: str
    bytes: int
    count: int  # calls per step
    points: list[str]  # point names (a sample when there are many)
    config: CommConfig
    note: str = ""
    predicted_comm_s: float = 0.0  # per step, under interference
    predicted_exposed_s: float = 0.0


@dataclass
class Plan:
    workload: str
    workload_fingerprint: str
    hardware: str
    hardware_fingerprint: str
    world_size: int
    strategy: str
    entries: list[PlanEntry]
    predicted_step_s: dict[str, float]  # strategy -> simulated step time
    evaluations: int = 0
    framework: dict[str, Any] = field(default_factory=dict)  # bucket sizes for megatron / deepspeed
    version: int = PLAN_VERSION
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def __post_init__(self) -> None:
        self._index: KeyIndex | None = None  # built on the first lookup; entries do not change after that

    def entry(self, key: str) -> PlanEntry | None:
        return next((e for e in self.entries if e.key == key), None)

    def configs(self) -> dict[str, CommConfig]:
        return {e.key: e.config for e in self.entries}

    def by_group(self) -> dict[str, list[PlanEntry]]:
        out: dict[str, list[PlanEntry]] = {}
        for e in self.entries:
            out.setdefault(e.group, []).append(e)
        return out

    def lookup(self, group: str, collective: str, nbytes: int) -> PlanEntry | None:
        """The entry for a call seen at run time, by the one matching rule of ``lagom.calls.KeyIndex``."""
        if self._index is None:
            self._index = KeyIndex(e.key for e in self.entries)
        key = self._index.match(TuningKey(group, collective, int(nbytes)))
        return None if key is None else self.entry(key)

    # -- persistence
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> Plan:
        if data.get("version") != PLAN_VERSION:
            raise ConfigError(f"{where}.version", f"plan version {data.get('version')} is not {PLAN_VERSION}",
                              "re-run `lagom tune` to make a plan for this Lagom")
        try:
            entries = [PlanEntry(**{**e, "config": CommConfig.from_dict(e["config"], f"{where}.entries[{i}].config")})
                       for i, e in enumerate(data["entries"])]
            return cls(**{**data, "entries": entries})
        except (KeyError, TypeError) as err:
            raise ConfigError(where, f"malformed plan ({err})", "re-run `lagom tune`") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError("plan", f"cannot read {path}: {err}") from None
        return cls.from_dict(data, Path(path).name)

    def check_for(self, world_size: int, workload: Workload | None = None, hw: Hardware | None = None) -> None:
        """Refuse a plan made for another topology, workload or machine."""
        if world_size != self.world_size:
            raise ConfigError("plan.world_size", f"plan was made for {self.world_size} ranks, this job has {world_size}",
                              "re-run `lagom tune` for this layout")
        if workload is not None and workload.fingerprint() != self.workload_fingerprint:
            raise ConfigError("plan.workload_fingerprint", f"plan was made for workload '{self.workload}', not this one",
                              "re-run `lagom tune` with this job's workload")
        if hw is not None and hw.fingerprint() != self.hardware_fingerprint:
            raise ConfigError("plan.hardware_fingerprint", f"plan was made for hardware '{self.hardware}', not '{hw.name}'",
                              "re-run `lagom tune --hardware` for this machine")
