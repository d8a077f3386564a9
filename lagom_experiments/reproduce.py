"""`lagom reproduce`: the published GPT-2 / BERT / T5 runs and the Lagom paper's A40 workloads, side by side.

Every configuration (a workload on a hardware profile) is tuned by each strategy on the simulator and set
beside the published speedups over NCCL (``configs/published.yaml``). Our figures are simulated on a
profile whose contention constants are either datasheet estimates or measurements, and the table says
which; a published figure says where it was published. Where the two part by more than 0.05x, the report
gives one line on why, from the model's own account of the NCCL step (compute, exposed communication,
the rest) and the published setup. No constant is fitted to a published number.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from lagom.errors import ConfigError  # noqa: E402
from lagom.hardware import load_hardware  # noqa: E402
from lagom.model.bound import step_bound  # noqa: E402
from lagom.model.cost_model import CostModel  # noqa: E402
from lagom.model.simulator import simulate  # noqa: E402
from lagom.outputs import output_folder  # noqa: E402
from lagom.plan.comm_config import CommConfig  # noqa: E402
from lagom.plot import timeline  # noqa: E402
from lagom.progress import describe  # noqa: E402
from lagom.report import print_table  # noqa: E402
from lagom.resources import PUBLISHED_FILE  # noqa: E402
from lagom.search import (  # noqa: E402
    Problem,
    exhaustive,  # noqa: E402
    run_strategy,
)
from lagom.search.exhaustive import MAX_EVALUATIONS  # noqa: E402
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from lagom.step.workload import Workload, load_workload  # noqa: E402
from lagom.tune import Progress as PlanningStatus  # noqa: E402
from lagom.tune import ProgressCallback, Tuned, compare_strategies, problem_for  # noqa: E402

COMPARED = ("autoccl", "lagom")  # the strategies with published speedups
TOLERANCE = 0.05  # rows further than this from the published figure get a line on why
# --quick: the user's three runs, and one paper workload per A40 cluster (the paper's headline FSDP
# example on NVLink, an expert-parallel one on PCIe), without exhaustive search.
QUICK = (("gpt2-tp8", "a100-8x-100g"), ("bert-pp4", "v100-4x-25g"), ("t5-dp-tp", "a100-2x8-100g"),
         ("phi2-fsdp", "a40-2x8-nvlink"), ("olmoe-1b-7b-ep8", "a40-2x8-pcie"))
SEARCH_COST_KEYS = (2, 4, 8, 16, 32, 64)
SEARCH_COST_HARDWARE = "a40-2x8-nvlink"

Figure = float | tuple[float, float] | None  # a published speedup: a value, a [low, high] range, or none


# ---------------------------------------------------------------------------------------------
# Published figures


@dataclass
class Setting:
    """One published figure set: which runs it covers, the speedups, and where they come from."""

    id: str
    label: str
    workloads: list[str]
    hardware: list[str]
    speedup: dict[str, Figure]
    source: str
    short: str  # the source's tag in the terminal table
    setup: str  # what the published run had, as far as the source says


@dataclass
class Published:
    settings: list[Setting]
    lagom_over_autoccl: tuple[float, float]
    lagom_over_autoccl_source: str
    lagom_over_autoccl_short: str
    search_cost: dict[str, Any]  # keys, lagom, autoccl (evaluations), source


def _figure(value: Any, where: str) -> Figure:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list) and len(value) == 2 and value[0] <= value[1]:
        return (float(value[0]), float(value[1]))
    raise ConfigError(where, f"'{value}' is not a number, a [low, high] range or null")


def load_published(path: str | Path = PUBLISHED_FILE) -> Published:
    """Read the published figures; a malformed entry is a ConfigError naming it."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, ValueError) as err:
        raise ConfigError("published", f"cannot read {path}: {err}") from None
    try:
        settings = []
        for i, s in enumerate(data["settings"]):
            where = f"published.settings[{i}]"
            speedup = {name: _figure(s["speedup"].get(name), f"{where}.speedup.{name}") for name in COMPARED}
            settings.append(Setting(s["id"], s["label"], list(s["workloads"]), list(s["hardware"]), speedup,
                                    s["source"], s["short"], s["setup"]))
        ratio = data["lagom_over_autoccl"]
        low, high = _figure(ratio["range"], "published.lagom_over_autoccl.range")  # type: ignore[misc]
        return Published(settings, (low, high), ratio["source"], ratio["short"], dict(data["search_cost"]))
    except (KeyError, TypeError) as err:
        raise ConfigError("published", f"{path}: missing or malformed entry ({err})",
                          "see the layout at the top of configs/published.yaml") from None


