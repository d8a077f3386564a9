"""How planning scales with micro-batches, layers and world size: one simulated step, a full `lagom tune`, memory.

    python benchmarks/planning_scale.py                       # targets, then the whole grid (long)
    python benchmarks/planning_scale.py --targets             # only the issue's target jobs
    python benchmarks/planning_scale.py --grid --micro-batches 4 16 64 --layers 24 --world 8 64 --no-tune
    python benchmarks/planning_scale.py --quality 700          # search quality: lagom against exhaustive
    python benchmarks/planning_scale.py --compare              # `lagom compare` on every shipped workload
    python benchmarks/planning_scale.py --grid --layers 24 80 --world 8 64 --plot scale.png   # and a figure

Grid: a GPT-3-13B-shaped model (hidden 5120, 40 heads, ffn 20480, seq 2048) with 24, 80 or 128 layers,
micro-batch 1 and 4 ... 1024 micro-batches per step, on H100 nodes of 8 (h100-sxm-8x-400g with as many
nodes as the world needs), laid out as Megatron would:
    8 GPUs: TP2+SP x PP4 x DP1      64: TP4+SP x PP4 x DP4
    1024:   TP8+SP x PP8 x DP16     8192: TP8+SP x PP8 x DP128
with the distributed optimizer and overlapped gradient reduce and parameter gather.
Targets: configs/workloads/gpt3-13b-pp4.yaml at 4, 8, 16 and 128 micro-batches and
configs/workloads/llama3-70b-1024.yaml (256 micro-batches); then `lagom compare` on the 2,048-GPU
configs/workloads/llama3-405b-2048.yaml.
The simulator runs on its compiled event loop where it is built; LAGOM_SIMULATOR=python times the Python loop.

Each cell runs in a fresh process (one core) and reports CPU seconds of that process (time.process_time:
steady on a shared machine, and the same as wall time on an idle core, since planning is single-threaded):
  graph   building the step graph (lagom.tune.problem_for)
  step    one SimulatedEvaluator.evaluate of NCCL's configs on a fresh evaluator (cold: includes preparing
          the step graph for simulation), then of NCCL's configs with the first key's channels halved on
          the same evaluator (warm: a whole new step, the graph already prepared, nothing to reuse)
  tune    lagom.tune.make_plan(strategy lagom, bucket search on): what `lagom tune` computes
  rss     the process's peak resident memory (ru_maxrss) after all of the above, in MB
A cell that runs past --timeout seconds prints '>T'; one whose step graph Lagom refuses to build (more than
lagom.step.workload's limit of segments and collectives) prints why. After the table: per (layers, world), the ratio of
the time at 1,024 micro-batches to the time at 16 (linear growth would be 64). ``--plot FILE`` draws the
grid's times (tune where measured, else the cold step) against micro-batches, layers and world size on
log-log axes, each line beside a dashed line of slope one through its first cell: a line no steeper than its
dashed one grows at most linearly.

``--compare [NAME ...]``: `lagom compare` (lagom.tune.compare_strategies) on each shipped workload (default: all
of configs/workloads/), one fresh process each: CPU seconds until nccl, autoccl and lagom are done (the
issue's target), the whole call with the exhaustive reference where it is feasible, the process's peak
resident memory, and each strategy's speedup over nccl and evaluations.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MICRO_BATCHES = (4, 16, 64, 256, 1024)
LAYERS = (24, 80, 128)
WORLDS = (8, 64, 1024, 8192)
LAYOUTS = {8: (2, 4, 1), 64: (4, 4, 4), 1024: (8, 8, 16), 8192: (8, 8, 128)}  # world -> (tp, pp, dp)
TARGETS = [("gpt3-13b-pp4", m) for m in (4, 8, 16, 128)] + [("llama3-70b-1024", 256)]
COMPARE_TARGETS = ["llama3-405b-2048"]  # `lagom compare` within 60 s (--targets runs it after the table)


def grid_job(layers: int, world: int, micro_batches: int):
    from lagom.hardware import load_hardware
    from lagom.step.workload import Framework, Model, Parallel, Training, Workload

    tp, pp, dp = LAYOUTS[world]
    wl = Workload(
        name=f"gpt-13b-shape-L{layers}-w{world}-m{micro_batches}",
        model=Model(architecture="gpt", layers=layers, hidden=5120, ffn=20480, heads=40, seq_len=2048, vocab=51200),
        training=Training(micro_batch=1, global_batch=micro_batches * dp),
        parallel=Parallel(dp=dp, tp=tp, pp=pp, sequence_parallel=True, distributed_optimizer=True),
        framework=Framework(name="megatron", overlap_grad_reduce=True, overlap_param_gather=True))
    hw = load_hardware("h100-sxm-8x-400g")
    hw = replace(hw, name=f"h100-sxm-{world // 8}x8-400g", cluster=replace(hw.cluster, nodes=world // 8))
    return wl, hw


def target_job(name: str, micro_batches: int):
    from lagom.hardware import load_hardware
    from lagom.step.workload import load_workload

    wl = load_workload(name)
    wl = wl.with_microbatches(micro_batches)
    return wl, load_hardware(wl.hardware)


def compare_cell(name: str) -> dict:
    """Runs in the child process: `lagom compare` on a shipped workload, the three strategies timed apart from
    the exhaustive reference (the time of its first evaluation)."""
    from lagom.hardware import load_hardware
    from lagom.step.workload import load_workload
    from lagom.tune import Progress, compare_strategies

    wl = load_workload(name)
    hw = load_hardware(wl.hardware)
    start = time.process_time()
    three: list[float] = []

    def heard(p: Progress) -> None:
        if p.strategy == "exhaustive" and not three:
            three.append(time.process_time() - start)

    tuned = compare_strategies(wl, hw, progress=heard)
    total = time.process_time() - start
    evaluations = {s: (t.result.evaluations if t else None) for s, t in tuned.items()}
    steps = {s: t.result.result.step_s for s, t in tuned.items() if t}
    return {"three": three[0] if three else total, "total": total, "evaluations": evaluations,
            "speedup": {s: steps["nccl"] / step for s, step in steps.items() if s != "nccl"},
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def compare_all(names: list[str], timeout: float) -> None:
    print(f"{'workload':<24} {'3 strategies s':>14} {'with exhaustive s':>17} {'rss MB':>7}  speedup over nccl; evaluations",
          flush=True)
    for name in names:
        res = measure({"compare": name}, timeout)
        if res is None:
            print(f"{name:<24} {'>' + format(timeout, '.0f'):>14}", flush=True)
            continue
        ev = ", ".join(f"{s} {n if n is not None else 'too large'}" for s, n in res["evaluations"].items())
        speedup = ", ".join(f"{s} {x:.4f}x" for s, x in res["speedup"].items())
        print(f"{name:<24} {_fmt(res['three'], timeout):>14} {_fmt(res['total'], timeout):>17} {res['rss_mb']:>7.0f}  {speedup}; {ev}",
              flush=True)


def run_cell(spec: dict) -> dict:
    """Runs in the child process: time the graph, two evaluations and (unless told not to) a tune."""
    if "compare" in spec:
        return compare_cell(spec["compare"])
    from lagom.search.base import SimulatedEvaluator, nccl_configs
    from lagom.tune import make_plan, problem_for

    wl, hw = target_job(spec["name"], spec["m"]) if "name" in spec else grid_job(spec["layers"], spec["world"], spec["m"])
    out: dict = {}
    t = time.process_time()
    problem = problem_for(wl, hw)
    out["graph"] = time.process_time() - t
    configs = nccl_configs(problem)
    evaluator = SimulatedEvaluator(problem)
    t = time.process_time()
    out["step_s"] = evaluator.evaluate(configs).step_s
    out["cold"] = time.process_time() - t
    first = next(iter(configs))
    other = {**configs, first: replace(configs[first], channels=max(1, configs[first].channels // 2))}
    t = time.process_time()
    evaluator.evaluate(other)
    out["warm"] = time.process_time() - t
    del problem, evaluator
    if spec.get("tune", True):
        t = time.process_time()
        plan = make_plan(wl, hw, "lagom")
        out["tune"] = time.process_time() - t
        out["evaluations"] = plan.evaluations
        out["speedup"] = plan.predicted_step_s["nccl"] / plan.predicted_step_s["lagom"]
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure(spec: dict, timeout: float) -> dict | None:
    """One cell in a fresh interpreter; None when it ran past the timeout."""
    try:
        done = subprocess.run([sys.executable, __file__, "--cell", json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as err:
        last = err.stderr.strip().splitlines()[-1] if err.stderr.strip() else f"exit {err.returncode}"
        if "ConfigError" not in last:
            raise SystemExit(f"cell {spec} failed:\n{err.stderr}") from None
        return {"refused": last.split(": ", 1)[-1]}  # e.g. a step graph larger than Lagom builds
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(value: float | None, timeout: float) -> str:
    if value is None:
        return f">{timeout:.0f}"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


HEADER = f"{'job':<34} {'m':>5} {'graph s':>8} {'step s':>8} {'warm s':>8} {'tune s':>8} {'evals':>6} {'rss MB':>7}"


def row(label: str, m: int, res: dict | None, timeout: float) -> str:
    if res is None:
        return f"{label:<34} {m:>5} {'>' + format(timeout, '.0f'):>8}"
    if "refused" in res:
        return f"{label:<34} {m:>5}   refused: {res['refused'][:90]}"
    tune = _fmt(res.get("tune"), timeout) if "tune" in res else "-"
    return (f"{label:<34} {m:>5} {_fmt(res['graph'], timeout):>8} {_fmt(res['cold'], timeout):>8} "
            f"{_fmt(res['warm'], timeout):>8} {tune:>8} {res.get('evaluations', '-'):>6} {res['rss_mb']:>7.0f}")


def quality_problem(seed: int):
    """One problem of the 3-key loop: three collectives on three communicators, the first two released
    together and needed by the same segment (the shape of tests/test_search.py's
    three_keys_beside_shared_compute), channels 2, 8 or 32: small enough for exhaustive search."""
    import random

    from tests.helpers import THREE_CHANNELS, synthetic_problem

    rng = random.Random(seed)
    n = rng.randint(2, 4)
    segs = [(rng.uniform(0.05, 1.0), rng.uniform(1.0, 200.0), rng.choice([84, 300, 840, 4000])) for _ in range(n)]
    shared_after = rng.choice([None, 0])
    shared_before = rng.choice([None, *range(1 if shared_after == 0 else 0, n)])
    third_after = rng.choice([None, *range(n - 1)])
    lo = 0 if third_after is None else third_after + 1
    wins = [(shared_after, shared_before)] * 2 + [(third_after, rng.choice([None, *range(lo, n)]))]
    points = []
    for j, (after, before) in enumerate(wins):
        nodes = rng.choice([1, 2])
        points.append({"collective": rng.choice(["all_gather", "reduce_scatter", "all_reduce"]),
                       "mb": rng.uniform(20.0, 300.0), "after": after, "before": before, "nodes": nodes,
                       "size": 8 * nodes, "group": f"g{j}"})
    return synthetic_problem(segs, points, space=THREE_CHANNELS)


def quality(count: int) -> None:
    """Lagom against exhaustive search on ``count`` seeded problems of the 3-key loop."""
    from lagom.search import run_strategy

    ratios, evaluations, worse = [], [], 0
    for seed in range(count):
        problem = quality_problem(seed)
        found = {name: run_strategy(name, problem) for name in ("nccl", "lagom", "exhaustive")}
        ratios.append(found["lagom"].result.step_s / found["exhaustive"].result.step_s)
        evaluations.append(found["lagom"].evaluations)
        worse += found["lagom"].result.step_s > found["nccl"].result.step_s
    print(f"{count} problems: lagom at most {max(ratios):.4f} of exhaustive, {sum(r > 1.02 for r in ratios)} over 2%, "
          f"{sum(r > 1.01 for r in ratios)} over 1%, {worse} worse than nccl, "
          f"{sum(evaluations) / count:.1f} evaluations on average")


def plot(results: dict[tuple[int, int, int], dict | None], path: str) -> None:
    """Time against micro-batches, layers and world size, one panel each, with linear growth dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    what = "tune" if all(r is not None and "tune" in r for r in results.values() if r and "refused" not in r) else "cold"
    done = {cell: r[what] for cell, r in results.items() if r is not None and what in r}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, axis, label in zip(axes, range(3), ("layers", "world size (GPUs)", "micro-batches")):
        lines: dict[tuple, list[tuple[int, float]]] = {}
        for cell, seconds in done.items():
            rest = tuple(v for n, v in enumerate(cell) if n != axis)
            lines.setdefault(rest, []).append((cell[axis], seconds))
        for rest, pts in sorted(lines.items()):
            if len(pts) < 2:
                continue
            xs, ys = zip(*sorted(pts))
            name = ", ".join(f"{k}{v}" for k, v in zip([k for n, k in enumerate(("L", "w", "m")) if n != axis], rest))
            (line,) = ax.plot(xs, ys, "o-", label=name)
            ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", color=line.get_color(), alpha=0.5)
        ax.set(xscale="log", yscale="log", xlabel=label, ylabel=f"{what} CPU s")
        ax.set_xticks(sorted({cell[axis] for cell in done}), [str(x) for x in sorted({cell[axis] for cell in done})])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"planning time ({what}) against scale; dashed: linear growth from each line's first cell")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--targets", action="store_true", help="run the target jobs (default: targets and grid)")
    parser.add_argument("--grid", action="store_true", help="run the grid (default: targets and grid)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=list(MICRO_BATCHES))
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    parser.add_argument("--world", type=int, nargs="+", default=list(WORLDS), choices=list(WORLDS))
    parser.add_argument("--no-tune", action="store_true", help="time the step only, not `lagom tune`")
    parser.add_argument("--quality", type=int, metavar="N",
                        help="only the search-quality loop: lagom against exhaustive on N seeded 3-key problems (700)")
    parser.add_argument("--compare", nargs="*", metavar="NAME",
                        help="only `lagom compare` on these shipped workloads (none named: every one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    parser.add_argument("--plot", metavar="FILE", help="draw the grid's times against scale into FILE (png, svg, pdf)")
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))))
        return
    if args.quality:
        quality(args.quality)
        return
    if args.compare is not None:
        from lagom.step.workload import workload_names

        shipped = workload_names()
        unknown = sorted(set(args.compare) - set(shipped))
        if unknown:
            parser.error(f"--compare: no shipped workload {', '.join(unknown)}; use one of {', '.join(shipped)}")
        compare_all(args.compare or shipped, args.timeout)
        return
    both = not args.targets and not args.grid
    tune = not args.no_tune
    print(HEADER, flush=True)
    if args.targets or both:
        for name, m in TARGETS:
            print(row(name, m, measure({"name": name, "m": m, "tune": tune}, args.timeout), args.timeout), flush=True)
        print()
        compare_all(COMPARE_TARGETS, args.timeout)
    if not (args.grid or both):
        return
    results: dict[tuple[int, int, int], dict | None] = {}
    for world in args.world:
        for layers in args.layers:
            for m in args.micro_batches:
                res = measure({"layers": layers, "world": world, "m": m, "tune": tune}, args.timeout)
                results[(layers, world, m)] = res
                tp, pp, dp = LAYOUTS[world]
                print(row(f"L{layers} w{world} (tp{tp} pp{pp} dp{dp})", m, res, args.timeout), flush=True)
    print("\nratio of time at 1024 micro-batches to 16 (linear = 64):")
    for world in args.world:
        for layers in args.layers:
            lo, hi = results.get((layers, world, 16)), results.get((layers, world, 1024))
            if lo is None or hi is None or "refused" in lo or "refused" in hi:
                continue
            ratios = [f"{what} {hi[what] / lo[what]:.2f}" for what in ("cold", "warm", "tune") if what in lo and what in hi]
            print(f"  L{layers} w{world}: " + ", ".join(ratios))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
