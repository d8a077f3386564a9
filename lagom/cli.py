"""`lagom`: plan a job offline (tune, compare, simulate), calibrate a machine, patch Megatron, reproduce."""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from lagom import __version__
from lagom.errors import LagomError
from lagom.outputs import output_file, output_folder


def positive_float(text: str) -> float:
    """An argparse type: a number above zero (seconds, budgets)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _load(args: argparse.Namespace):
    """Workload and hardware from the flags (hardware defaults to the workload's own)."""
    from lagom.errors import ConfigError
    from lagom.hardware import load_hardware
    from lagom.step.workload import load_workload

    wl = load_workload(args.workload)
    name = args.hardware or wl.hardware
    if not name:
        raise ConfigError("--hardware", "the workload names no hardware", "pass --hardware NAME|FILE")
    return wl, load_hardware(name)


def _capability(args: argparse.Namespace, hw):
    """What the plan may set: the hardware's NCCL (or --nccl-version), this install's tuner plugin (unless
    --no-tuner-plugin), the hardware's topology."""
    from lagom.plan.capability import capability_for

    return capability_for(hw, args.nccl_version, False if args.no_tuner_plugin else None)


def cmd_tune(args: argparse.Namespace) -> int:
    from lagom.nccl_tuner import UNAVAILABLE
    from lagom.plan import emit
    from lagom.progress import PlanningProgress
    from lagom.report import plan_markdown, plan_table, print_table
    from lagom.search.driver import Budget
    from lagom.tune import make_plan

    plan_file = output_file(args.out, "--out") if args.out else None
    emit_dir = output_folder(args.emit, "--emit") if args.emit else None
    wl, hw = _load(args)
    capability = _capability(args, hw)
    budget = Budget(seconds=args.search_seconds)
    with PlanningProgress(f"tuning {wl.name}") as progress:
        plan = make_plan(wl, hw, args.strategy, progress=progress, capability=capability, budget=budget)
    if budget.cut:
        print(f"lagom: the search was {budget.cut} (--search-seconds): the plan holds the best settings found so "
              "far; a longer budget may find better", file=sys.stderr)
    if plan_file:
        plan.save(plan_file)
    if emit_dir:
        emit_dir.mkdir(exist_ok=True)
        (emit_dir / "nccl_comm_cfgs.yaml").write_text(emit.megatron_nccl_yaml(plan))
        (emit_dir / "nccl_tuner.csv").write_text(emit.tuner_csv(plan))
        (emit_dir / "nccl_tuner.lagom").write_text(emit.tuner_rules(plan))
        env = {**emit.nccl_env(plan, hw), **emit.tuner_env(plan, emit_dir / "nccl_tuner.lagom")}
        (emit_dir / "nccl.env").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        if emit.tuner_entries(plan) and emit.TUNER_PLUGIN_ENV not in env:
            print(f"lagom: {UNAVAILABLE}; nccl.env does not set NCCL_TUNER_PLUGIN", file=sys.stderr)
        (emit_dir / "buckets.json").write_text(json.dumps(plan.framework, indent=2) + "\n")
        (emit_dir / "te_ub_cfgs.yaml").write_text(emit.te_ub_yaml(plan))
        (emit_dir / "plan.md").write_text(plan_markdown(plan))
    if args.json:
        print(plan.to_json())
    else:
        print(f"capability: {capability.describe()}")
        print_table(plan_table(plan))
        for row in plan.registration:
            print(f"register symmetrically for the ZERO CTA policy: group {row['group']}, {', '.join(row['collectives'])} "
                  f"buffers up to {row['max_bytes']} bytes ({row['how']})")
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from lagom.progress import PlanningProgress
    from lagom.report import compare_json, compare_table, print_table
    from lagom.tune import compare_strategies

    wl, hw = _load(args)
    capability = _capability(args, hw)
    with PlanningProgress(f"comparing strategies on {wl.name}") as progress:
        tuned = compare_strategies(wl, hw, progress=progress, capability=capability)
    data = compare_json(wl.name, hw.name, {k: (t.result.result, t.result.evaluations) if t else None for k, t in tuned.items()})
    data["capability"] = {**capability.to_dict(), "description": capability.describe()}
    if args.json:
        print(json.dumps(data))
    else:
        print(f"capability: {capability.describe()}")
        print_table(compare_table(data, hw.contention.source))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from lagom.model.simulator import simulate
    from lagom.plot import timeline
    from lagom.tune import search_with_buckets

    plot_file = output_file(args.plot, "--plot") if args.plot else None
    wl, hw = _load(args)
    results = {}
    for name in args.strategy:
        tuned = search_with_buckets(wl, hw, name)
        results[name] = simulate(tuned.problem.graph, tuned.result.configs, tuned.problem.model, keep_spans=True)
        print(f"{name}: step {results[name].step_s * 1e3:.2f} ms, exposed comm {results[name].exposed_comm_s * 1e3:.2f} ms, "
              f"overlap efficiency {results[name].overlap_efficiency:.3f}")
    if plot_file:
        print(f"timeline written to {timeline(results, plot_file, f'{wl.name} on {hw.name}')}")
    return 0


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload YAML, or the name of a shipped one (lagom/configs/workloads/)")
    p.add_argument("--hardware", help="hardware preset name or YAML file (default: the workload's)")


def _capability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nccl-version", metavar="X.Y[.Z]",
                   help="plan for this NCCL (default: the hardware profile's nccl.version): it decides what can be set")
    p.add_argument("--no-tuner-plugin", action="store_true",
                   help="plan for a target without Lagom's NCCL tuner plugin (no per-size settings)")


