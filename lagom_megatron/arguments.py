"""The ``--lagom`` flags, registered on Megatron's own argparse parser, and their checked form.

Both ways of getting the flags (the patch under ``patches/`` and the ``lagom_megatron.run``
launcher) call :func:`add_lagom_arguments`, so the flags and their errors are the same. argparse
rejects a bad value with a message that names the flag; what argparse cannot check (a plan file
that does not exist, a flag given without ``--lagom``) is a ``ConfigError`` naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from lagom.errors import ConfigError
from lagom.search import STRATEGIES

MODES = ("offline", "online")
FLAG = "--lagom"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_lagom_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the flags once; a parser that already has them is returned unchanged."""
    if FLAG in parser._option_string_actions:  # patched megatron and the launcher both ask
        return parser
    group = parser.add_argument_group(title="lagom", description="communication tuning (Lagom)")
    group.add_argument("--lagom", action="store_true",
                       help="tune the communication of this job with Lagom")
    group.add_argument("--lagom-plan", metavar="PATH",
                       help="plan JSON: used when it exists (offline), written after planning otherwise")
    group.add_argument("--lagom-mode", choices=MODES, default="offline",
                       help="offline: the plan decides at start-up; online: measure the first steps, "
                            "search, broadcast rank 0's plan, cache it for the next start")
    group.add_argument("--lagom-hardware", metavar="NAME|FILE",
                       help="hardware preset (configs/hardware) or YAML file the plan is made for")
    group.add_argument("--lagom-strategy", choices=list(STRATEGIES), default="lagom",
                       help="search strategy (default: lagom)")
    group.add_argument("--lagom-tune-iters", type=_positive_int, default=5, metavar="N",
                       help="online mode: steps measured (after one warm-up step) before the search runs (default 5)")
    group.add_argument("--lagom-report", metavar="PATH",
                       help="where the tuning report goes: a .json file (Markdown beside it) or a directory")
    group.add_argument("--lagom-flash-overlap", action="store_true",
                       help="run the TP+SP points the plan decomposes with the Flash-Overlap operators")
    return parser


@dataclass(frozen=True)
class LagomOptions:
    """The flags after the checks argparse cannot make."""

    mode: str
    plan: Path | None
    hardware: str | None
    strategy: str
    tune_iters: int
    report: Path | None
    flash_overlap: bool

    @property
    def report_files(self) -> tuple[Path, Path] | None:
        """(JSON, Markdown) report paths, or None when no report was asked for."""
        if self.report is None:
            return None
        if self.report.suffix == ".json":
            return self.report, self.report.with_suffix(".md")
        return self.report / "lagom-report.json", self.report / "lagom-report.md"


_DEFAULTS = {"lagom_plan": None, "lagom_mode": "offline", "lagom_hardware": None, "lagom_strategy": "lagom",
             "lagom_tune_iters": 5, "lagom_report": None, "lagom_flash_overlap": False}


def options_from_args(args: argparse.Namespace) -> LagomOptions | None:
    """The checked options, or None when ``--lagom`` is off (then no other lagom flag may be set)."""
    if not getattr(args, "lagom", False):
        stray = [f"--{name.replace('_', '-')}" for name, default in _DEFAULTS.items()
                 if getattr(args, name, default) != default]
        if stray:
            raise ConfigError(stray[0], "is set but --lagom is not", "add --lagom, or drop the lagom flags")
        return None
    plan = Path(args.lagom_plan) if args.lagom_plan else None
    if plan is not None and plan.is_dir():
        raise ConfigError("--lagom-plan", f"{plan} is a directory", "pass the path of a plan JSON file")
    if plan is None and args.lagom_hardware is None:
        raise ConfigError("--lagom-hardware", "is needed to make a plan when no --lagom-plan is given",
                          "pass a preset name from configs/hardware or a hardware YAML file")
    report = Path(args.lagom_report) if args.lagom_report else None
    if report is not None and report.suffix not in ("", ".json"):
        raise ConfigError("--lagom-report", f"'{report}' is neither a .json file nor a directory",
                          "pass report.json or a directory name")
    return LagomOptions(mode=args.lagom_mode, plan=plan, hardware=args.lagom_hardware, strategy=args.lagom_strategy,
                        tune_iters=args.lagom_tune_iters, report=report, flash_overlap=args.lagom_flash_overlap)