# ---------------------------------------------------------------------------------------------
# Running the comparison


@dataclass(frozen=True)
class Run:
    setting: str
    workload: str
    hardware: str


def runs_for(published: Published, quick: bool) -> list[Run]:
    """Every (workload, hardware) a setting covers; with ``quick`` only the QUICK subset."""
    runs = [Run(s.id, w, h) for s in published.settings for w in s.workloads for h in s.hardware]
    if quick:
        runs = [r for r in runs if (r.workload, r.hardware) in QUICK]
    return runs


@dataclass
class Outcome:
    """What the simulator says about one run under each strategy (picklable: crosses processes)."""

    run: Run
    contention: str  # the profile's contention source: 'estimate' or 'measured'
    keys: int  # tuning keys (distinct collective x communicator x size)
    step_s: dict[str, float]
    evaluations: dict[str, int]
    configs: dict[str, dict[str, CommConfig]]
    tuned: dict[str, Workload]  # per strategy, the workload with the bucket sizes it chose
    compute_s: float  # uncontended compute on the busiest device (NCCL step)
    exposed_s: float  # exposed communication in the NCCL step
    bound_s: float  # no setting's step is shorter: the critical path, compute alone and comm at link peak
    devices: int  # devices simulated (pipeline stages)
    lagom_exposed: dict[str, float]  # exposed seconds per tuning key left after lagom, largest first
    exhaustive_note: str = ""  # why exhaustive did not run
    wall_s: float = 0.0

    def speedup(self, strategy: str) -> float | None:
        step = self.step_s.get(strategy)
        return self.step_s["nccl"] / step if step else None


def simulate_run(run: Run, exhaustive_limit: int, progress: ProgressCallback | None = None) -> Outcome:
    """nccl, autoccl and lagom on one run; exhaustive too when it needs at most ``exhaustive_limit`` steps.

    The limit keeps `--quick` short: a joint brute force of a few hundred settings already takes minutes
    on a step of thousands of kernels.
    """
    start = time.perf_counter()
    wl, hw = load_workload(run.workload), load_hardware(run.hardware)
    found = {name: t for name, t in compare_strategies(wl, hw, exhaustive_limit, progress).items() if t is not None}
    step = {name: t.result.result.step_s for name, t in found.items()}
    evals = {name: t.result.evaluations for name, t in found.items()}
    configs = {name: {k: t.result.configs[k] for k in t.problem.keys} for name, t in found.items()}  # step order
    tuned = {name: t.workload for name, t in found.items()}
    base = found["nccl"].result.result
    left = found["lagom"].result.result.per_key()
    exposed = sorted(((k, v["exposed"]) for k, v in left.items() if v["exposed"] > 0), key=lambda kv: -kv[1])
    problem = found["nccl"].problem
    note = "" if "exhaustive" in found else (
        f"not run: {exhaustive.size(problem):.3g} joint settings over {len(problem.keys)} keys (limit {exhaustive_limit})")
    return Outcome(run, hw.contention.source, len(problem.keys), step, evals, configs, tuned, base.compute_s,
                   base.exposed_comm_s, bound(found.values()), problem.graph.devices, dict(exposed),
                   note, time.perf_counter() - start)


def bound(found: Iterable[Tuned]) -> float:
    """The shortest step any setting could give on the step graphs the strategies searched (the bucket sizes
    they ended with): each graph's critical path with compute alone and comm at link peak (lagom.model.bound)."""
    problems = {id(t.problem): t.problem for t in found}.values()
    return min(step_bound(p.graph, p.model, decompose=bool(p.space.splits)) for p in problems)


