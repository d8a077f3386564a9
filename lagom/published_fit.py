"""NCCL constants of a hardware preset set from the published suite's ``fit`` points.

The fidelity suite (``configs/fidelity/``) splits its sources into ``fit`` and ``check``: a whole source is one
or the other, so no check point shares a thread with a fit point. This module fits the NCCL constants a
preset's ``fit`` points name (``constants: [nccl.nvls_efficiency]``) to those points, on the same path
``lagom validate`` computes them with (``validate.comm_figure``), and checks nothing: the check points are
``lagom validate``'s. The preset keeps the values with a ``calibration.published_fit`` record (source
``published-fit``, the point ids); ``lagom calibrate`` on a user's machine then overrides them for that machine.
A preset built on another (``base:``, the same GPU generation: the H200 on the H100) inherits the fitted constants
its own points do not name, and its record lists them with the base's points that set them.

Collective points (``busbw``, ``latency``) set NCCL constants here. Pair points (a kernel's slowdown beside a
collective) set the contention constants, by the same fit ``lagom calibrate --contention`` runs on a user's
samples (``contention.fit_observed``), per GPU generation: each preset on the points measured on it.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from lagom.config_file import read_mapping
from lagom.errors import ConfigError
from lagom.fidelity import COMM_KINDS, PAIR_KINDS, FidelityPoint, load_suite, needed
from lagom.hardware import BASE_FILE, Hardware, load_hardware, preset_base
from lagom.model.contention import (
    CONSTANTS,
    PERSISTENT,
    ContentionFit,
    Measured,
    best_on,
    current_values,
    fit_observed,
    with_constants,
)
from lagom.model.cost_model import CostModel
from lagom.plan.comm_config import CommConfig
from lagom.resources import HARDWARE_DIR
from lagom.step.graph import ComputeSegment, OverlapPoint
from lagom.validate import Machines, aggregate, comm_figure, pair_beside, pair_setup

SWEEPS = 60  # coordinate passes over the constants at most: two constants that trade off (the NVLS fill's size and
# its half size) creep along their valley, so passes go on until none moves a constant by SETTLED of its range
SETTLED = 1e-4
NUDGE = 0.05  # share of a constant's range it must be pinned within to count as set by the points
TIE = 1e-9  # loss per range of distance from the start value: on a flat stretch the start value stays
# The range searched for each constant a fit point may name.
RANGES: dict[str, tuple[float, float]] = {
    "nccl.nvls_efficiency": (0.3, 1.0),
    "nccl.channel_gbps.nvlink": (5.0, 60.0),
    "nccl.channel_gbps.ib": (2.0, 50.0),
    "nccl.step_overhead_us": (0.0, 20.0),
    "nccl.nvls_fill_us": (0.0, 300.0),
    "nccl.nvls_fill_half_mib": (0.25, 256.0),
    "nccl.ring_fill_us": (0.0, 20.0),
    "nccl.ring_fill_half_mib": (0.01, 2.0),
}
# What a pair fit point may name: the constants the contention fit sets (its own ranges).
CONTENTION = {f"{c.section}.{c.key}": c for c in (*CONSTANTS, PERSISTENT)}


def get_constant(hw: Hardware, path: str) -> float:
    """The value at a dotted path of the profile: ``nccl.nvls_efficiency``, ``nccl.channel_gbps.nvlink``."""
    node: Any = hw
    for key in path.split("."):
        node = node[key] if isinstance(node, dict) else getattr(node, key, None)
        if node is None:
            raise ConfigError(f"constants: {path}", f"'{key}' is not in the hardware profile")
    return float(node)


def set_constant(hw: Hardware, path: str, value: float) -> Hardware:
    """``hw`` with the value at a dotted path replaced (dataclasses and dicts along it copied, not changed)."""

    def put(node: Any, keys: list[str]) -> Any:
        head, rest = keys[0], keys[1:]
        if isinstance(node, dict):
            return {**node, head: put(node[head], rest) if rest else value}
        if is_dataclass(node) and head in {f.name for f in fields(node)}:
            return replace(node, **{head: put(getattr(node, head), rest) if rest else value})  # type: ignore[type-var]
        raise ConfigError(f"constants: {path}", f"'{head}' is not in the hardware profile")

    get_constant(hw, path)
    return put(hw, path.split("."))


@dataclass
class PublishedFit:
    """One preset's fitted constants (those its points move), where they started, the constants the points
    name but do not move (they keep the preset's value), the fit points and their errors before and after;
    ``contention``: the contention fit on the preset's pair points, where it has any."""

    preset: str
    constants: dict[str, float]
    start: dict[str, float]
    uninformed: list[str]
    points: list[str]
    median_before: float | None
    median_after: float | None
    contention: ContentionFit | None = None
    inherited: dict[str, float] = field(default_factory=dict)  # the base preset's fitted constants it keeps
    inherited_points: list[str] = field(default_factory=list)  # the base's fit points that set them

    def record(self) -> dict[str, Any]:
        """What the preset keeps under ``calibration.published_fit``: NCCL's and the contention constants by
        their place in the profile, its own and those inherited from its base preset's fit."""
        fitted = dict(self.constants)
        if self.contention is not None:
            by_key = {c.key: name for name, c in CONTENTION.items()}
            fitted.update({by_key[k]: v for k, v in self.contention.constants.items()})
        fitted.update(self.inherited)
        points = self.points + (self.contention.fit_ids if self.contention else []) + self.inherited_points
        return {"source": "published-fit", "constants": {k: float(f"{v:.4g}") for k, v in fitted.items()},
                "points": points}


@dataclass(frozen=True)
class PublishedPair:
    """A published pair point as the contention fit sees it (a ``contention.Observation``): its kernels beside
    its collective on its machines, set up once, and the figure ``lagom validate`` gives it under the constants."""

    id: str
    kind: str
    measured: Measured
    how: str  # aggregate over kernels and machines
    parts: tuple[tuple[Hardware, OverlapPoint, CommConfig, ComputeSegment], ...]

    @classmethod
    def of(cls, point: FidelityPoint, machines: Machines) -> PublishedPair:
        s, m = point.spec.setup, point.spec.measured
        comm = needed(s.comm, f"{point.file}: {point.spec.id}.setup.comm")
        parts = tuple(pair_setup(machines.get(h, point.folder), comm, k) for h in s.hardware for k in s.kernels)
        return cls(point.spec.id, s.kind, (m[0], m[1]) if isinstance(m, list) else m, s.aggregate, parts)

    def figures(self, values: dict[str, float]) -> list[tuple[float, Measured]]:
        ratios = [pair_beside(CostModel(with_constants(hw, values)), point, cfg, seg).figure(self.kind)
                  for hw, point, cfg, seg in self.parts]
        return [(aggregate(ratios, self.how), self.measured)]


def _built_on(point: FidelityPoint, preset: str) -> bool:
    """Whether the point's one machine is the preset, or a hardware file of the suite whose ``base:`` chain
    reaches it (a two-node file on the one-node preset inherits the preset's NCCL constants)."""
    if len(point.spec.setup.hardware) != 1:
        return False
    ref, folder, seen = point.spec.setup.hardware[0], point.folder, set()
    while ref.endswith((".yaml", ".yml")):
        path = Path(ref) if Path(ref).is_absolute() else folder / ref
        if path in seen:
            return False
        seen.add(path)
        base = read_mapping(path).get("base")
        if not base:
            return False
        ref, folder = str(base), path.parent
    return ref == preset


def fit_points(points: list[FidelityPoint], preset: str, kinds: tuple[str, ...] = COMM_KINDS) -> list[FidelityPoint]:
    """The suite's fit points measured on the preset or a machine built on it alone, of the given kinds."""
    return [p for p in points if p.spec.role == "fit" and p.spec.setup.kind in kinds and _built_on(p, preset)]


def fit_contention(points: list[FidelityPoint], preset: str) -> ContentionFit | None:
    """The contention constants fitted to the preset's pair fit points (None without any), from its own values;
    each point's machine must take its contention constants from the preset, or it would not follow the fit."""
    mine = fit_points(points, preset, PAIR_KINDS)
    if not mine:
        return None
    base, machines = load_hardware(preset), Machines([])
    for p in mine:
        unknown = [c for c in p.spec.constants if c not in CONTENTION]
        if unknown:
            raise ConfigError(f"fit point {p.spec.id}: constants", f"{', '.join(unknown)} is not set by the contention fit",
                              f"a pair point may name {', '.join(CONTENTION)}")
        hw = machines.get(p.spec.setup.hardware[0], p.folder)
        if (hw.contention, hw.gpu.persistent_gemm) != (base.contention, base.gpu.persistent_gemm):
            raise ConfigError(f"fit point {p.spec.id}", "its hardware file sets contention constants itself",
                              "fit it on points whose machines inherit them from the preset")
    return fit_observed([PublishedPair.of(p, machines) for p in mine], [], estimates(base))


def estimates(hw: Hardware) -> dict[str, float]:
    """Where the contention fit starts: the base profile's estimates (residency from the footprints), not the
    preset's fitted values, so that the fit run again lands where it did (its loss has steps: whole waves)."""
    base = read_mapping(HARDWARE_DIR / BASE_FILE)["contention"]
    unfitted: dict[str, Any] = {c.key: float(base[c.key]) for c in CONSTANTS if c.key in base}
    return current_values(replace(hw, contention=replace(hw.contention, **{**unfitted, "gemm_slots_per_comm_cta": None})))


@dataclass
class _Machines:
    """Each fit point's machine, loaded once; the fitted constants are set on each of them."""

    points: list[FidelityPoint]
    preset: Hardware
    loaded: dict[str, Hardware] = field(init=False)

    def __post_init__(self) -> None:
        self.loaded = {p.spec.id: Machines([]).get(p.spec.setup.hardware[0], p.folder) for p in self.points}

    def check(self, constant: str) -> None:
        """A machine built on the preset that sets the constant itself would not follow the fit."""
        for pid, hw in self.loaded.items():
            if get_constant(hw, constant) != get_constant(self.preset, constant):
                raise ConfigError(f"fit point {pid}: {constant}", "its hardware file sets the constant itself",
                                  "fit it on points whose machines inherit it from the preset")

    def log_errors(self, values: dict[str, float], points: list[FidelityPoint]) -> list[float]:
        """log(predicted / measured) per point with the constants set; a range counts from its nearer end."""
        out = []
        for p in points:
            hw = self.loaded[p.spec.id]
            for c, x in values.items():
                hw = set_constant(hw, c, x)
            predicted = comm_figure(hw, p.spec.setup.kind, p.spec.setup.comm)  # type: ignore[arg-type]
            m = p.spec.measured
            low, high = (m[0], m[1]) if isinstance(m, list) else (m, m)
            out.append(0.0 if low <= predicted <= high else math.log(predicted / (low if predicted < low else high)))
        return out

    def loss(self, values: dict[str, float], points: list[FidelityPoint]) -> float:
        """Mean squared log ratio: a 2x miss counts the same either way, a small message as much as a large one."""
        errs = self.log_errors(values, points)
        return sum(e * e for e in errs) / max(1, len(errs))

    def median_error(self, values: dict[str, float]) -> float:
        """Median relative error over all the fit points, as ``lagom validate`` counts it."""
        return statistics.median(abs(math.expm1(e)) for e in self.log_errors(values, self.points))


def inherit(points: list[FidelityPoint], fit: PublishedFit) -> PublishedFit:
    """``fit`` with the constants of its base preset's fit that its own points do not name (a preset built on
    another keeps them: same GPU generation), and the base's fit points that name them. The base's values are
    its record's, which ``tests/test_published_fit.py`` holds to the base's own fit."""
    base = preset_base(fit.preset)
    if base is None:
        return fit
    record = load_hardware(base).calibration.get("published_fit", {})
    own = set(fit.constants) | set(fit.uninformed) | {n for n, c in CONTENTION.items()
                                                      if fit.contention and c.key in fit.contention.constants}
    kept = {c: float(v) for c, v in record.get("constants", {}).items() if c not in own}
    setting = [p.spec.id for p in fit_points(points, base) if set(p.spec.constants) & set(kept)]
    return replace(fit, inherited=kept, inherited_points=setting)


def fit_preset(points: list[FidelityPoint], preset: str) -> PublishedFit:
    """Fit the constants the preset's fit points name, by coordinate passes from the preset's own values; each
    constant on the points that name it. Then the base preset's fitted constants it does not name (``inherit``)."""
    return inherit(points, _fit_own(points, preset))


def _fit_own(points: list[FidelityPoint], preset: str) -> PublishedFit:
    """The fit of the constants the preset's own fit points name."""
    mine = fit_points(points, preset)
    contention = fit_contention(points, preset)
    if not mine and contention is None:
        raise ConfigError(f"--fit {preset}", "the suite has no fit point measured on this preset alone",
                          "mark a whole source's points role: fit, naming the constants they set")
    if not mine:
        return PublishedFit(preset, {}, {}, [], [], None, None, contention)
    names = sorted({c for p in mine for c in p.spec.constants})
    unknown = [c for c in names if c not in RANGES]
    if unknown:
        raise ConfigError(f"--fit {preset}", f"no range to search for {', '.join(unknown)}",
                          f"fit points may name {', '.join(RANGES)}")
    machines = _Machines(mine, load_hardware(preset))
    for c in names:
        machines.check(c)
    naming = {c: [p for p in mine if c in p.spec.constants] for c in names}
    start = {c: get_constant(machines.preset, c) for c in names}
    values = dict(start)

    def loss(c: str, x: float) -> float:
        low, high = RANGES[c]
        return machines.loss({**values, c: x}, naming[c]) + TIE * abs(x - start[c]) / (high - low)

    def pinned(c: str) -> bool:
        """Whether the points pin the constant: its loss rises a step (NUDGE of its range) either side of the fit
        (a link-bound ring, say, only bounds a channel's rate from below: that rate keeps the preset's value)."""
        low, high = RANGES[c]
        step = NUDGE * (high - low)
        here = machines.loss(values, naming[c])
        return all(machines.loss({**values, c: x}, naming[c]) > here * (1 + 1e-9)
                   for x in (max(low, values[c] - step), min(high, values[c] + step)) if x != values[c])

    for _ in range(SWEEPS):
        before = dict(values)
        for c in names:
            values[c] = best_on(partial(loss, c), *RANGES[c], values[c])
        if all(abs(values[c] - before[c]) <= SETTLED * (RANGES[c][1] - RANGES[c][0]) for c in names):
            break
    informed = {c: values[c] for c in names if pinned(c)}
    return PublishedFit(preset, informed, start, [c for c in names if c not in informed], [p.spec.id for p in mine],
                        machines.median_error(start), machines.median_error({**start, **informed}), contention)


def main(argv: list[str] | None = None) -> int:
    """``python -m lagom.published_fit PRESET``: print the fit and the record the preset keeps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="+")
    parser.add_argument("--suite", default=None, help="folder of fidelity files (default: configs/fidelity)")
    args = parser.parse_args(argv)
    points = load_suite(args.suite) if args.suite else load_suite()
    for preset in args.preset:
        result = fit_preset(points, preset)
        if result.median_before is not None and result.median_after is not None:
            print(f"{preset}: {len(result.points)} collective fit points, median error {result.median_before:.1%} -> "
                  f"{result.median_after:.1%}")
        for c, v in result.constants.items():
            print(f"  {c}: {result.start[c]:.4g} -> {v:.4g}")
        for c in result.uninformed:
            print(f"  {c}: {result.start[c]:.4g} (the points do not move it)")
        for c, v in result.inherited.items():
            print(f"  {c}: {v:.4g} (its base preset's fit)")
        if result.contention is not None:
            fit = result.contention
            print(f"{preset}: {len(fit.fit_ids)} pair fit points, median error {fit.fitted['estimate']['median']:.1%} -> "
                  f"{fit.fitted['fitted']['median']:.1%}")
            start = estimates(load_hardware(preset))
            for c, v in fit.constants.items():
                print(f"  contention {c}: {start[c]:.4g} -> {v:.4g}")
            print(f"  the points do not move: {', '.join(fit.uninformed) or 'none'}")
        print(f"  record: {result.record()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
