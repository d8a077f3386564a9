"""What the target can apply: per knob, the scope at which the installed NCCL (and Lagom's tuner plugin)
lets a plan set it.

A search that chooses a value per (communicator, collective, size) for a knob NCCL only reads once per
process predicts a gain that never runs. The capability record says, for one NCCL version, plugin and
topology, whether each knob is set per size (the tuner plugin), per communicator (``ncclConfig_t``),
per process (environment variables), per point (Flash-Overlap, Lagom's own code) or not at all. The
search offers only what the record allows, the plan keeps the record it was made under, and the
runtime compares it with what it finds.

NCCL facts used here (release notes and nccl.h): the tuner interface is v4 from 2.24, v5 from 2.28,
v6 (with ``getChunkSize``) from 2.30 and v7 (v6's calls; a tuning-constants table with rows for more GPU
generations) from 2.32; a tuner cannot set threads, CTA policy or NVLS CTAs. From 2.31 a collective may
be called with its own ``ncclCollConfig_t`` (the ``nccl*Config`` entry points): per call, the algorithms
it may run (by name, forced or as a filter), its CTA range (within the communicator's), its CTA policy and
its NVLS CTAs, and a tag NCCL hands the profiler; no protocol and no chunk. No framework passes one yet:
torch's ProcessGroupNCCL calls the plain entry points, and Megatron and DeepSpeed call through torch. So no
knob has the per-call scope; ``per_call`` says what it would allow, and plans stay per size and per
communicator until a framework can pass it.
``ncclConfig_t.CTAPolicy`` and ``nvlsCTAs`` arrive in 2.27 (DEFAULT, EFFICIENCY), the ZERO policy
(copy-engine all-gather and all-to-all on symmetric windows, one NVLink domain) in 2.28, hierarchical
ZERO all-gather / all-to-all across nodes in 2.30.7. There is no copy-engine reduce-scatter or
all-reduce. EFFICIENCY is skipped by NCCL when a tuner plugin is loaded or NCCL_ALGO/PROTO is set.

NCCL's clamps (v2.30.7 ``src/enqueue.cc`` calcCollChunking and topoGetAlgoInfo, ``src/init.cc``
computeBuffSizes, ``src/transport/nvls.cc``), which ``nccl_chunk`` and ``channel_cap`` restate so that
the search, the cost model and the emitter plan the chunk and channels NCCL runs:

- A tuner's chunk is cut to the protocol's buffer: one step (the buffer / NCCL_STEPS) times the chunk
  steps, 4 for ring Simple all-reduce, all-gather and reduce-scatter and 1 otherwise (tree, NVLS,
  broadcast, reduce), then rounded down to the protocol's grain. NCCL_BUFFSIZE sizes only Simple's
  buffer: LL runs at most 32 KiB and LL128 576,000 B whatever the plan asks. NCCL reads NCCL_BUFFSIZE
  once per process, so a chunk asked for later (live) is cut to the buffer the process started with.
- NCCL sizes NVLS buffer slots by NCCL_NVLS_CHUNKSIZE (128 KiB) yet takes a tuner chunk up to
  NCCL_BUFFSIZE / 8; until a GPU shows that is safe Lagom asks for at most NCCL_NVLS_CHUNKSIZE.
- P2P operations (send/recv, all-to-all, Flash-Overlap's steps) never ask a tuner: their chunk is
  NCCL_P2P_{NVL,PCI,NET}_CHUNKSIZE, cut to NCCL_BUFFSIZE / NCCL_STEPS.
- A tuner's channel count replaces NCCL's small-message trimming as it is; the scheduler then cuts it to
  the communicator's channels (NVLS on one node: its NVLS channels), but not on CollNet or multi-node
  NVLS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware


class Scope(StrEnum):
    """How finely a knob can be set, widest first."""

    PER_CALL = "per call"  # ncclCollConfig_t (NCCL 2.31): no framework passes one, so no knob has it yet
    PER_SIZE = "per size"  # the tuner plugin, per (communicator shape, collective, message size)
    PER_POINT = "per point"  # Lagom's own code decides at each call (Flash-Overlap)
    PER_COMMUNICATOR = "per communicator"  # ncclConfig_t, when the communicator is made
    PER_PROCESS = "per process"  # NCCL_* environment variables: one value for every communicator
    NOT_SETTABLE = "not settable"  # NCCL decides


# Knobs by name (the CommConfig field each one sets is in comm_config.KNOB_FIELDS).
KNOBS = ("threads", "buffsize", "transport", "chunk", "algorithm", "protocol", "channels", "cta_range",
         "priority", "cta_policy", "nvls_ctas", "decomposition")

# first NCCL of each interface Lagom's plugin exports
TUNER_INTERFACES = ((2, 32, 0, 7), (2, 30, 0, 6), (2, 28, 0, 5), (2, 24, 0, 4))
PER_CALL_SINCE = (2, 31, 0)  # ncclCollConfig_t
# what a per-call config sets, by knob (NCCL >= 2.31), and the frameworks that pass one (none yet)
PER_CALL_KNOBS = {"algorithm": "the algorithms the call may run, by name (forced, or a filter)",
                  "cta_range": "min and max CTAs of the call, within the communicator's",
                  "cta_policy": "the call's CTA policy", "nvls_ctas": "the call's NVLS CTAs"}
PER_CALL_PASSED_BY: tuple[str, ...] = ()  # torch's ProcessGroupNCCL calls the plain entry points
CTA_POLICY_SINCE = (2, 27, 0)
NVLS_CTAS_SINCE = (2, 27, 0)
ZERO_SINCE = (2, 28, 0)
ZERO_ACROSS_NODES_SINCE = (2, 30, 7)
ZERO_COLLECTIVES = ("all_gather", "all_to_all")  # the copy-engine collectives (no reduce-scatter, no all-reduce)
NVLS_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_NCCL_VERSION = "2.30.7"

NCCL_STEPS = 8  # slots of one connection's buffer
DEFAULT_BUFFSIZE = 4 << 20  # NCCL_BUFFSIZE's default: the Simple protocol's buffer
FIXED_BUFFSIZE = {"LL": 8 * 512 * NCCL_STEPS * 16,  # lines per thread x threads x steps x line: 512 KiB
                  "LL128": 120 * 640 * NCCL_STEPS * 8}  # elements per thread x threads x steps x 8 B; Lagom sets neither
PROTOCOL_GRAIN = {"LL": 16, "LL128": 1920, "Simple": 512}  # ncclProtoGrainSize: NCCL rounds a chunk down to it
RING_CHUNK_STEPS = 4  # NCCL_STEPS / 2 for ring Simple all-reduce, all-gather, reduce-scatter
RING_CHUNK_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
P2P_COLLECTIVES = ("send_recv", "all_to_all")  # no tuner call: NCCL's P2P chunk
P2P_CHUNK = {"nvlink": 512 << 10, "pci": 128 << 10, "net": 128 << 10}  # NCCL_P2P_{NVL,PCI,NET}_CHUNKSIZE
NVLS_CHUNK = 128 << 10  # NCCL_NVLS_CHUNKSIZE's default: the size of an NVLS buffer slot
NVLS_CHUNK_ENV = "NCCL_NVLS_CHUNKSIZE"
MAX_CHANNELS = 64  # NCCL's MAXCHANNELS
ALGORITHMS = ("ring", "tree", "nvls")


def _check_name(key: str, value: str, known: tuple[str, ...] | dict[str, int]) -> None:
    if value not in known:
        raise ConfigError(key, f"unknown '{value}'", f"use one of {', '.join(known)}")


def chunk_steps(algorithm: str, protocol: str, collective: str) -> int:
    """Buffer steps one chunk fills: 4 only for ring Simple all-reduce, all-gather and reduce-scatter."""
    ring_simple = algorithm == "ring" and protocol == "Simple"
    return RING_CHUNK_STEPS if ring_simple and collective in RING_CHUNK_COLLECTIVES else 1


def chunk_ceiling(algorithm: str, protocol: str, collective: str, buffsize: int, nvls_chunk: int = NVLS_CHUNK) -> int:
    """The largest chunk NCCL runs a collective at under NCCL_BUFFSIZE ``buffsize`` (NVLS: at most
    ``nvls_chunk``, Lagom's own cap), on the protocol's grain."""
    _check_name("algorithm", algorithm, ALGORITHMS)
    _check_name("protocol", protocol, PROTOCOL_GRAIN)
    if buffsize <= 0:
        raise ConfigError("NCCL_BUFFSIZE", f"must be positive, got {buffsize}", "leave it unset or give a byte count")
    if protocol == "LL":
        ceiling = FIXED_BUFFSIZE["LL"] // NCCL_STEPS // 2  # half of an LL line is flags
    elif protocol == "LL128":
        ceiling = FIXED_BUFFSIZE["LL128"] // NCCL_STEPS // 16 * 15  # one 8-byte word in 16 is flags
    else:
        ceiling = buffsize // NCCL_STEPS * chunk_steps(algorithm, protocol, collective)
    if algorithm == "nvls":
        ceiling = min(ceiling, nvls_chunk)
    grain = PROTOCOL_GRAIN[protocol]
    return max(grain, ceiling // grain * grain)


def p2p_link(nodes: int, nvlink: bool) -> str:
    """Which P2P chunk NCCL gives a communicator: the network's across nodes, else NVLink's or PCIe's."""
    return "net" if nodes > 1 else "nvlink" if nvlink else "pci"


def nccl_chunk(algorithm: str, protocol: str, collective: str, requested: int | None, buffsize: int, *,
               nvls_chunk: int = NVLS_CHUNK, link: str = "nvlink") -> int:
    """The chunk NCCL runs for a call: a tuner's ``requested`` chunk (None: NCCL's own, its buffer's)
    cut to ``chunk_ceiling`` and the protocol's grain; P2P operations run the P2P chunk of ``link``
    whatever is requested. The one place Lagom's search, cost model and emitter learn it from."""
    if collective in P2P_COLLECTIVES:
        _check_name("link", link, P2P_CHUNK)
        return max(1, min(P2P_CHUNK[link], buffsize // NCCL_STEPS))
    ceiling = chunk_ceiling(algorithm, protocol, collective, buffsize, nvls_chunk)
    if requested is None:
        return ceiling
    if requested <= 0:
        raise ConfigError("chunk_bytes", f"must be positive, got {requested}", "give a byte count")
    grain = PROTOCOL_GRAIN[protocol]
    return max(grain, min(requested, ceiling) // grain * grain)


def buffsize_for(algorithm: str, protocol: str, collective: str, chunk: int) -> int:
    """The smallest NCCL_BUFFSIZE under which ``chunk`` runs uncut (0: NCCL_BUFFSIZE does not bound it)."""
    if protocol != "Simple" or collective in P2P_COLLECTIVES:
        return 0
    return chunk * NCCL_STEPS // chunk_steps(algorithm, protocol, collective)


def channel_cap(algorithm: str, nodes: int, max_channels: int, *, max_ctas: int | None = None,
                nvls_ctas: int | None = None, nvls_channels: int = 16) -> int:
    """The most channels NCCL runs a tuner's channel count at on one communicator.

    Rules match communicators by rank and node counts only, so a rule also reaches communicators Lagom
    never configured: bound its channels by the topology (``max_channels``, the hardware profile's),
    the communicator's CTA range (``max_ctas``) and, for NVLS, its NVLS CTAs (``nvls_ctas``, else NCCL's
    default ``nvls_channels``, which NCCL also clamps into the CTA range). NCCL clamps all of these on
    one node; across nodes it does not clamp NVLS, so Lagom bounds it as NCCL's own pick does (by the
    communicator's channels too)."""
    _check_name("algorithm", algorithm, ALGORITHMS)
    for key, value in (("nodes", nodes), ("max_channels", max_channels), ("max_ctas", max_ctas),
                       ("nvls_ctas", nvls_ctas), ("nvls_channels", nvls_channels)):
        if value is not None and value <= 0:
            raise ConfigError(key, f"must be positive, got {value}", "give a count of at least 1")
    channels = min(max_channels, MAX_CHANNELS, max_ctas or MAX_CHANNELS)
    if algorithm != "nvls":
        return channels
    nvls = min(nvls_ctas or nvls_channels, max_ctas or MAX_CHANNELS)
    return nvls if nodes == 1 else min(nvls, channels)


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
    # NCCL_BUFFSIZE the process has already read (a live search runs under the start plan's); None: the
    # plan sets it, at least NCCL's default and as large as its chunks need (``SearchSpace`` bounds them)
    buffsize: int | None = None
    nvls_chunk: int = NVLS_CHUNK  # NCCL_NVLS_CHUNKSIZE: Lagom asks NVLS for no larger chunk
    # groups whose collective buffers the job registers symmetrically (NCCL windows, e.g. megatron-core's
    # --use-nccl-ub): the ZERO policy runs on copy engines there only, so it is planned there only
    symmetric_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_version(self.nccl_version)
        if self.buffsize is not None and self.buffsize < NCCL_STEPS * PROTOCOL_GRAIN["Simple"]:
            raise ConfigError("capability.buffsize", f"{self.buffsize} B leaves no chunk of 512 B per step",
                              f"give NCCL_BUFFSIZE of at least {NCCL_STEPS * PROTOCOL_GRAIN['Simple']} B, or none")
        if self.nvls_chunk < PROTOCOL_GRAIN["Simple"]:
            raise ConfigError("capability.nvls_chunk", f"{self.nvls_chunk} B is below Simple's grain of 512 B",
                              f"set {NVLS_CHUNK_ENV} to at least 512, or leave it unset (128 KiB)")

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
        return self._scopes[knob]

    def scopes(self) -> dict[str, Scope]:
        return dict(self._scopes)

    @cached_property
    def _scopes(self) -> dict[str, Scope]:
        """Worked out once per capability (frozen): a search asks a knob's scope for every candidate it weighs."""
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

    def per_call(self) -> dict[str, str]:
        """What this NCCL's per-call ``ncclCollConfig_t`` would let a plan set for each call, by knob (empty
        before 2.31). No scope uses it while no framework passes one (``PER_CALL_PASSED_BY``)."""
        return dict(PER_CALL_KNOBS) if self.version >= PER_CALL_SINCE else {}

    def cta_policies(self) -> tuple[str, ...]:
        """The CTA policies a plan may give a communicator (EFFICIENCY is skipped under a tuner plugin)."""
        if self.version < CTA_POLICY_SINCE:
            return ("default",)
        return ("default",) + (() if self.per_size else ("efficiency",)) + (("zero",) if self.version >= ZERO_SINCE else ())

    def zero_applies(self, collective: str, nodes: int, group: str) -> bool:
        """Whether the ZERO policy runs this collective of ``group`` on copy engines (else it runs as under
        DEFAULT): a copy-engine collective, one NVLink domain, and the group's buffers registered symmetrically."""
        if "zero" not in self.cta_policies() or collective not in ZERO_COLLECTIVES or not self.nvlink_domain:
            return False
        if group not in self.symmetric_groups:
            return False
        return nodes == 1 or self.version >= ZERO_ACROSS_NODES_SINCE

    def nvls_applies(self, collective: str, nodes: int) -> bool:
        """NVLS (in-switch reduction) is offered for this collective: within one NVSwitch node."""
        return self.nvls and collective in NVLS_COLLECTIVES and nodes == 1

    def run_chunk(self, algorithm: str, protocol: str, collective: str, chunk: int, nodes: int = 1,
                  nvlink: bool = True, asked: bool = True) -> int:
        """The chunk NCCL runs for a config of ``chunk`` bytes under this capability.

        Where the plugin asks for it (``asked``: a rule covers the call, and getChunkSize exists) NCCL
        cuts ``chunk`` to ``buffsize``, or to a buffer the plan sizes for it (never below NCCL's default,
        which keeps P2P chunks whole). Otherwise NCCL runs its own chunk of the buffer, whatever the
        algorithm: per process ``chunk`` is the ring Simple chunk NCCL_BUFFSIZE is sized for; per size
        the buffer is the plan's, at least NCCL's default."""
        link = p2p_link(nodes, nvlink)
        per_process = self.scope("chunk") == Scope.PER_PROCESS
        if not asked or per_process:
            buffsize = self.buffsize or buffsize_for("ring", "Simple", "all_reduce", chunk)
            if not per_process:  # a plan with per-size chunks never shrinks the buffer below NCCL's default
                buffsize = max(buffsize, DEFAULT_BUFFSIZE)
            return nccl_chunk(algorithm, protocol, collective, None, buffsize, nvls_chunk=self.nvls_chunk, link=link)
        buffsize = self.buffsize or max(DEFAULT_BUFFSIZE, buffsize_for(algorithm, protocol, collective, chunk))
        return nccl_chunk(algorithm, protocol, collective, chunk, buffsize, nvls_chunk=self.nvls_chunk, link=link)

    def chunk_ceilings(self, buffsize: int | None = None) -> dict[str, int]:
        """The largest chunk each (algorithm, protocol) runs for an all-reduce at ``buffsize`` (default:
        this capability's, else NCCL's default): what reports and ``compare --json`` show."""
        size = buffsize or self.buffsize or DEFAULT_BUFFSIZE
        return {f"{a}/{p}": chunk_ceiling(a, p, "all_reduce", size, self.nvls_chunk)
                for a in ALGORITHMS for p in PROTOCOL_GRAIN if a != "nvls" or p == "Simple"}

    def process_fields(self) -> tuple[str, ...]:
        """The CommConfig fields that are one value for the whole process under this capability."""
        return ("threads", "transport") + (("chunk_bytes",) if self.scope("chunk") == Scope.PER_PROCESS else ())

    def to_dict(self) -> dict[str, Any]:
        return {"nccl_version": self.nccl_version, "tuner_plugin": self.tuner_plugin, "nvls": self.nvls,
                "nvlink_domain": self.nvlink_domain, "tuner_interface": self.tuner_interface,
                "scopes": {k: str(v) for k, v in self.scopes().items()}, "cta_policies": list(self.cta_policies()),
                "buffsize": self.buffsize, "nvls_chunk": self.nvls_chunk, "chunk_ceilings": self.chunk_ceilings(),
                "symmetric_groups": list(self.symmetric_groups), "per_call": self.per_call(),
                "per_call_passed_by": list(PER_CALL_PASSED_BY)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "capability") -> Capability:
        try:
            return cls(nccl_version=str(data["nccl_version"]), tuner_plugin=bool(data["tuner_plugin"]),
                       nvls=bool(data["nvls"]), nvlink_domain=bool(data["nvlink_domain"]),
                       buffsize=data.get("buffsize"), nvls_chunk=int(data.get("nvls_chunk", NVLS_CHUNK)),
                       symmetric_groups=tuple(str(g) for g in data.get("symmetric_groups", ())))
        except KeyError as err:
            raise ConfigError(f"{where}.{err.args[0]}", "missing", "re-run `lagom tune` to make the plan again") from None

    def describe(self) -> str:
        """One line for reports: the inputs, then each knob's scope."""
        plugin = f"tuner plugin v{self.tuner_interface}" if self.per_size else (
            "tuner plugin not usable with this NCCL" if self.tuner_plugin else "no tuner plugin")
        scopes = "; ".join(f"{k} {v}" for k, v in self.scopes().items())
        registered = (f", buffers registered symmetrically for {', '.join(self.symmetric_groups)}"
                      if self.symmetric_groups else ", no buffers registered symmetrically (no ZERO policy)")
        per_call = (f", per-call config ({', '.join(self.per_call())}) passed by no framework yet" if self.per_call()
                    else "")
        return (f"NCCL {self.nccl_version}, {plugin}, NVLS {'on' if self.nvls else 'off'}, "
                f"CTA policies {', '.join(self.cta_policies())}{registered}{per_call}: {scopes}")


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