def simulate_all(runs: list[Run], exhaustive_limit: int, jobs: int, console: Console) -> list[Outcome]:
    """Every run, ``jobs`` at a time, with a progress bar; results in the order of ``runs``."""
    done: dict[Run, Outcome] = {}
    columns = (TextColumn("[bold]reproduce[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=len(runs))
        if jobs <= 1:
            for r in runs:
                progress.update(task, description=f"{r.workload} on {r.hardware}")

                def line(p: PlanningStatus, r: Run = r) -> None:  # the planning progress line, as tune's
                    progress.update(task, description=describe(f"{r.workload} on {r.hardware}", p))

                done[r] = simulate_run(r, exhaustive_limit, line)
                progress.advance(task)
                progress.console.print(f"  {r.workload} on {r.hardware}: {done[r].wall_s:.0f} s")
        else:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(simulate_run, r, exhaustive_limit): r for r in runs}
                progress.update(task, description=f"{jobs} runs at a time")
                for fut in as_completed(futures):
                    r = futures[fut]
                    done[r] = fut.result()
                    progress.advance(task)
                    progress.console.print(f"  {r.workload} on {r.hardware}: {done[r].wall_s:.0f} s")
    return [done[r] for r in runs]


# ---------------------------------------------------------------------------------------------
# The table: a pure function from outcomes and published figures to rows


@dataclass
class Row:
    setting: str
    label: str
    workload: str
    hardware: str
    ours_source: str  # e.g. "simulated on a40-2x8-nvlink, contention: estimate"
    ours_short: str  # e.g. "sim (estimate)"
    published_source: str
    published_short: str
    ours: dict[str, float | None]  # autoccl, lagom, exhaustive: speedup over nccl
    published: dict[str, Figure]  # autoccl, lagom
    diff: dict[str, float | None]  # ours - published (0 inside a published range)
    evaluations: dict[str, int]
    why: str = ""  # set where a figure is more than TOLERANCE away


COLUMNS = ("workload", "hardware", "ours: source", "AutoCCL ours", "AutoCCL published", "AutoCCL diff",
           "Lagom ours", "Lagom published", "Lagom diff", "exhaustive ours", "evaluations a/l/e", "published: source")


def gap(ours: float | None, published: Figure) -> float | None:
    """ours - published; for a range, the distance outside it (0 inside)."""
    if ours is None or published is None:
        return None
    if isinstance(published, tuple):
        low, high = published
        return ours - low if ours < low else ours - high if ours > high else 0.0
    return ours - published


def fmt_figure(value: Figure) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]:.2f}x" if value[0] == value[1] else f"{value[0]:.2f}-{value[1]:.2f}x"
    return f"{value:.2f}x"


def fmt_signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"


def explain(outcome: Outcome, setting: Setting, diff: dict[str, float | None]) -> str:
    """One line: where the model's NCCL step goes, what that leaves to gain, and what the published run had."""
    nccl = outcome.step_s["nccl"]
    headroom = nccl / outcome.bound_s
    if outcome.devices == 1:
        rest = max(0.0, nccl - outcome.compute_s - outcome.exposed_s)
        split = (f"compute alone {_ms(outcome.compute_s)} + exposed comm {_ms(outcome.exposed_s)} + "
                 f"contention slowdown {_ms(rest)}")
    else:
        split = (f"compute alone {_ms(outcome.compute_s)} on the busiest of {outcome.devices} stages, exposed comm "
                 f"{_ms(outcome.exposed_s)} summed over stages, the rest pipeline bubbles and contention")
    parts = [f"model: NCCL step {_ms(nccl)} ({split}); the critical path with compute alone and comm at link peak "
             f"is {_ms(outcome.bound_s)}, so no setting beats {headroom:.2f}x"]
    lagom, pub = diff.get("lagom"), setting.speedup.get("lagom")
    if lagom is not None and lagom < -TOLERANCE and pub is not None:
        need = pub[0] if isinstance(pub, tuple) else pub
        if need > headroom:
            parts.append(f"the published {fmt_figure(pub)} needs {1 - 1 / need:.0%} of the step recovered, the model "
                         f"has {1 - 1 / headroom:.0%} to recover")
        else:
            ex = outcome.speedup("exhaustive")
            parts.append("the headroom is there but lagom's configs recover less"
                         + (f" (exhaustive reaches {ex:.2f}x)" if ex else ""))
        key, sec = next(iter(outcome.lagom_exposed.items()), ("", 0.0))
        if sec > 0.05 * nccl:
            parts.append(f"still exposed after lagom: {key.rsplit('/', 1)[0]} {_ms(sec)} (the compute after it "
                         f"waits for it)")
    if lagom is not None and lagom > TOLERANCE:
        parts.append("the model gains more than was published")
    autoccl, mine = diff.get("autoccl"), outcome.speedup("autoccl")
    if autoccl is not None and mine is not None and abs(autoccl) > TOLERANCE:
        parts.append(f"AutoCCL's configs (each collective's fastest under interference) give {mine:.2f}x")
    if outcome.contention != "measured":
        parts.append("contention constants are datasheet estimates, not measured on this GPU")
    parts.append(f"published: {setting.setup}")
    return "; ".join(parts)


