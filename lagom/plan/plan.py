"""A plan: the chosen config per tuning key, versioned, fingerprinted, saved as JSON.

A plan is made for one workload on one machine; loading it for another world size, workload or
hardware profile is an error that says which, so a stale plan never runs silently.

It is also made under one capability (``lagom.plan.capability``): the record is kept in the plan, the
per-process knobs are held once in ``process`` (never per entry), and ``needs`` says what a
process with less capability lacks to run it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.capability import Capability, Scope
from lagom.plan.comm_config import TUNER_COLLECTIVES, Algorithm, CommConfig, CTAPolicy, Transport
from lagom.step.calls import KeyIndex, TuningKey
from lagom.step.workload import Workload

PLAN_VERSION = 2


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
    # The per-process knobs' values, once for every entry (NCCL_NTHREADS, NCCL_P2P_DISABLE, and
    # NCCL_BUFFSIZE's chunk when the tuner cannot set chunks per size). Derived from the entries when
    # a plan is built without it; entries that disagree are an error.
    process: dict[str, Any] = field(default_factory=dict)
    capability: dict[str, Any] = field(default_factory=dict)  # Capability.to_dict() it was planned under
    # Buffers the framework must register symmetrically (ZERO CTA policy): {group, collectives, bytes}
    registration: list[dict[str, Any]] = field(default_factory=list)
    # A plan tuned on live steps: how many steps and trials decided it and the confidence of its gain
    measured: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def __post_init__(self) -> None:
        self._index: KeyIndex | None = None  # built on the first lookup; entries do not change after that
        if not self.process:
            self.process = self._common_process()
        for i, e in enumerate(self.entries):
            for name, value in self.process.items():
                if getattr(e.config, name) != self._value_for(name, value, e):
                    raise ConfigError(f"plan.entries[{i}].config.{name}",
                                      f"{getattr(e.config, name)} differs from the plan's per-process {name} {value}",
                                      "a per-process knob has one value for every entry: re-run `lagom tune`")

    @staticmethod
    def _value_for(name: str, value: Any, entry: PlanEntry) -> Any:
        """A per-process value as one entry runs it: shm only reaches peers inside a node."""
        return Transport.P2P if name == "transport" and entry.group_nodes > 1 else value

    def _common_process(self) -> dict[str, Any]:
        """Per-process values from entries made without a ``process`` section: threads and transport always,
        the chunk where the capability says NCCL_BUFFSIZE sets it."""
        fields = list(self.capability_record().process_fields()) if self.capability else ["threads", "transport"]
        out: dict[str, Any] = {}
        for name in fields:
            values = {str(getattr(e.config, name)) if name == "transport" else getattr(e.config, name)
                      for e in self.entries if not (name == "transport" and e.group_nodes > 1)}
            if len(values) > 1:
                raise ConfigError(f"plan.entries.config.{name}", f"a per-process knob with {len(values)} values "
                                  f"({', '.join(sorted(map(str, values)))})", "give every entry one value, or re-run `lagom tune`")
            if values:
                out[name] = values.pop()
        return out

    def capability_record(self) -> Capability:
        """The capability the plan was made under (a plan without one: Lagom's defaults)."""
        return Capability.from_dict(self.capability, "plan.capability") if self.capability else Capability()

    def needs(self, available: Capability) -> list[str]:
        """What this plan uses that ``available`` cannot apply, one phrase each (empty: it runs as planned)."""
        missing: list[str] = []
        planned = self.capability_record()
        if self.capability and planned.per_size and not available.per_size and any(
                e.collective in TUNER_COLLECTIVES and e.config.decomposition == "collective" for e in self.entries):
            missing.append("Lagom's NCCL tuner plugin for per-size algorithm, protocol and channels "
                           f"({'not built' if not available.tuner_plugin else 'NCCL ' + available.nccl_version + ' cannot load it'}; "
                           "it needs NCCL >= 2.24)")
        chunks = {e.config.chunk_bytes for e in self.entries if e.config.decomposition == "collective"}
        if (self.capability and planned.scope("chunk") == Scope.PER_SIZE and len(chunks) > 1
                and available.scope("chunk") != Scope.PER_SIZE and available.per_size):
            missing.append(f"per-size chunks (tuner interface v6, NCCL >= 2.30; this NCCL is {available.nccl_version})")
        for policy in sorted({e.config.cta_policy for e in self.entries} - {CTAPolicy.DEFAULT}):
            if policy not in available.cta_policies():
                missing.append(f"CTA policy {policy} (NCCL {'>= 2.28' if policy == CTAPolicy.ZERO else '>= 2.27, no tuner plugin'}; "
                               f"this is NCCL {available.nccl_version})")
        if any(e.config.algorithm == Algorithm.NVLS for e in self.entries) and not available.nvls:
            missing.append("NVLS (NVSwitch nodes with NVLink SHARP)")
        return missing

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
        """The entry for a call seen at run time, by the one matching rule of ``lagom.step.calls.KeyIndex``."""
        if self._index is None:
            self._index = KeyIndex(e.key for e in self.entries)
        key = self._index.match(TuningKey(group, collective, int(nbytes)))
        return None if key is None else self.entry(key)

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data: each entry's config without the per-process knobs (``process`` has them)."""
        data = asdict(self)
        for entry, stored in zip(self.entries, data["entries"]):
            stored["config"] = {k: v for k, v in entry.config.to_dict().items() if k not in self.process}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> Plan:
        if data.get("version") != PLAN_VERSION:
            raise ConfigError(f"{where}.version", f"plan version {data.get('version')} is not {PLAN_VERSION}",
                              "re-run `lagom tune` to make a plan for this Lagom")
        try:
            process = dict(data["process"])
            per_process = set(process)
            if data.get("capability"):
                per_process |= set(Capability.from_dict(data["capability"], f"{where}.capability").process_fields())
            entries = []
            for i, e in enumerate(data["entries"]):
                inside = sorted(set(e["config"]) & per_process)
                if inside:
                    raise ConfigError(f"{where}.entries[{i}].config.{inside[0]}", "a per-process knob inside an entry",
                                      "per-process knobs go once in the plan's 'process' section")
                entry = PlanEntry(**{**e, "config": CommConfig()})
                values = {name: cls._value_for(name, value, entry) for name, value in process.items()}
                entry.config = CommConfig.from_dict({**values, **e["config"]}, f"{where}.entries[{i}].config")
                entries.append(entry)
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
