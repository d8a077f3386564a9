"""Contention samples measured on a machine, and the fit of the cost model's contention constants to them.

A sample is one compute kernel (a bf16 GEMM or a memory-bound pass) and one collective setting, each
timed alone and beside the other (``lagom calibrate --contention`` takes them). The cost model predicts
both ratios, beside over alone, from the hardware profile's constants: the GEMM CTA slots a comm CTA
leaves no room for (residency), whether GEMMs run persistent, the share of the comm's HBM traffic the
compute loses, the L2 term of chunk staging, and how much the compute's HBM use slows the comm. The fit
sets those constants from part of the samples and checks them on the rest, held out. The same fit
(``fit_observed``) runs on any ``Observation``: ``lagom.published_fit`` feeds it the published suite's pair
points of one GPU generation, with no held-out part (the suite's check points are the check).

Framework-free: the samples are plain data, the measuring lives in ``lagom.runtime.measure.contention_bench``.
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.model.cost_model import CostModel, RunningComm
from lagom.plan.comm_config import CommConfig
from lagom.step.graph import Collective, ComputeSegment, Group

BF16 = 2  # bytes per element of the kernels a sample describes by shape
HELD_OUT_EVERY = 3  # one sample in three (by a hash of its id) is held out of the fit
SWEEPS = 3  # coordinate-descent passes over the continuous constants
GRID = 24  # grid steps per constant and pass, before a local refinement


@dataclass(frozen=True)
class KernelShape:
    """A compute kernel by shape: a bf16 GEMM (m x k times k x n) or an elementwise pass over elements."""

    gemm: tuple[int, int, int] | None = None
    elements: int | None = None

    def __post_init__(self) -> None:
        if (self.gemm is None) == (self.elements is None):
            raise ConfigError("kernel", "needs exactly one of gemm: [m, n, k] or elements: N")

    @property
    def label(self) -> str:
        return f"gemm-{'x'.join(map(str, self.gemm))}" if self.gemm else f"elementwise-{self.elements}"

    def segment(self, hw: Hardware) -> ComputeSegment:
        """The segment the cost model times: FLOPs, HBM bytes and the CTAs of the kernel's grid."""
        if self.gemm is not None:
            m, n, k = self.gemm
            tile_m, tile_n = hw.gpu.gemm_tile
            ctas = math.ceil(m / tile_m) * math.ceil(n / tile_n)
            return ComputeSegment("gemm", 2.0 * m * n * k, BF16 * (m * k + k * n + m * n), ctas)
        elements = self.elements or 0
        return ComputeSegment("elementwise", 0.0, 2.0 * BF16 * elements, max(1, elements // 1024))

    def to_dict(self) -> dict[str, Any]:
        return {"gemm": list(self.gemm)} if self.gemm else {"elements": self.elements}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelShape:
        gemm = data.get("gemm")
        return cls(gemm=tuple(int(v) for v in gemm) if gemm is not None else None,  # type: ignore[arg-type]
                   elements=int(data["elements"]) if data.get("elements") is not None else None)


@dataclass(frozen=True)
class ContentionSample:
    """One kernel and one collective setting, each timed alone and beside the other (slowest rank, median)."""

    id: str
    kernel: KernelShape
    collective: Collective
    bytes: int  # as the cost model counts them: the gathered output, the unreduced input
    ranks: int
    nodes: int
    config: CommConfig  # what the collective ran with (channels, chunk, protocol, threads)
    source: str  # nccl | gloo | emulated (a comm-like kernel on one GPU: no peer)
    kernel_alone_s: float
    kernel_beside_s: float
    comm_alone_s: float
    comm_beside_s: float

    @property
    def kernel_ratio(self) -> float:
        return self.kernel_beside_s / self.kernel_alone_s

    @property
    def comm_ratio(self) -> float:
        return self.comm_beside_s / self.comm_alone_s

    @property
    def group(self) -> Group:
        return Group("calibration", self.ranks, max(1, self.ranks // self.nodes), self.nodes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kernel"] = self.kernel.to_dict()
        data["collective"] = str(self.collective)
        data["config"] = self.config.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "sample") -> ContentionSample:
        try:
            sample = cls(id=str(data["id"]), kernel=KernelShape.from_dict(data["kernel"]),
                         collective=Collective(data["collective"]), bytes=int(data["bytes"]),
                         ranks=int(data["ranks"]), nodes=int(data["nodes"]),
                         config=CommConfig.from_dict(data["config"], f"{where}.config"), source=str(data["source"]),
                         **{k: float(data[k]) for k in ("kernel_alone_s", "kernel_beside_s", "comm_alone_s",
                                                        "comm_beside_s")})
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(where, f"is not a contention sample ({err!r})",
                              "use the samples `lagom calibrate --contention` writes") from None
        if min(sample.kernel_alone_s, sample.kernel_beside_s, sample.comm_alone_s, sample.comm_beside_s) <= 0:
            raise ConfigError(where, f"sample {sample.id} has a time that is not positive")
        return sample


def predict(model: CostModel, s: ContentionSample) -> tuple[float, float]:
    """(kernel beside / alone, collective beside / alone) as the model sees this sample.

    The collective's HBM traffic is taken at its measured rate beside the kernel, so the link constants
    (a separate calibration) do not leak into the contention terms."""
    seg = s.kernel.segment(model.hw)
    rate = model.comm_hbm_rate(s.collective, s.group, s.bytes, s.comm_beside_s, s.config)
    ctas = model.launch_shape(s.collective, s.group, s.bytes, s.config)[0]
    kernel = model.compute_time(seg, (RunningComm(s.config, rate, ctas),)) / model.compute_solo(seg)
    alone = model.comm_time(s.collective, s.group, s.bytes, s.config)
    beside = model.comm_time(s.collective, s.group, s.bytes, s.config, model.hbm_util(seg))
    return kernel, beside / alone if alone > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# The constants the fit sets, and where they live in a profile


@dataclass(frozen=True)
class Constant:
    """A fitted constant: its place in the profile (section, key) and the range searched."""

    section: str  # contention | gpu
    key: str
    low: float
    high: float


CONSTANTS = (
    Constant("contention", "gemm_slots_per_comm_cta", 0.0, 2.0),  # residency
    Constant("contention", "hbm_interference", 0.0, 4.0),
    Constant("contention", "l2_interference", 0.0, 2.0),  # chunk staging in L2
    Constant("contention", "comm_slowdown_per_hbm_util", 0.0, 4.0),
)
PERSISTENT = Constant("gpu", "persistent_gemm", 0.0, 1.0)  # tried both ways


def with_constants(hw: Hardware, values: dict[str, float]) -> Hardware:
    """``hw`` with the named constants (``CONSTANTS`` keys, and ``persistent_gemm``) replaced."""
    changed: dict[str, Any] = {c.key: values[c.key] for c in CONSTANTS if c.key in values}
    contention = replace(hw.contention, **changed)
    gpu = replace(hw.gpu, persistent_gemm=bool(values[PERSISTENT.key])) if PERSISTENT.key in values else hw.gpu
    return replace(hw, contention=contention, gpu=gpu)


def current_values(hw: Hardware) -> dict[str, float]:
    """The profile's own constants; residency as the footprints give it where the profile sets none."""
    model = CostModel(hw)
    values = {c.key: float(getattr(hw.contention, c.key)) for c in CONSTANTS if c.key != "gemm_slots_per_comm_cta"}
    values["gemm_slots_per_comm_cta"] = float(model.footprint_slots_lost(model.launched_threads(CommConfig())))
    values[PERSISTENT.key] = float(hw.gpu.persistent_gemm)
    return values


# ---------------------------------------------------------------------------------------------
# The fit: one for a user's samples and for the published suite's fit points


Measured = float | tuple[float, float]  # a ratio, or the [low, high] range a source gives


class Observation(Protocol):
    """Ratios something measured and the model's figure for each under given constants: a sample of ``lagom
    calibrate --contention`` (``OnMachine``) or a published pair point (``lagom.published_fit``)."""

    @property
    def id(self) -> str: ...

    def figures(self, values: dict[str, float]) -> list[tuple[float, Measured]]:
        """(predicted, measured) per ratio, the constants in ``values`` set on the observation's machine."""
        ...


@dataclass(frozen=True)
class OnMachine:
    """A user's sample on the machine it was measured on: its kernel's ratio and its collective's."""

    sample: ContentionSample
    base: Hardware

    @property
    def id(self) -> str:
        return self.sample.id

    def figures(self, values: dict[str, float]) -> list[tuple[float, Measured]]:
        kernel, comm = predict(CostModel(with_constants(self.base, values)), self.sample)
        return [(kernel, self.sample.kernel_ratio), (comm, self.sample.comm_ratio)]


def _log_miss(predicted: float, measured: Measured) -> float:
    """log(predicted / measured); to a range's nearer end, zero inside it."""
    low, high = measured if isinstance(measured, tuple) else (measured, measured)
    return 0.0 if low <= predicted <= high else math.log(predicted / (low if predicted < low else high))


def is_held_out(sample_id: str) -> bool:
    """A fixed split, the same on every machine and run: a hash of the id, not the order measured."""
    return zlib.crc32(sample_id.encode()) % HELD_OUT_EVERY == 0


def errors(values: dict[str, float], observed: Sequence[Observation]) -> list[float]:
    """Relative error of each predicted ratio against the measured one (a range: to its nearer end)."""
    return [abs(math.expm1(_log_miss(p, m))) for o in observed for p, m in o.figures(values)]


def _loss(values: dict[str, float], observed: Sequence[Observation]) -> float:
    """Mean squared log ratio of predicted to measured: a 2x miss counts the same either way."""
    misses = [_log_miss(p, m) ** 2 for o in observed for p, m in o.figures(values)]
    return sum(misses) / max(1, len(misses))


def best_on(objective: Callable[[float], float], low: float, high: float, start: float) -> float:
    """The best value of one constant: a grid over its range, then a golden-section search around the best."""
    grid = sorted({start, *(low + (high - low) * i / GRID for i in range(GRID + 1))})
    best = min(grid, key=objective)
    a, b = max(low, best - (high - low) / GRID), min(high, best + (high - low) / GRID)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(20):
        x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
        if objective(x1) <= objective(x2):
            b = x2
        else:
            a = x1
    middle = (a + b) / 2
    return middle if objective(middle) < objective(best) else best


def _descend(observed: Sequence[Observation], start: dict[str, float]) -> tuple[dict[str, float], float]:
    """Coordinate passes on a grid (the loss has steps: whole GEMM waves), then Powell's method on all of them
    together, which follows the valleys where two constants trade off (HBM share against the L2 term)."""
    values = dict(start)
    for _ in range(SWEEPS):
        for c in CONSTANTS:
            def along(v: float, key: str = c.key) -> float:
                return _loss({**values, key: v}, observed)

            values[c.key] = best_on(along, c.low, c.high, values[c.key])

    from scipy.optimize import minimize  # only a fit needs it: `lagom validate` reads samples without it

    def loss(x: Any) -> float:
        return _loss({**values, **{c.key: float(v) for c, v in zip(CONSTANTS, x)}}, observed)

    polished = minimize(loss, [values[c.key] for c in CONSTANTS], method="Powell",
                        bounds=[(c.low, c.high) for c in CONSTANTS], options={"xtol": 1e-4, "ftol": 1e-12})
    if polished.fun < loss([values[c.key] for c in CONSTANTS]):
        values.update({c.key: float(v) for c, v in zip(CONSTANTS, polished.x)})
    return values, _loss(values, observed)


@dataclass
class ContentionFit:
    """Fitted constants (only those the samples inform), the split, and the errors before and after."""

    constants: dict[str, float]
    fit_ids: list[str]
    held_out_ids: list[str]
    held_out: dict[str, dict[str, float]] = field(default_factory=dict)  # fitted | estimate -> median, max
    fitted: dict[str, dict[str, float]] = field(default_factory=dict)  # the same on the fit points
    uninformed: list[str] = field(default_factory=list)  # constants the samples do not move: the base's stay

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _summary(errs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(errs), "max": max(errs)} if errs else {}


def _informs(observed: Sequence[Observation], values: dict[str, float], c: Constant) -> bool:
    """Whether the loss moves at all across the constant's range (no GEMM sample: residency doesn't)."""
    ends = [_loss({**values, c.key: v}, observed) for v in (c.low, c.high, values[c.key])]
    return max(ends) - min(ends) > 1e-12 * max(1.0, max(ends))


def fit(samples: list[ContentionSample], base: Hardware) -> ContentionFit:
    """``lagom calibrate --contention``: the constants fitted to the samples not held out (``is_held_out``),
    from ``base``'s, checked on the held-out ones."""
    train = [OnMachine(s, base) for s in samples if not is_held_out(s.id)]
    if not train:
        raise ConfigError("calibration.contention", f"{len(samples)} sample(s), none left to fit once held-out ones "
                          "are set aside", "measure more settings (a larger --budget-s)")
    return fit_observed(train, [OnMachine(s, base) for s in samples if is_held_out(s.id)], current_values(base))


def fit_observed(train: Sequence[Observation], held: Sequence[Observation], start: dict[str, float]) -> ContentionFit:
    """The fit both sources of samples run: the constants from ``start`` (``current_values`` of the base), both
    GEMM schedules (persistent or not) tried and the better kept; constants ``train`` does not inform keep
    ``start``'s. ``held`` is only measured against, never fitted to."""
    tried = []
    for persistent in (0.0, 1.0):
        values, loss = _descend(train, {**start, PERSISTENT.key: persistent})
        tried.append((loss, persistent != start[PERSISTENT.key], values))
    loss, _, values = min(tried)  # a tie keeps the base's schedule
    schedule_matters = abs(tried[0][0] - tried[1][0]) > 1e-12 * max(1.0, loss)
    informed = {c.key: values[c.key] for c in CONSTANTS if _informs(train, values, c)}
    if schedule_matters:
        informed[PERSISTENT.key] = values[PERSISTENT.key]
    result = ContentionFit(constants=informed, fit_ids=[o.id for o in train], held_out_ids=[o.id for o in held],
                           uninformed=[c.key for c in (*CONSTANTS, PERSISTENT) if c.key not in informed])
    for label, these in (("fitted", {**start, **informed}), ("estimate", start)):
        result.held_out[label] = _summary(errors(these, held))
        result.fitted[label] = _summary(errors(these, train))
    return result


def profile_overrides(result: ContentionFit, measured: dict[str, Any]) -> dict[str, Any]:
    """The profile sections a fit overrides: its constants, marked measured with the points behind them."""
    contention: dict[str, Any] = {k: _round(v) for k, v in result.constants.items() if k != PERSISTENT.key}
    contention["source"] = "measured"
    contention["measured"] = {**measured, "points": result.fit_ids}
    out: dict[str, Any] = {"contention": contention}
    if PERSISTENT.key in result.constants:
        out["gpu"] = {PERSISTENT.key: bool(result.constants[PERSISTENT.key])}
    return out


def _round(x: float) -> float:
    return float(f"{x:.4g}")