def table_rows(outcomes: Iterable[Outcome], published: Published) -> list[Row]:
    """One row per outcome beside its setting's published figures; ``why`` where they part by > TOLERANCE."""
    settings = {s.id: s for s in published.settings}
    rows = []
    for o in outcomes:
        s = settings[o.run.setting]
        ours = {name: o.speedup(name) for name in (*COMPARED, "exhaustive")}
        diff = {name: gap(ours[name], s.speedup[name]) for name in COMPARED}
        row = Row(s.id, s.label, o.run.workload, o.run.hardware,
                  f"simulated on {o.run.hardware}, contention: {o.contention}", f"sim ({o.contention})",
                  s.source, s.short, ours, dict(s.speedup), diff, dict(o.evaluations))
        if any(d is not None and abs(d) > TOLERANCE for d in diff.values()):
            row.why = explain(o, s, diff)
        rows.append(row)
    return rows


def row_cells(row: Row, short: bool = False) -> list[str]:
    """The row in COLUMNS order, as text (shared by the terminal table and the Markdown report)."""
    ev = row.evaluations
    evals = f"{ev.get('autoccl', '-')}/{ev.get('lagom', '-')}/{ev.get('exhaustive', '-')}"
    return [row.workload, row.hardware, row.ours_short if short else row.ours_source,
            fmt_figure(row.ours["autoccl"]), fmt_figure(row.published["autoccl"]), fmt_signed(row.diff["autoccl"]),
            fmt_figure(row.ours["lagom"]), fmt_figure(row.published["lagom"]), fmt_signed(row.diff["lagom"]),
            fmt_figure(row.ours["exhaustive"]), evals, row.published_short if short else row.published_source]


def rich_table(rows: list[Row]) -> Table:
    table = Table(title="Speedup over NCCL: ours (simulated) vs published")
    for col in COLUMNS:
        table.add_column(col.replace("published", "pub.").replace("evaluations", "evals"),
                         justify="left" if col in ("workload", "hardware") or "source" in col else "right")
    for row in rows:
        cells = row_cells(row, short=True)
        for i, col in enumerate(COLUMNS):
            if col.endswith("diff") and cells[i] != "-" and abs(float(cells[i])) > TOLERANCE:
                cells[i] = f"[yellow]{cells[i]}[/]"
        table.add_row(*cells)
    return table


def setting_summary(rows: list[Row], published: Published) -> list[list[str]]:
    """Per setting: the range of our Lagom speedups against the published one; then Lagom over AutoCCL."""
    out = []
    for s in published.settings:
        mine = [r.ours["lagom"] for r in rows if r.setting == s.id and r.ours["lagom"] is not None]
        if mine:
            out.append([s.label, f"{fmt_figure((min(mine), max(mine)))} ({len(mine)} runs)",
                        fmt_figure(s.speedup["lagom"]), s.source])
    paper = {s.id for s in published.settings if s.speedup["autoccl"] is None}
    ratios = [r.ours["lagom"] / r.ours["autoccl"] for r in rows
              if r.setting in paper and r.ours["lagom"] and r.ours["autoccl"]]
    if ratios:
        out.append(["Lagom over AutoCCL, paper workloads", f"{fmt_figure((min(ratios), max(ratios)))} ({len(ratios)} runs)",
                    fmt_figure(published.lagom_over_autoccl), published.lagom_over_autoccl_source])
    return out


# ---------------------------------------------------------------------------------------------
# Search cost: evaluations against the number of tuning keys


@dataclass
class SearchCost:
    keys: int
    evaluations: dict[str, int]  # autoccl, lagom (run); exhaustive (counted, not run)


