"""What the target can apply: per knob, the scope at which the installed NCCL (and Lagom's tuner plugin)
lets a plan set it.

A search that chooses a value per (communicator, collective, size) for a knob NCCL only reads once per
process predicts a gain that never runs. The capability record says, for one NCCL version, plugin and
topology, whether each knob is set per size (the tuner plugin), per communicator (``ncclConfig_t``),
per process (environment variables), per point (Flash-Overlap, Lagom's own code) or not at all. The
search offers only what the record allows, the plan keeps the record it was made under, and the
runtime compares it with what it finds.

NCCL facts used here (release notes and nccl.h): the tuner interface is v4 from 2.24, v5 from 2.28
and v6 (with ``getChunkSize``) from 2.30; a tuner cannot set threads, CTA policy or NVLS CTAs.
``ncclConfig_t.CTAPolicy`` and ``nvlsCTAs`` arrive in 2.27 (DEFAULT, EFFICIENCY), the ZERO policy
(copy-engine all-gather and all-to-all on symmetric windows, one NVLink domain) in 2.28, hierarchical
ZERO all-gather / all-to-all across nodes in 2.30.7. There is no copy-engine reduce-scatter or
all-reduce. EFFICIENCY is skipped by NCCL when a tuner plugin is loaded or NCCL_ALGO/PROTO is set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware


class Scope(StrEnum):
    """How finely a knob can be set, widest first."""

    PER_CALL = "per call"  # ncclCollConfig_t (NCCL 2.31): torch passes none, so no knob has it yet
    PER_SIZE = "per size"  # the tuner plugin, per (communicator shape, collective, message size)
    PER_POINT = "per point"  # Lagom's own code decides at each call (Flash-Overlap)
    PER_COMMUNICATOR = "per communicator"  # ncclConfig_t, when the communicator is made
    PER_PROCESS = "per process"  # NCCL_* environment variables: one value for every communicator
    NOT_SETTABLE = "not settable"  # NCCL decides


# Knobs by name (the CommConfig field each one sets is in comm_config.KNOB_FIELDS).
KNOBS = ("threads", "buffsize", "transport", "chunk", "algorithm", "protocol", "channels", "cta_range",
         "priority", "cta_policy", "nvls_ctas", "decomposition")

TUNER_INTERFACES = ((2, 30, 0, 6), (2, 28, 0, 5), (2, 24, 0, 4))  # first NCCL of each interface Lagom's plugin exports
CTA_POLICY_SINCE = (2, 27, 0)
NVLS_CTAS_SINCE = (2, 27, 0)
ZERO_SINCE = (2, 28, 0)
ZERO_ACROSS_NODES_SINCE = (2, 30, 7)
ZERO_COLLECTIVES = ("all_gather", "all_to_all")  # the copy-engine collectives (no reduce-scatter, no all-reduce)
NVLS_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_NCCL_VERSION = "2.30.7"


def parse_version(text: str, key: str = "nccl version") -> tuple[int, int, int]:
    """'2.28' or '2.30.7' (or torch's (2, 30, 7)) as a comparable triple."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.(\d+))?\s*", str(text))
    if match is None:
        raise ConfigError(key, f"'{text}' is not an NCCL version", "write it as MAJOR.MINOR[.PATCH], e.g. 2.30.7")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@dataclass(frozen=True)
class Capability:
    """What one NCCL, plugin and topology let a plan set. Frozen: problems and spaces share it."""

    nccl_version: str = DEFAULT_NCCL_VERSION
    tuner_plugin: bool = True  # Lagom's tuner plugin is built (and this NCCL can load it: see ``tuner_interface``)
    nvls: bool = False  # NVSwitch nodes with NVLink SHARP
    nvlink_domain: bool = False  # a node's GPUs share one NVLink domain (copy-engine collectives need it)

    def __post_init__(self) -> None:
        parse_version(self.nccl_version)

    @property
    def version(self) -> tuple[int, int, int]:
        return parse_version(self.nccl_version)

    @property
    def tuner_interface(self) -> int | None:
        """The tuner interface this NCCL loads from Lagom's plugin, None when the plugin cannot be used."""
        if not self.tuner_plugin:
            return None
        return next((iface for *since, iface in TUNER_INTERFACES if self.version >= tuple(since)), None)

    @property
    def per_size(self) -> bool:
        """The plugin sets algorithm, protocol and channels per size."""
        return self.tuner_interface is not None

    def scope(self, knob: str) -> Scope:
        if knob not in KNOBS:
            raise ConfigError("knob", f"unknown '{knob}'", f"known knobs: {', '.join(KNOBS)}")
        return self.scopes()[knob]

    def scopes(self) -> dict[str, Scope]:
        per_size = self.per_size
        chunk_per_size = (self.tuner_interface or 0) >= 6  # getChunkSize
        since_227 = self.version >= CTA_POLICY_SINCE
        return {
            "threads": Scope.PER_PROCESS,  # NCCL_NTHREADS
            "buffsize": Scope.PER_PROCESS,  # NCCL_BUFFSIZE
            "transport": Scope.PER_PROCESS,  # NCCL_P2P_DISABLE
            "chunk": Scope.PER_SIZE if chunk_per_size else Scope.PER_PROCESS,  # else NCCL_BUFFSIZE decides it
            "algorithm": Scope.PER_SIZE if per_size else Scope.NOT_SETTABLE,
            "protocol": Scope.PER_SIZE if per_size else Scope.NOT_SETTABLE,
            "channels": Scope.PER_SIZE if per_size else Scope.PER_COMMUNICATOR,  # else the CTA range
            "cta_range": Scope.PER_COMMUNICATOR,  # min_ctas / max_ctas
            "priority": Scope.PER_COMMUNICATOR,  # is_high_priority_stream
            "cta_policy": Scope.PER_COMMUNICATOR if since_227 else Scope.NOT_SETTABLE,
            "nvls_ctas": Scope.PER_COMMUNICATOR if since_227 and self.nvls else Scope.NOT_SETTABLE,
            "decomposition": Scope.PER_POINT,  # Flash-Overlap, routed by Lagom at each call
        }

    def cta_policies(self) -> tuple[str, ...]:
        """The CTA policies a plan may give a communicator (EFFICIENCY is skipped under a tuner plugin)."""
        if self.version < CTA_POLICY_SINCE:
            return ("default",)
        return ("default",) + (() if self.per_size else ("efficiency",)) + (("zero",) if self.version >= ZERO_SINCE else ())

    def zero_applies(self, collective: str, nodes: int) -> bool:
        """Whether the ZERO policy runs this collective on copy engines (else it runs as under DEFAULT)."""
        if "zero" not in self.cta_policies() or collective not in ZERO_COLLECTIVES or not self.nvlink_domain:
            return False
        return nodes == 1 or self.version >= ZERO_ACROSS_NODES_SINCE

    def nvls_applies(self, collective: str, nodes: int) -> bool:
        """NVLS (in-switch reduction) is offered for this collective: within one NVSwitch node."""
        return self.nvls and collective in NVLS_COLLECTIVES and nodes == 1

    def process_fields(self) -> tuple[str, ...]:
        """The CommConfig fields that are one value for the whole process under this capability."""
        return ("threads", "transport") + (("chunk_bytes",) if self.scope("chunk") == Scope.PER_PROCESS else ())

    def to_dict(self) -> dict[str, Any]:
        return {"nccl_version": self.nccl_version, "tuner_plugin": self.tuner_plugin, "nvls": self.nvls,
                "nvlink_domain": self.nvlink_domain, "tuner_interface": self.tuner_interface,
                "scopes": {k: str(v) for k, v in self.scopes().items()}, "cta_policies": list(self.cta_policies())}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "capability") -> Capability:
        try:
            return cls(nccl_version=str(data["nccl_version"]), tuner_plugin=bool(data["tuner_plugin"]),
                       nvls=bool(data["nvls"]), nvlink_domain=bool(data["nvlink_domain"]))
        except KeyError as err:
            raise ConfigError(f"{where}.{err.args[0]}", "missing", "re-run `lagom tune` to make the plan again") from None

    def describe(self) -> str:
        """One line for reports: the inputs, then each knob's scope."""
        plugin = f"tuner plugin v{self.tuner_interface}" if self.per_size else (
            "tuner plugin not usable with this NCCL" if self.tuner_plugin else "no tuner plugin")
        scopes = "; ".join(f"{k} {v}" for k, v in self.scopes().items())
        return (f"NCCL {self.nccl_version}, {plugin}, NVLS {'on' if self.nvls else 'off'}, "
                f"CTA policies {', '.join(self.cta_policies())}: {scopes}")


def capability_for(hw: Hardware, nccl_version: str | None = None, tuner_plugin: bool | None = None) -> Capability:
    """The capability a plan for ``hw`` is made under: its profile's NCCL (or ``nccl_version``), Lagom's
    plugin if this install built it (or ``tuner_plugin``), and the profile's NVLink / NVLS topology."""
    if tuner_plugin is None:
        from lagom import nccl_tuner  # no torch: the package only looks for the built library

        tuner_plugin = nccl_tuner.path() is not None
    version = nccl_version or hw.nccl.version
    parse_version(version, "--nccl-version" if nccl_version else f"hardware {hw.name}: nccl.version")
    cluster = hw.cluster
    # one NVLink domain per node: NVLink joins every GPU of it (A40 bridges join pairs only)
    whole_node = not cluster.island_gpus or cluster.island_gpus >= cluster.gpus_per_node
    return Capability(nccl_version=version, tuner_plugin=tuner_plugin, nvls=cluster.nvls,
                      nvlink_domain=cluster.intra.kind == "nvlink" and whole_node)
