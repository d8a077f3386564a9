"""`lagom validate`: the cost model against published measurements (the fidelity suite).

Each file under ``configs/fidelity/`` is one group of points; each point is a published figure (with its
source), the setup it was measured on, and the role it plays here: ``fit`` (a hardware constant was set
from it) or ``check`` (never used to set anything). The model's figure for a point is worked out only
through the planning API (``CostModel``, ``nccl_configs``, the step graph, priority windows, the
simulator), so what is validated is what ``lagom tune`` uses. Errors are relative: |predicted -
measured| / measured, or, for a published range, the distance to its nearer end (zero inside it).

Setups (``setup.kind``):
- ``busbw``: nccl-tests bus bandwidth (GB/s) of one collective on one group, NCCL's own choice of
  algorithm and protocol unless the point forces them (``NCCL_ALGO=Ring`` runs);
- ``latency``: the same collective's time in microseconds;
- ``slowdown``: compute kernels' time beside a running collective over their time alone (a ratio),
  one kernel, or the mean or max over several kernels and GPUs;
- ``comm_slowdown``: the other side of the same pair, the collective's time beside the kernel over its
  time alone;
- ``overlap``: kernel and collective launched together over the two run one after the other (the window
  estimate the priority search ranks settings with, for a window of that one kernel);
- ``sequential``: the kernel, then the collective, each alone: the sum of their times in microseconds (what a
  framework's unoverlapped GEMM followed by its collective takes);
- ``window``: a collective of a workload's step at a given setting against NCCL's: the speed-up of the
  compute that runs beside it under either setting (``local``), of the whole step (``step``), or the largest slowdown
  any setting of the space causes to the compute beside it (``max_slowdown``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lagom.config_file import read_mapping
from lagom.errors import ConfigError
from lagom.fidelity import COMM_KINDS, PAIR_KINDS, ROLES, Comm, FidelityPoint, Kernel, Setup, load_suite, needed
from lagom.hardware import Hardware, gpu_family, load_hardware, with_cluster
from lagom.model.choices import candidates
from lagom.model.contention import ContentionSample, KernelShape, predict
from lagom.model.cost_model import CostModel, RunningComm
from lagom.model.simulator import simulate
from lagom.model.windows import Window, estimate, windows
from lagom.outputs import output_folder
from lagom.plan.comm_config import CommConfig, SearchSpace
from lagom.resources import FIDELITY_DIR
from lagom.search.base import Problem, nccl_configs
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from lagom.step.points import points_for
from lagom.step.workload import load_workload

# ---------------------------------------------------------------------------------------------
# The suite's schema: one dataclass per part; unknown keys are refused with the known ones named



# ---------------------------------------------------------------------------------------------
# The model's figure for each kind of setup


class Machines:
    """Hardware profiles by reference (a preset, or a file relative to the suite's folder), with the user's
    replacements: a profile given with --hardware stands in for every profile of the same GPU model (a
    calibrated A100 file for the a100 presets)."""

    def __init__(self, overrides: list[str]) -> None:
        self._by_family = {gpu_family(hw.gpu.name): hw for hw in map(load_hardware, overrides)}
        self._cache: dict[str, Hardware] = {}

    def get(self, ref: str, folder: Path) -> Hardware:
        if ref.endswith((".yaml", ".yml")) and not Path(ref).is_absolute():
            ref = str(folder / ref)
        if ref not in self._cache:
            hw = load_hardware(ref)
            self._cache[ref] = self._by_family.get(gpu_family(hw.gpu.name), hw)
        return self._cache[ref]


def _nccl_choice(hw: Hardware, comm: Comm) -> tuple[Hardware, OverlapPoint, CommConfig]:
    """The machine (grown to the point's nodes), the collective as an overlap point, and NCCL's setting for
    it (its algorithm and protocol pick) with the knobs the point forces."""
    per_node = comm.ranks // comm.nodes
    if comm.nodes > hw.cluster.nodes or per_node > hw.cluster.gpus_per_node:
        hw = with_cluster(hw, max(per_node, hw.cluster.gpus_per_node), max(comm.nodes, hw.cluster.nodes))
    group = Group("fidelity", comm.ranks, per_node, comm.nodes)
    point = OverlapPoint("fidelity", Collective(comm.collective), group, comm.bytes, None, None)
    graph = StepGraph("fidelity", hw.name, 1, [Phase("fidelity", 1, {0: []}, [point])], {"fidelity": group})
    cfg = nccl_configs(Problem(graph, hw))[point.key]
    forced = {k: getattr(comm, k) for k in ("algorithm", "protocol", "channels", "threads", "chunk_bytes")
              if getattr(comm, k) is not None}
    return hw, point, replace(cfg, **forced)


def bus_factor(collective: Collective, ranks: int) -> float:
    """nccl-tests' bus bandwidth correction: busbw = algbw x this."""
    if collective == Collective.ALL_REDUCE:
        return 2 * (ranks - 1) / ranks
    if collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (ranks - 1) / ranks
    return 1.0


def comm_figure(hw: Hardware, kind: str, comm: Comm) -> float:
    """The model's figure for a collective measured alone: nccl-tests' bus bandwidth (GB/s) or its time (us)."""
    hw, point, cfg = _nccl_choice(hw, comm)
    seconds = CostModel(hw).comm_time(point.collective, point.group, point.bytes, cfg)
    if kind == "latency":
        return seconds * 1e6
    return comm.bytes * bus_factor(Collective(comm.collective), comm.ranks) / seconds / 1e9


def _segment(hw: Hardware, kernel: Kernel) -> ComputeSegment:
    shape = KernelShape(gemm=tuple(kernel.gemm) if kernel.gemm else None,  # type: ignore[arg-type]
                        elements=None if kernel.gemm else kernel.elements or 0)
    return shape.segment(hw)


@dataclass(frozen=True)
class Pair:
    """One kernel and one collective launched together, as the model sees them: each one's time beside the
    other over its time alone, the two launched together over the two run one after the other, and that
    one-after-the-other time itself."""

    kernel: float  # slowdown: the kernel beside the collective (running for the kernel's whole duration)
    comm: float  # comm_slowdown: the collective beside the kernel (the kernel's HBM share for all of it)
    overlap: float  # overlap: together (the priority search's window estimate) over back to back
    sequential_us: float  # sequential: the kernel alone, then the collective alone

    def figure(self, kind: str) -> float:
        """The figure a pair kind of setup measures."""
        return {"slowdown": self.kernel, "comm_slowdown": self.comm, "overlap": self.overlap,
                "sequential": self.sequential_us}[kind]


def pair_setup(hw: Hardware, comm: Comm, kernel: Kernel) -> tuple[Hardware, OverlapPoint, CommConfig, ComputeSegment]:
    """A pair point's machine (grown to its nodes), collective, NCCL's setting for it and the kernel's segment:
    what ``pair_beside`` times (none of it depends on the contention constants, which the pair's times do)."""
    hw, point, cfg = _nccl_choice(hw, comm)
    return hw, point, cfg, _segment(hw, kernel)


def aggregate(ratios: list[float], how: str) -> float:
    """A pair point's figure over its kernels and machines: the largest (``max``) or the mean (``mean``, ``one``)."""
    return max(ratios) if how == "max" else statistics.fmean(ratios)


def _pair(hw: Hardware, comm: Comm, kernel: Kernel) -> Pair:
    hw, point, cfg, seg = pair_setup(hw, comm, kernel)
    return pair_beside(CostModel(hw), point, cfg, seg)


def pair_beside(model: CostModel, point: OverlapPoint, cfg: CommConfig, seg: ComputeSegment) -> Pair:
    """The point's collective at ``cfg`` and the segment, launched together. The collective takes the CTAs
    NCCL launches for it and the HBM rate it reaches beside the segment, as in the simulator; the overlapped
    time is what the priority search counts for a window of this one segment (its compute alone plus what
    the collective adds), the sequential time both alone."""
    alone = model.comm_time(point.collective, point.group, point.bytes, cfg)
    seconds = model.comm_time(point.collective, point.group, point.bytes, cfg, model.hbm_util(seg))
    rate = model.comm_hbm_rate(point.collective, point.group, point.bytes, seconds, cfg)
    ctas = model.launch_shape(point.collective, point.group, point.bytes, cfg)[0]
    solo = model.compute_solo(seg)
    window = Window(point, 1, [seg], [])
    together = window.costs(False, model).hide + estimate(cfg, [window], model).added
    return Pair(kernel=model.compute_time(seg, (RunningComm(cfg, rate, ctas),)) / solo,
                comm=seconds / alone if alone > 0 else 1.0, overlap=together / (solo + alone),
                sequential_us=(solo + alone) * 1e6)


@dataclass
class _Step:
    """A workload's step on one machine, with NCCL's configs, built once per (workload, hardware)."""

    hw: Hardware
    graph: StepGraph
    model: CostModel
    nccl: dict[str, CommConfig]
    wins: dict[str, list[Window]]

    def key(self, collective: str, where: str) -> str:
        keys = [k for k, pts in self.graph.keys().items() if pts[0].collective == collective]
        if len(keys) != 1:
            raise ConfigError(where, f"the step has {len(keys)} {collective} keys, not one", "pick a workload with one")
        return keys[0]

    def window_time(self, key: str, cfg: CommConfig, beside: tuple[CommConfig, ...] = ()) -> float:
        """Seconds the key's windows take per step: the compute they hide under plus what they add.

        With ``beside``, each window is cut to the compute that runs beside the collective under ``cfg`` or
        any of those configs (its segments up to the one in which the longest of them ends): a window that
        lasts until the optimizer (a gradient reduce-scatter's) would otherwise dilute a local speed-up with
        compute no setting touches. Segments are counted at their time alone, so the cut never falls short."""
        wins = [self._overlapped(w, (cfg, *beside)) for w in self.wins[key]] if beside else self.wins[key]
        hide = sum(w.costs(False, self.model).hide * w.repeat for w in wins)
        return hide + estimate(cfg, wins, self.model).added

    def _overlapped(self, window: Window, configs: tuple[CommConfig, ...]) -> Window:
        point, model = window.point, self.model
        util = window.costs(False, model).util
        longest = max(model.comm_time(point.collective, point.group, point.bytes, c, util) for c in configs)
        elapsed = 0.0
        for count, seg in enumerate(window.segments, 1):
            elapsed += model.compute_solo(seg)
            if elapsed >= longest:
                return Window(point, window.repeat, window.segments[:count], window.fused)
        return window


class Evaluator:
    """Works out the model's figure for each point; steps and machines are built once per suite."""

    def __init__(self, overrides: list[str] | None = None) -> None:
        self.machines = Machines(overrides or [])
        self._steps: dict[tuple[str, str], _Step] = {}

    def step(self, workload: str, hardware: str, folder: Path = FIDELITY_DIR) -> _Step:
        if (workload, hardware) not in self._steps:
            hw = self.machines.get(hardware, folder)
            graph = points_for(load_workload(workload), hw)
            problem = Problem(graph, hw)
            self._steps[(workload, hardware)] = _Step(hw, graph, problem.model, nccl_configs(problem), windows(graph))
        return self._steps[(workload, hardware)]

    def gpu(self, point: FidelityPoint) -> str:
        """The GPU model(s) of the point's machines: 'H100', or 'A100+H100' for a figure over several."""
        names = {self.machines.get(h, point.folder).gpu.name for h in point.spec.setup.hardware}
        return "+".join(sorted({gpu_family(n) or n for n in names}))

    def predict(self, point: FidelityPoint) -> float:
        s = point.spec.setup
        where = f"{point.file}: {point.spec.id}.setup"
        if s.kind in COMM_KINDS:
            return comm_figure(self.machines.get(s.hardware[0], point.folder), s.kind, needed(s.comm, f"{where}.comm"))
        if s.kind in PAIR_KINDS:
            comm = needed(s.comm, f"{where}.comm")
            return aggregate([_pair(self.machines.get(h, point.folder), comm, k).figure(s.kind)
                              for h in s.hardware for k in s.kernels], s.aggregate)
        return self._window(s, where, point.folder)

    def _window(self, s: Setup, where: str, folder: Path) -> float:
        step = self.step(needed(s.workload, f"{where}.workload"), s.hardware[0], folder)
        key = step.key(needed(s.collective, f"{where}.collective"), f"{where}.collective")
        nccl = step.nccl[key]
        if s.measure == "max_slowdown":
            return self._max_slowdown(step, key)
        cfg = replace(nccl, channels=s.channels or nccl.channels, chunk_bytes=s.chunk_bytes or nccl.chunk_bytes)
        if s.measure == "local":
            return step.window_time(key, nccl, (cfg,)) / step.window_time(key, cfg, (nccl,))
        base = simulate(step.graph, step.nccl, step.model).step_s
        return base / simulate(step.graph, {**step.nccl, key: cfg}, step.model).step_s

    @staticmethod
    def _max_slowdown(step: _Step, key: str) -> float:
        """The most any setting of the search space slows the compute segments beside the key's collective."""
        model, worst = step.model, 1.0
        point = step.graph.keys()[key][0]
        segments = {(seg.flops, seg.bytes, seg.ctas): seg for w in step.wins[key] for seg in w.segments if seg.flops > 0}
        for cfg in candidates(point, step.hw, SearchSpace()):
            if cfg.decomposition != "collective":
                continue
            for seg in segments.values():
                worst = max(worst, pair_beside(model, point, cfg, seg).kernel)
        return worst


# ---------------------------------------------------------------------------------------------
# Errors and the summary


def relative_error(measured: float | list[float], predicted: float) -> float:
    """|predicted - measured| / measured; for a range, to its nearer end (zero inside it)."""
    if isinstance(measured, list):
        low, high = measured
        if low <= predicted <= high:
            return 0.0
        nearer = low if predicted < low else high
        return abs(predicted - nearer) / nearer
    return abs(predicted - measured) / measured


@dataclass
class Result:
    id: str
    group: str
    role: str
    measured: float | list[float]
    predicted: float
    error: float
    unit: str
    what: str
    source: str
    gpu: str = ""  # the GPU model of the point's machines ('A100'; 'A100+H100' for a mean over several)

    def row(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "gpu": self.gpu, "role": self.role, "measured": self.measured,
                "predicted": self.predicted, "error": self.error}


Summary = dict[str, dict[str, float | None]]  # role -> median and max relative error


def _roles(results: list[Result]) -> Summary:
    out: Summary = {}
    for role in ROLES:
        errors = [r.error for r in results if r.role == role]
        out[role] = {"median": statistics.median(errors) if errors else None, "max": max(errors) if errors else None}
    return out


def summarize(results: list[Result]) -> dict[str, Summary]:
    """Per group, per role: median and max relative error (None where a group has no point of that role)."""
    return {group: _roles([r for r in results if r.group == group]) for group in sorted({r.group for r in results})}


def summarize_by_gpu(results: list[Result]) -> dict[str, dict[str, Summary]]:
    """Per group and GPU model, per role: median and max relative error."""
    return {group: {gpu: _roles([r for r in results if r.group == group and r.gpu == gpu])
                    for gpu in sorted({r.gpu for r in results if r.group == group})}
            for group in sorted({r.group for r in results})}


def validate(points: list[FidelityPoint], overrides: list[str] | None = None,
             evaluator: Evaluator | None = None) -> list[Result]:
    """Each point's figure in the model and its error; ``evaluator`` may be shared to reuse built steps."""
    evaluator = evaluator or Evaluator(overrides)
    results = []
    for p in points:
        predicted = evaluator.predict(p)
        results.append(Result(p.spec.id, p.group, p.spec.role, p.spec.measured, predicted,
                              relative_error(p.spec.measured, predicted), p.spec.unit, p.spec.what,
                              f"{p.spec.source.ref} ({p.spec.source.where})", evaluator.gpu(p)))
    return results


PROFILE_SUFFIXES = (".yaml", ".yml")


def measured_results(path: str | Path) -> list[Result]:
    """The model against this machine's own measurements: the trials of a live-tuning report (``trials`` in
    the JSON report an online session writes), the contention samples of a ``lagom calibrate --contention``
    profile, or every such file in a folder."""
    root = Path(path)
    files = sorted(f for f in root.iterdir() if f.suffix in (".json", *PROFILE_SUFFIXES)) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise ConfigError("--measured", f"{path} is neither a report, a profile, nor a folder of them")
    results = []
    for file in files:
        found = _profile_results(file, root.is_dir()) if file.suffix in PROFILE_SUFFIXES else \
            _trial_results(file, root.is_dir())
        results += found
    if not results:
        raise ConfigError("--measured", f"no trials or contention samples in {path}",
                          "live tuning records trials in online mode; `lagom calibrate --contention` writes samples")
    return results


def _trial_results(file: Path, in_folder: bool) -> list[Result]:
    """Per trial of a live-tuning report: its step and each collective it measured, predicted by the
    calibrated model the search ranked with."""
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError("--measured", f"cannot read {file}: {err}") from None
    if not isinstance(data, dict) or "trials" not in data:
        if in_folder:
            return []  # other JSON beside the reports (plans)
        raise ConfigError("--measured", f"{file} has no 'trials'", "pass the JSON report of an online run "
                          "(its live tuning writes them)")
    results = []
    for t in data["trials"]:
        where = f"{file.name} {t['id']} (steps {t['steps'][0]}-{t['steps'][-1]}, {t['decision']})"
        moved = ", ".join(sorted(t["changed"])) or "the reference"
        results.append(Result(f"{file.stem}:{t['id']}:step", "live-step", "check", t["measured"]["step_s"],
                              t["predicted"]["step_s"],
                              relative_error(t["measured"]["step_s"], t["predicted"]["step_s"]), "s",
                              f"step with {moved}", where))
        predicted = t["predicted"]["collectives_s"]
        for key, seconds in sorted(t["measured"]["collectives_s"].items()):
            if key in predicted and seconds > 0:
                results.append(Result(f"{file.stem}:{t['id']}:{key}", "live-collective", "check", seconds,
                                      predicted[key], relative_error(seconds, predicted[key]), "s",
                                      f"{key} per call", where))
    return results


def _profile_results(file: Path, in_folder: bool) -> list[Result]:
    """Per contention sample of a calibrated profile: the kernel's and the collective's slowdown, predicted
    by the profile itself (its fitted constants); samples the fit used are ``fit``, held-out ones ``check``."""
    data = OmegaConf.to_container(read_mapping(file))
    section = ((data.get("calibration") or {}).get("contention") if isinstance(data, dict) else None)
    if not section:
        if in_folder:
            return []  # other profiles (links only) beside them
        raise ConfigError("--measured", f"{file} has no calibration.contention samples",
                          "profile with `lagom calibrate --contention`")
    model = CostModel(load_hardware(str(file)))
    fitted = set(section.get("fit", {}).get("fit_ids", []))
    where = f"{file.name} ({section.get('measured', {}).get('device', '?')}, {section.get('measured', {}).get('date', '?')})"
    results = []
    for i, row in enumerate(section.get("samples", [])):
        sample = ContentionSample.from_dict(row, f"{file.name}: calibration.contention.samples[{i}]")
        kernel, comm = predict(model, sample)
        role = "fit" if sample.id in fitted else "check"
        for group, measured, predicted, what in (
                ("contention-kernel", sample.kernel_ratio, kernel, f"{sample.kernel.label} beside {sample.collective}"),
                ("contention-comm", sample.comm_ratio, comm, f"{sample.collective} beside {sample.kernel.label}")):
            results.append(Result(f"{file.stem}:{sample.id}:{group.split('-')[1]}", group, role, measured, predicted,
                                  relative_error(measured, predicted), "ratio", what, where))
    return results


def report(results: list[Result]) -> dict[str, Any]:
    """The JSON object ``lagom validate --json`` prints."""
    return {"points": [r.row() for r in results], "summary": summarize(results), "by_gpu": summarize_by_gpu(results)}


# ---------------------------------------------------------------------------------------------
# Output: terminal table, validate.md, plot


def _num(value: float | list[float]) -> str:
    if isinstance(value, list):
        return "-".join(f"{v:.4g}" for v in value)
    return f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _summary_rows(results: list[Result]) -> list[tuple[str, str, Summary]]:
    """(group, GPU model or 'all', summary): each group over all its points, then per GPU model where it has several."""
    by_gpu = summarize_by_gpu(results)
    rows = []
    for group, roles in summarize(results).items():
        rows.append((group, "all", roles))
        if len(by_gpu[group]) > 1:
            rows += [(group, gpu, gpu_roles) for gpu, gpu_roles in by_gpu[group].items()]
    return rows


def markdown(results: list[Result]) -> str:
    lines = ["# Cost model against published measurements", "",
             "Relative error |predicted - measured| / measured (for a published range: to its nearer end).",
             "`fit` points set a hardware constant; `check` points never did.", "",
             "## Summary", "", "| group | GPU | fit median | fit max | check median | check max |",
             "|---|---|---|---|---|---|"]
    for group, gpu, roles in _summary_rows(results):
        lines.append(f"| {group} | {gpu} | {_pct(roles['fit']['median'])} | {_pct(roles['fit']['max'])} | "
                     f"{_pct(roles['check']['median'])} | {_pct(roles['check']['max'])} |")
    lines += ["", "## Points", "", "| id | group | GPU | role | what | measured | predicted | unit | error | source |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.id} | {r.group} | {r.gpu} | {r.role} | {r.what} | {_num(r.measured)} | {_num(r.predicted)} | "
                     f"{r.unit} | {_pct(r.error)} | {r.source} |")
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> Path:
    """Predicted against measured, log-log, one panel per group, one colour per GPU model, fit points with a
    black edge, the diagonal for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    groups = sorted({r.group for r in results})
    gpus = sorted({r.gpu for r in results})
    cols = min(3, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.4 * rows), squeeze=False)
    for ax, group in zip(axes.flat, groups):
        mine = [r for r in results if r.group == group]
        for gpu in sorted({r.gpu for r in mine}):
            these = [r for r in mine if r.gpu == gpu]
            measured = [math.sqrt(r.measured[0] * r.measured[1]) if isinstance(r.measured, list) else r.measured
                        for r in these]
            ax.scatter(measured, [r.predicted for r in these], color=f"C{gpus.index(gpu)}", label=gpu or "?", s=18,
                       edgecolors=["black" if r.role == "fit" else "none" for r in these])
        values = [v for r in mine for v in ([r.predicted] + (r.measured if isinstance(r.measured, list) else [r.measured]))]
        low, high = min(values) / 1.5, max(values) * 1.5
        ax.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain labels: matplotlib's default 10^k ones go through its slow mathtext
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel("measured (published)")
        ax.set_ylabel("predicted (cost model)")
        ax.set_title(f"{group} ({mine[0].unit if len({r.unit for r in mine}) == 1 else 'mixed units'})", fontsize=10)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle("Fidelity suite (black edge: fit point)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(results: list[Result]) -> str:
    rows = [("id", "group", "gpu", "role", "measured", "predicted", "unit", "error")]
    rows += [(r.id, r.group, r.gpu, r.role, _num(r.measured), _num(r.predicted), r.unit, _pct(r.error)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append("")
    for group, gpu, roles in _summary_rows(results):
        label = group if gpu == "all" else f"  {group} {gpu}"
        lines.append(f"{label}: fit median {_pct(roles['fit']['median'])} max {_pct(roles['fit']['max'])}; "
                     f"check median {_pct(roles['check']['median'])} max {_pct(roles['check']['max'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", action="append", default=[], metavar="NAME|FILE",
                        help="a hardware profile (e.g. a calibrated one) to use instead of the presets of the same GPU "
                             "model; repeat for several GPU models")
    parser.add_argument("--json", action="store_true", help="print one JSON object: points and summary")
    parser.add_argument("--out", metavar="DIR", help="write validate.md and validate.png into DIR")
    parser.add_argument("--suite", default=str(FIDELITY_DIR), metavar="DIR",
                        help="folder of fidelity files (default: configs/fidelity)")
    parser.add_argument("--measured", metavar="PATH",
                        help="instead of the published suite: a job's own measurements, the JSON report of an online "
                             "run (its live-tuning trials) or a folder of them")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``lagom validate``, for a CLI that builds its subcommands itself."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "validate", help="the cost model against the published measurements of configs/fidelity")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    out = output_folder(args.out, "--out") if args.out else None
    results = measured_results(args.measured) if args.measured else validate(load_suite(args.suite), args.hardware)
    if out is not None:
        out.mkdir(exist_ok=True)
        (out / "validate.md").write_text(markdown(results))
        plot(results, out / "validate.png")
    if args.json:
        print(json.dumps(report(results)))
    else:
        print(_table(results))
        if out is not None:
            print(f"\nwritten: {out / 'validate.md'}, {out / 'validate.png'}")
    return 0