def synthetic_problem(n: int, hardware: str = SEARCH_COST_HARDWARE) -> Problem:
    """A step with ``n`` tuning keys: FSDP-like gathers and reduce-scatters of ``n`` distinct sizes over dp=16,
    each released by one GEMM and needed two GEMMs later, so every key has a window to hide in."""
    hw = load_hardware(hardware)
    dp = Group("dp", hw.cluster.world_size, hw.cluster.gpus_per_node, hw.cluster.nodes)
    rows, inner = 8192, 4096
    segments = [ComputeSegment(f"gemm{i}", 2.0 * rows * inner * inner, 2.0 * (2 * rows * inner + inner * inner),
                               (rows // 128) * (inner // 128)) for i in range(n + 2)]
    points = [OverlapPoint(f"p{i}", Collective.ALL_GATHER if i % 2 == 0 else Collective.REDUCE_SCATTER, dp,
                           (16 + i) * 2**20, after=f"gemm{i}", before=f"gemm{i + 2}", phase="synthetic")
              for i in range(n)]
    graph = StepGraph(f"synthetic-{n}", hw.name, 1, [Phase("synthetic", 1, {0: segments}, points)], {"dp": dp})
    return Problem(graph, hw)


def search_cost(sizes: Iterable[int] = SEARCH_COST_KEYS) -> list[SearchCost]:
    out = []
    for n in sizes:
        problem = synthetic_problem(n)
        evals = {name: run_strategy(name, problem).evaluations for name in COMPARED}
        evals["exhaustive"] = exhaustive.size(problem)
        out.append(SearchCost(n, evals))
    return out


# ---------------------------------------------------------------------------------------------
# Plots


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedups(rows: list[Row], path: Path) -> Path:
    """Grouped bars per run and strategy; published figures as black marks (a range as an error bar)."""
    strategies = [s for s in (*COMPARED, "exhaustive") if any(r.ours[s] for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.2))
    width = 0.8 / len(strategies)
    for j, name in enumerate(strategies):
        xs = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r.ours[name] or 0.0 for r in rows], width, label=f"{name} (simulated)")
        for x, r in zip(xs, rows):
            pub = r.published.get(name)
            if isinstance(pub, tuple):
                ax.errorbar(x, sum(pub) / 2, yerr=(pub[1] - pub[0]) / 2, color="black", capsize=3, lw=1.2)
            elif pub is not None:
                ax.plot(x, pub, marker="_", color="black", markersize=14, mew=2)
    ax.errorbar([], [], yerr=[], color="black", capsize=3, label="published (a value, or a range)")
    ax.axhline(1.0, color="grey", lw=0.8)
    low = min([r.ours[n] for r in rows for n in strategies if r.ours[n]] + [1.0])
    ax.set_ylim(min(0.9, low - 0.05), None)
    ax.set_xticks(range(len(rows)), [f"{r.workload}\n{r.hardware}" for r in rows], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speedup over NCCL")
    ax.set_title("Speedup over NCCL per run: simulated (bars) vs published (black)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_timeline(outcome: Outcome, path: Path) -> Path:
    """The step of one run as each strategy leaves it (lagom.plot.timeline draws the busiest phase)."""
    hw = load_hardware(outcome.run.hardware)
    model = CostModel(hw)
    results = {}
    for name, configs in outcome.configs.items():
        graph = problem_for(outcome.tuned[name], hw).graph
        results[name] = simulate(graph, configs, model, keep_spans=True)
    return timeline(results, path, f"{outcome.run.workload} on {outcome.run.hardware} (simulated)")


def _short_key(key: str) -> str:
    group, coll, nbytes = key.split("/")
    return f"{group}/{coll}\n{int(nbytes) / 2**20:.1f} MiB"


def matching_config(configs: dict[str, CommConfig], key: str) -> CommConfig:
    """The config a strategy chose for ``key``; where its bucket search resized gradient buckets, the config of
    the same communicator and collective with the nearest size (as Plan.lookup does at run time)."""
    if key in configs:
        return configs[key]
    group, coll, nbytes = key.split("/")
    same = [k for k in configs if k.split("/")[:2] == [group, coll]]
    return configs[min(same, key=lambda k: abs(int(k.split("/")[2]) - int(nbytes)))]


def plot_choices(outcomes: list[Outcome], path: Path) -> Path:
    """Channels and chunk size each strategy chose per tuning key (P2P decompositions marked 'p2p')."""
    fig, axes = plt.subplots(len(outcomes), 2, figsize=(13, 2.6 * len(outcomes) + 0.6), squeeze=False)
    for (ax_nc, ax_c), o in zip(axes, outcomes):
        names = list(o.configs)
        keys = list(o.configs["nccl"])
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            cfgs = [matching_config(o.configs[name], k) for k in keys]
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cfgs))]
            ax_nc.bar(xs, [c.channels for c in cfgs], width, label=name)
            chunks = [c.chunk_bytes / 1024 if c.decomposition == "collective" else 0.0 for c in cfgs]
            ax_c.bar(xs, chunks, width, label=name)
            for x, c in zip(xs, cfgs):
                if c.decomposition == "p2p":
                    for ax in (ax_nc, ax_c):
                        ax.text(x, 1, f"p2p x{c.num_chunks}", rotation=90, fontsize=6, ha="center", va="bottom")
        for ax, label, bottom in ((ax_nc, "channels", 0.5), (ax_c, "chunk (KiB)", 32)):
            ax.set_xticks(range(len(keys)), [_short_key(k) for k in keys], fontsize=6)
            ax.set_ylabel(label, fontsize=8)
            ax.set_yscale("log", base=2)
            ax.set_ylim(bottom, None)
        ax_nc.set_title(f"{o.run.workload} on {o.run.hardware}", fontsize=9, loc="left")
        ax_nc.legend(fontsize=6, ncol=len(names))
    return _save(fig, path)


