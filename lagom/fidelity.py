"""The fidelity suite as data: the schema of a published point (its source, the setup it was measured on, its
role: ``fit`` or ``check``) and ``load_suite``, which reads ``configs/fidelity/`` and refuses unknown keys with the
known ones named. ``lagom validate`` (``lagom.validate``) works out the model's figure for each point.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.config_file import read_mapping
from lagom.errors import ConfigError
from lagom.resources import FIDELITY_DIR
from lagom.step.graph import Collective

ROLES = ("fit", "check")


@dataclass
class Source:
    ref: str = "???"  # paper / issue, e.g. "NVIDIA/nccl issue #1047"
    url: str = "???"
    where: str = "???"  # table, figure, comment: where in the source the figure is


@dataclass
class Comm:
    """A collective on a group of ranks (spread evenly over ``nodes``), at NCCL's choice unless a knob is given."""

    collective: str = "???"
    ranks: int = 0
    nodes: int = 1
    bytes: int = 0  # nccl-tests' size: the whole buffer (gathered output, unreduced input)
    algorithm: str | None = None
    protocol: str | None = None
    channels: int | None = None
    threads: int | None = None
    chunk_bytes: int | None = None


@dataclass
class Kernel:
    """A compute kernel by shape: a bf16 GEMM (m x k times k x n) or an elementwise pass over elements."""

    gemm: list[int] | None = None  # [m, n, k]
    elements: int | None = None  # read once and written once


@dataclass
class Setup:
    kind: str = "???"  # busbw | latency | slowdown | comm_slowdown | overlap | sequential | window
    hardware: list[str] = field(default_factory=list)  # preset names or files; a pair kind may average several
    comm: Comm | None = None  # busbw, latency and the pair kinds (the collective running beside)
    kernels: list[Kernel] = field(default_factory=list)  # the pair kinds: slowdown, comm_slowdown, overlap, sequential
    aggregate: str = "one"  # a pair kind over several kernels x hardware: one | mean | max
    workload: str | None = None  # window
    collective: str | None = None  # window: which of the step's collectives
    channels: int | None = None  # window: the setting compared with NCCL's
    chunk_bytes: int | None = None
    measure: str | None = None  # window: local | step | max_slowdown


@dataclass
class PointSpec:
    id: str = "???"
    role: str = "check"
    what: str = "???"  # what was measured
    unit: str = "???"
    measured: Any = None  # a number, or [low, high] where the source gives a range
    source: Source = field(default_factory=Source)
    setup: Setup = field(default_factory=Setup)
    note: str = ""  # proxies and assumptions: what of the setup the source does not give
    constants: list[str] = field(default_factory=list)  # fit points: the hardware constants set from them


@dataclass
class SuiteFile:
    group: str = "???"
    description: str = ""
    points: list[PointSpec] = field(default_factory=list)


@dataclass
class FidelityPoint:
    """One point as validated: its group (the file's) and its spec; hardware files are found beside it."""

    group: str
    spec: PointSpec
    file: str
    folder: Path


# What each kind of setup reads besides kind and hardware; anything else set on it would be silently ignored.
COMM_KINDS = ("busbw", "latency")  # one collective alone


PAIR_KINDS = ("slowdown", "comm_slowdown", "overlap", "sequential")  # one kernel and one collective


_KIND_FIELDS = {"busbw": {"comm"}, "latency": {"comm"}, **{k: {"comm", "kernels", "aggregate"} for k in PAIR_KINDS},
                "window": {"workload", "collective", "channels", "chunk_bytes", "measure"}}


_UNSET = Setup()


_AGGREGATES = ("one", "mean", "max")


_MEASURES = ("local", "step", "max_slowdown")


def _check_keys(data: Any, schema: Any, file: str, path: str = "") -> None:
    """Every key of ``data`` (and of its nested parts) is a field of the dataclass ``schema``."""
    if not isinstance(data, dict):
        return
    known = [f.name for f in fields(schema)]
    for key, value in data.items():
        here = f"{path}.{key}" if path else key
        if key not in known:
            raise ConfigError(f"{file}: {here}", "unknown key", f"known keys: {', '.join(known)}")
        nested = {"source": Source, "setup": Setup, "comm": Comm, "points": PointSpec, "kernels": Kernel}.get(key)
        if nested is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_keys(item, nested, file, f"{here}[{i}]")
        else:
            _check_keys(value, nested, file, here)


def _require(value: Any, where: str, fix: str) -> None:
    if value is None or value == "???" or value == [] or value == 0:
        raise ConfigError(where, "is missing", fix)