class _Parser(argparse.ArgumentParser):
    """Bad flags end like every other bad input: one line on stderr and exit code 2 (argparse would print
    the usage first).

    A parser made with ``plugged=<module>`` is a subcommand whose flags live in that module (calibrate
    imports torch, reproduce matplotlib): the module is imported when the subcommand is parsed or its
    help shown, not to build the parser.
    """

    def __init__(self, *args: Any, plugged: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugged = plugged

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"lagom: error: {self.prog}: {message} (see '{self.prog} --help')\n")

    def _plug(self) -> None:
        if self.plugged and self.get_default("func") is None:
            module = importlib.import_module(self.plugged)
            module.add_arguments(self)
            self.set_defaults(func=module.run)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._plug()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._plug()
        return super().format_help()


# Subcommands whose code lives in their own modules: each module offers add_arguments(parser) and run(args).
_PLUGGED: list[tuple[str, str, str]] = [
    ("calibrate", "lagom.runtime.measure.calibrate", "measure this machine's collectives and write a hardware profile"),
    ("patch", "lagom_megatron.patching", "patch megatron/training to accept --lagom (or --revert it)"),
    ("validate", "lagom.validate", "the cost model against the published measurements in configs/fidelity"),
    ("reproduce", "lagom_experiments.reproduce", "reproduce the published GPT/BERT/T5 and A40 results: table, report, plots"),
]


def build_parser() -> argparse.ArgumentParser:
    from lagom.search import STRATEGIES

    parser = _Parser(prog="lagom", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lagom {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tune", help="choose a config per overlap point and write a plan")
    _workload_args(p)
    p.add_argument("--strategy", default="lagom", choices=list(STRATEGIES))
    p.add_argument("--out", help="plan JSON to write (its folder must exist)")
    p.add_argument("--emit", metavar="DIR", help="also write NCCL/megatron/TE/bucket files for the plan into DIR")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--search-seconds", type=positive_float, metavar="S",
                   help="stop the search after S seconds of wall clock and plan with the best settings found so far "
                        "(default: search to the end)")
    _capability_args(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("compare", help="nccl vs autoccl vs lagom (vs exhaustive) on the simulator")
    _workload_args(p)
    p.add_argument("--json", action="store_true", help="print the results and the capability record as JSON")
    _capability_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("simulate", help="simulate a step per strategy and plot its timeline")
    _workload_args(p)
    p.add_argument("--strategy", nargs="+", default=["nccl", "autoccl", "lagom"], choices=list(STRATEGIES))
    p.add_argument("--plot", help="PNG file for the timeline")
    p.set_defaults(func=cmd_simulate)

    for name, module, help_text in _PLUGGED:
        sub.add_parser(name, help=help_text, plugged=module)
    return parser


def _os_error(err: OSError) -> str:
    """An operating-system error as one line: the path, what went wrong, and what to check."""
    where = err.filename or "a file"
    return f"{where}: {err.strerror or err} (check the path and its permissions)"


def main(argv: list[str] | None = None) -> int:
    """Every command, the plugged ones too, ends here: a Lagom error or an OS error on a user's file is one
    line on stderr and exit code 2; anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except LagomError as err:
        message = str(err)
    except OSError as err:
        message = _os_error(err)
    print(f"lagom: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