def plot_search_cost(costs: list[SearchCost], published: Published, path: Path) -> Path:
    """Left: evaluations the searches ran, with the published pair; right: the same beside exhaustive's r^N."""
    fig, (ax, ax_all) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = [c.keys for c in costs]
    pc = published.search_cost
    for axis in (ax, ax_all):
        for name, style in (("autoccl", "o-"), ("lagom", "s-")):
            axis.plot(ns, [c.evaluations[name] for c in costs], style, label=f"{name} (simulated)")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tuning keys (collectives) in the step")
    for name, marker in (("autoccl", "o"), ("lagom", "s")):
        ax.plot(pc["keys"], pc[name], marker, color="black", mfc="none", markersize=10,
                label=f"{name}, published ({pc['keys']} collectives)")
    ax_all.plot(ns, [c.evaluations["exhaustive"] for c in costs], "k--", label="exhaustive: r^N (counted, not run)")
    ax_all.set_yscale("log")
    ax.set_ylabel("evaluations (steps simulated or measured)")
    ax.set_title("Searches on synthetic FSDP-like steps (a40-2x8-nvlink)", fontsize=10)
    ax_all.set_title("Against exhaustive search", fontsize=10)
    ax.legend(fontsize=7)
    ax_all.legend(fontsize=7)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Report


def _md_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines


def markdown(rows: list[Row], outcomes: list[Outcome], published: Published, costs: list[SearchCost],
             plots: dict[str, Path], wall_s: float, quick: bool, real: str = "") -> str:
    contention = sorted({o.contention for o in outcomes})
    lines = ["# Lagom reproduction", "",
             f"{'Quick' if quick else 'Full'} run: {len(outcomes)} configurations in {wall_s:.0f} s. "
             "Our figures are **simulated** on hardware profiles (cost model + step simulator, no GPU), with "
             f"contention constants from: {', '.join(contention)} (`estimate` = datasheets and public reports, "
             "`measured` = benchmarks/gpu_contention.py on the GPU). Published figures are measurements on real "
             "clusters, each with its source. Speedup = NCCL step time / strategy step time.", "",
             "## Speedup over NCCL", ""]
    lines += _md_table(COLUMNS, (row_cells(r) for r in rows))
    lines += ["", "Evaluations a/l/e: steps simulated by autoccl / lagom / exhaustive; exhaustive '-' where not run:"]
    lines += [f"- {o.run.workload} on {o.run.hardware}: {o.exhaustive_note}" for o in outcomes if o.exhaustive_note]
    lines += ["", f"## Where ours and the published figures differ by more than {TOLERANCE}x", ""]
    why = [r for r in rows if r.why]
    lines += [f"- **{r.workload} on {r.hardware}**: {r.why}" for r in why] or ["- none"]
    lines += ["", "## Per setting", ""]
    lines += _md_table(("setting", "Lagom ours", "Lagom published", "published: source"), setting_summary(rows, published))
    pc = published.search_cost
    lines += ["", "## Search cost", "",
              f"Evaluations (steps) each strategy needs on synthetic FSDP-like steps with N tuning keys; exhaustive is "
              f"r^N counted, not run. Published ({pc['source']}): {pc['keys']} collectives took ~{pc['lagom']} "
              f"iterations with Lagom and ~{pc['autoccl']} with AutoCCL.", ""]
    lines += _md_table(("keys", "autoccl", "lagom", "exhaustive"),
                       ([str(c.keys), str(c.evaluations["autoccl"]), str(c.evaluations["lagom"]),
                         f"{c.evaluations['exhaustive']:.3g}"] for c in costs))
    two = [o for o in outcomes if o.keys == pc["keys"]]
    if two:
        lines += ["", f"Runs above with {pc['keys']} tuning keys: "
                  + "; ".join(f"{o.run.workload} on {o.run.hardware}: autoccl {o.evaluations['autoccl']}, "
                              f"lagom {o.evaluations['lagom']}" for o in two)
                  + " (lagom's count includes its three bucket sizes where the step has gradient buckets)."]
    lines += ["", "## Plots", ""] + [f"- {what}: ![{what}]({p.name})" for what, p in plots.items()]
    if real:
        lines += ["", real]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="lagom-reproduce", help="directory for report.md and the plots")
    parser.add_argument("--quick", action="store_true",
                        help="the user's three runs and one paper workload per A40 cluster, no exhaustive search")
    parser.add_argument("--real", action="store_true",
                        help="also train small GPT/BERT/T5 models through DeepSpeed (and megatron-core) with Lagom "
                             "on 2 gloo CPU ranks and check their losses against runs without it")
    parser.add_argument("--exhaustive-limit", type=int, default=MAX_EVALUATIONS,
                        help="run exhaustive search where it needs at most this many steps (ignored with --quick)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs simulated in parallel")
    parser.add_argument("--only", nargs="+", metavar="WORKLOAD", help="restrict to these workloads")


def run(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:  # logs and pipes: keep the table's columns on one line
        console = Console(width=max(console.width, 200))
    start = time.perf_counter()
    published = load_published()
    runs = runs_for(published, args.quick)
    if args.only:
        unknown = set(args.only) - {r.workload for r in runs}
        if unknown:
            raise ConfigError("--only", f"no {'quick ' if args.quick else ''}run of {', '.join(sorted(unknown))}",
                              f"use workloads from {', '.join(sorted({r.workload for r in runs}))}")
        runs = [r for r in runs if r.workload in args.only]
    out = output_folder(args.out, "--out")  # checked before minutes of simulation, not after
    out.mkdir(exist_ok=True)
    limit = 0 if args.quick else args.exhaustive_limit
    outcomes = simulate_all(runs, limit, args.jobs, console)
    rows = table_rows(outcomes, published)
    print_table(rich_table(rows), console)
    for r in rows:
        if r.why:
            console.print(f"[yellow]{r.workload} on {r.hardware}[/]: {r.why}")
    costs = search_cost()
    featured = next((o for o in outcomes if o.run.setting == "fsdp"), outcomes[0])
    plots = {
        "speedup per run and strategy": plot_speedups(rows, out / "speedup.png"),
        f"step timeline of {featured.run.workload} on {featured.run.hardware} per strategy":
            plot_timeline(featured, out / "timeline.png"),
        "channels and chunk chosen per tuning key": plot_choices(outcomes, out / "choices.png"),
        "search cost against the number of tuning keys": plot_search_cost(costs, published, out / "search_cost.png"),
    }
    real = ""
    if args.real:
        from lagom_experiments.real import real_runs

        real = real_runs(out, console)
    wall = time.perf_counter() - start
    (out / "report.md").write_text(markdown(rows, outcomes, published, costs, plots, wall, args.quick, real))
    console.print(f"report: {out / 'report.md'} ({wall:.0f} s); plots: {', '.join(p.name for p in plots.values())}")
    return 0