def _check_point(spec: PointSpec, where: str) -> None:
    """What the schema's types cannot say: roles, kinds, the fields each kind needs, a sane measurement."""
    if spec.role not in ROLES:
        raise ConfigError(f"{where}.role", f"'{spec.role}' is not one of {', '.join(ROLES)}")
    for key in ("id", "what", "unit"):
        _require(getattr(spec, key), f"{where}.{key}", "every point says what it is")
    for key in ("ref", "url", "where"):
        _require(getattr(spec.source, key), f"{where}.source.{key}", "every point names its source")
    m = spec.measured
    numbers = m if isinstance(m, list) else [m]
    if not (1 <= len(numbers) <= 2 and all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in numbers)):
        raise ConfigError(f"{where}.measured", f"must be a positive number or [low, high], got {m!r}")
    if len(numbers) == 2 and numbers[0] > numbers[1]:
        raise ConfigError(f"{where}.measured", f"range {m} is reversed", "write [low, high]")
    if spec.role == "fit" and not spec.constants:
        raise ConfigError(f"{where}.constants", "a fit point names the constants set from it",
                          "list them, e.g. [nccl.channel_gbps.nvlink], or make the point role: check")
    s = spec.setup
    if s.kind not in _KIND_FIELDS:
        raise ConfigError(f"{where}.setup.kind", f"'{s.kind}' is not one of {', '.join(_KIND_FIELDS)}")
    reads = _KIND_FIELDS[s.kind]
    for f in fields(Setup):
        if f.name not in reads | {"kind", "hardware"} and getattr(s, f.name) != getattr(_UNSET, f.name):
            raise ConfigError(f"{where}.setup.{f.name}", f"means nothing to a {s.kind} point",
                              f"remove it; a {s.kind} point reads {', '.join(sorted(reads))}")
    _require(s.hardware, f"{where}.setup.hardware", "name a preset or a hardware file")
    if s.kind not in PAIR_KINDS and len(s.hardware) != 1:
        raise ConfigError(f"{where}.setup.hardware", f"a {s.kind} point runs on one machine, got {len(s.hardware)}")
    if s.kind in (*COMM_KINDS, *PAIR_KINDS):
        _check_comm(needed(s.comm, f"{where}.setup.comm"), f"{where}.setup.comm")
    if s.kind in PAIR_KINDS:
        _require(s.kernels, f"{where}.setup.kernels", "list the kernels, by gemm: [m, n, k] or elements")
        if s.aggregate not in _AGGREGATES:
            raise ConfigError(f"{where}.setup.aggregate", f"'{s.aggregate}' is not one of {', '.join(_AGGREGATES)}")
        if s.aggregate == "one" and len(s.kernels) * len(s.hardware) != 1:
            raise ConfigError(f"{where}.setup.aggregate", "several kernels or hardware need mean or max")
        for i, k in enumerate(s.kernels):
            if (k.gemm is None) == (k.elements is None) or (k.gemm is not None and (len(k.gemm) != 3 or min(k.gemm) <= 0)):
                raise ConfigError(f"{where}.setup.kernels[{i}]", "needs one of gemm: [m, n, k] or elements: N")
    if s.kind == "window":
        for key in ("workload", "collective", "measure"):
            _require(getattr(s, key), f"{where}.setup.{key}", "a window point names the workload, collective and measure")
        if s.measure not in _MEASURES:
            raise ConfigError(f"{where}.setup.measure", f"'{s.measure}' is not one of {', '.join(_MEASURES)}")
        if s.measure != "max_slowdown":
            _require(s.channels, f"{where}.setup.channels", "give the setting compared with NCCL's")


def needed[T](value: T | None, where: str) -> T:
    """A part a setup kind needs (the schema makes every part optional, one kind needs what another does not)."""
    if value is None:
        raise ConfigError(where, "is missing", "see configs/fidelity/README.md")
    return value


def _check_comm(comm: Comm, where: str) -> None:
    """The collective is one the model knows, on at least two ranks, with a positive size."""
    if comm.collective not in Collective._value2member_map_:
        raise ConfigError(f"{where}.collective", f"'{comm.collective}' is not one of {', '.join(Collective)}")
    if comm.ranks < 2 or comm.bytes <= 0:
        raise ConfigError(where, f"needs ranks >= 2 and bytes > 0, got {comm.ranks} ranks, {comm.bytes} bytes")
    if comm.nodes < 1 or comm.ranks % comm.nodes:
        raise ConfigError(f"{where}.nodes", f"{comm.ranks} ranks do not spread evenly over {comm.nodes} node(s)")


def load_suite(folder: str | Path = FIDELITY_DIR) -> list[FidelityPoint]:
    """Every point of every ``*.yaml`` in ``folder``, strictly: unknown keys, missing sources, duplicate
    ids and impossible setups are errors naming the file and key."""
    folder = Path(folder)
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    if not files:
        raise ConfigError("--suite", f"{folder} holds no fidelity files (*.yaml)", "pass the folder of the suite")
    points: list[FidelityPoint] = []
    seen: dict[str, str] = {}
    for path in files:
        raw = OmegaConf.to_container(read_mapping(path))
        _check_keys(raw, SuiteFile, path.name)
        try:
            suite: SuiteFile = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SuiteFile), raw))  # type: ignore[assignment]
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "points"
            raise ConfigError(f"{path.name}: {key}", str(err).splitlines()[0],
                              "a point needs id, what, unit, measured, source (ref, url, where) and setup.kind; "
                              "see configs/fidelity/README.md") from None
        _require(suite.group, f"{path.name}: group", "name the group of points this file holds")
        for i, spec in enumerate(suite.points):
            where = f"{path.name}: points[{i}]"
            _check_point(spec, where)
            if spec.id in seen:
                raise ConfigError(f"{where}.id", f"'{spec.id}' is also a point of {seen[spec.id]}", "ids are unique")
            seen[spec.id] = path.name
            points.append(FidelityPoint(suite.group, spec, path.name, folder))
    return points
