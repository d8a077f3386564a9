"""The ``--lagom`` flags, registered on Megatron's own argparse parser, and their checked form.

Both ways of getting the flags (the patch under ``lagom_megatron/patches/`` and the ``lagom_megatron.run``
launcher) call :func:`add_lagom_arguments`, so the flags and their errors are the same. argparse
rejects a bad value with a message that names the flag; what argparse cannot check (a plan file
that does not exist, a flag given without ``--lagom``) is a ``ConfigError`` naming the flag.

Files: ``--lagom-plan`` is only ever read. Plans Lagom makes (the start-up search, the online tuned
plan) and the Transformer Engine userbuffers config go to ``--lagom-out``; the online cache to
``--lagom-cache-dir``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from lagom.cli import positive_float
from lagom.errors import ConfigError
from lagom.runtime.online.background import DEFAULT_SEARCH_S
from lagom.runtime.online.live import DEFAULT_BUDGET_S
from lagom.search import STRATEGIES

log = logging.getLogger("lagom.megatron")

MODES = ("offline", "online")
FLAG = "--lagom"
DEFAULT_OUT = Path("lagom-out")
DEFAULT_CACHE = Path(".lagom-cache")
PLAN_FILE = "lagom-plan.json"  # the name of the plan Lagom writes into --lagom-out


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
                       help="tune the communication of this job with Lagom (alone: the hardware is detected "
                            "and a plan is searched beside the job, which starts at once)")
    group.add_argument("--lagom-plan", metavar="FILE",
                       help="plan JSON to start from; only read, never written (refused, naming the key, "
                            "when it was made for another job or machine)")
    group.add_argument("--lagom-mode", choices=MODES, default="offline",
                       help="offline: the plan decides at start-up; online: measure the first steps, "
                            "search, broadcast rank 0's plan, cache it for the next start")
    group.add_argument("--lagom-hardware", metavar="NAME|FILE",
                       help="hardware preset (shipped, or in a LAGOM_HARDWARE_PATH folder) or YAML file the plan is made for "
                            "(default: the --lagom-plan's, else detected)")
    group.add_argument("--lagom-strategy", choices=list(STRATEGIES), default="lagom",
                       help="search strategy (default: lagom)")
    group.add_argument("--lagom-tune-steps", "--lagom-tune-iters", dest="lagom_tune_iters", type=_positive_int,
                       default=60, metavar="N",
                       help="online mode: the step budget of tuning (after one warm-up step): the first 5 fit the "
                            "model, the rest try settings on live steps (default 60)")
    group.add_argument("--lagom-tune-seconds", type=positive_float, default=DEFAULT_BUDGET_S, metavar="S",
                       help=f"online mode: the wall-clock budget of trying settings live (default {DEFAULT_BUDGET_S:g})")
    group.add_argument("--lagom-search-seconds", type=positive_float, default=DEFAULT_SEARCH_S, metavar="S",
                       help="the wall-clock budget of each search Lagom runs beside the job (at start-up without a "
                            "plan, on the calibrated model, after a drift); at its end the best plan found so far "
                            f"is taken and the report says so (default {DEFAULT_SEARCH_S:g})")
    group.add_argument("--lagom-report", metavar="PATH",
                       help="where the tuning report goes: a .json file (Markdown beside it) or a directory")
    group.add_argument("--lagom-out", metavar="DIR",
                       help=f"where the plans Lagom makes ({PLAN_FILE}: the start-up search, the online tuned "
                            f"plan) and the userbuffers config are written (default: the --lagom-report "
                            f"directory, else {DEFAULT_OUT}/)")
    group.add_argument("--lagom-cache-dir", metavar="DIR",
                       help=f"online mode: plans cached per job and machine, reused on the next start "
                            f"(default {DEFAULT_CACHE}/)")
    group.add_argument("--lagom-flash-overlap", action="store_true",
                       help="run the TP+SP points the plan decomposes with the Flash-Overlap operators; acts "
                            "only with --sequence-parallel, --transformer-impl local and "
                            "--no-gradient-accumulation-fusion (with Transformer Engine's layers, "
                            "--tp-comm-overlap overlaps them instead, with the plan's userbuffers config)")
    return parser


@dataclass(frozen=True)
class LagomOptions:
    """The flags after the checks argparse cannot make."""

    mode: str
    plan: Path | None  # plan to start from: read only
    hardware: str | None  # None: the plan's, else detected by the session
    strategy: str
    tune_iters: int
    tune_seconds: float
    search_seconds: float
    report: Path | None
    out_dir: Path  # plans Lagom makes and the userbuffers config
    cache_dir: Path  # online plan cache
    flash_overlap: bool  # False when the job's flags keep Flash-Overlap from acting (warned at start-up)

    @property
    def plan_out(self) -> Path:
        """Where a plan Lagom makes is written (never the input ``plan``: the session checks)."""
        return self.out_dir / PLAN_FILE

    @property
    def report_files(self) -> tuple[Path, Path] | None:
        """(JSON, Markdown) report paths, or None when no report was asked for."""
        if self.report is None:
            return None
        if self.report.suffix == ".json":
            return self.report, self.report.with_suffix(".md")
        return self.report / "lagom-report.json", self.report / "lagom-report.md"


_DEFAULTS = {"lagom_plan": None, "lagom_mode": "offline", "lagom_hardware": None, "lagom_strategy": "lagom",
             "lagom_tune_iters": 60, "lagom_tune_seconds": DEFAULT_BUDGET_S, "lagom_search_seconds": DEFAULT_SEARCH_S, "lagom_report": None, "lagom_out": None, "lagom_cache_dir": None,
             "lagom_flash_overlap": False}


def te_blocker(args: argparse.Namespace) -> str:
    """Why Transformer Engine's layers keep Flash-Overlap out, and the flags that overlap them anyway.

    TE's linears issue their tensor-parallel collectives through torch.distributed themselves, past
    megatron-core's mappings where Flash-Overlap is routed (they are still recorded, by the torch.distributed
    tap). TE overlaps them with its GEMMs itself under --tp-comm-overlap, configured by the userbuffers
    config Lagom emits (``lagom tune --emit`` writes te_ub_cfgs.yaml; with --lagom the session passes
    the plan's as --tp-comm-overlap-cfg).
    """
    impl = getattr(args, "transformer_impl", "transformer_engine")
    alternative = ("--tp-comm-overlap is on: Transformer Engine overlaps them itself with the plan's userbuffers "
                   "config" if getattr(args, "tp_comm_overlap", False) else
                   "or keep Transformer Engine and add --tp-comm-overlap, with the ub_cfgs that `lagom tune --emit` "
                   "writes (te_ub_cfgs.yaml; with --lagom the plan's are passed as --tp-comm-overlap-cfg)")
    return (f"--transformer-impl local (--transformer-impl {impl}, Megatron's default, runs Transformer Engine's "
            f"layers, whose TP collectives bypass megatron-core's mappings); {alternative}")


def flash_overlap_blockers(args: argparse.Namespace) -> list[str]:
    """The Megatron flags missing for Flash-Overlap to act, each with why (empty: it can act).

    Flash-Overlap replaces megatron-core's own TP+SP linears; Transformer Engine's layers call
    torch.distributed directly (``te_blocker``), and gradient-accumulation fusion computes the weight
    gradient inside a fused kernel the decomposition cannot split (lagom_megatron/intercept.py).
    """
    missing = []
    if not getattr(args, "sequence_parallel", False) or getattr(args, "tensor_model_parallel_size", 1) < 2:
        missing.append("--sequence-parallel with --tensor-model-parallel-size > 1 (only TP+SP points are decomposed)")
    if getattr(args, "transformer_impl", "transformer_engine") != "local":
        missing.append(te_blocker(args))
    if getattr(args, "gradient_accumulation_fusion", True):
        missing.append("--no-gradient-accumulation-fusion (the fused weight-gradient kernel cannot be decomposed)")
    return missing


def options_from_args(args: argparse.Namespace) -> LagomOptions | None:
    """The checked options, or None when ``--lagom`` is off (then no other lagom flag may be set)."""
    if not getattr(args, "lagom", False):
        stray = [f"--{name.replace('_', '-')}" for name, default in _DEFAULTS.items()
                 if getattr(args, name, default) != default]
        if stray:
            raise ConfigError(stray[0], "is set but --lagom is not", "add --lagom, or drop the lagom flags")
        return None
    plan = Path(args.lagom_plan) if getattr(args, "lagom_plan", None) else None
    if plan is not None and plan.is_dir():
        raise ConfigError("--lagom-plan", f"{plan} is a directory", "pass the path of a plan JSON file")
    if plan is not None and not plan.exists():
        raise ConfigError("--lagom-plan", f"{plan} does not exist (the flag names a plan to start from)",
                          "pass an existing plan, or drop --lagom-plan: Lagom then plans and writes the plan "
                          "to --lagom-out")
    report = Path(args.lagom_report) if getattr(args, "lagom_report", None) else None
    if report is not None and report.suffix not in ("", ".json"):
        raise ConfigError("--lagom-report", f"'{report}' is neither a .json file nor a directory",
                          "pass report.json or a directory name")
    out = getattr(args, "lagom_out", None)
    if out is not None:
        out_dir = Path(out)
    elif report is not None:
        out_dir = report.parent if report.suffix == ".json" else report
    else:
        out_dir = DEFAULT_OUT
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--lagom-out", f"{out_dir} is a file", "pass a directory")
    cache = getattr(args, "lagom_cache_dir", None)
    flash = bool(getattr(args, "lagom_flash_overlap", False))
    blockers = flash_overlap_blockers(args) if flash else []
    if blockers:
        log.warning("--lagom-flash-overlap is on but Flash-Overlap will not act in this job, which runs as if the "
                    "flag were off; to let it act, add: %s", "; ".join(blockers))
    return LagomOptions(mode=getattr(args, "lagom_mode", "offline"), plan=plan,
                        hardware=getattr(args, "lagom_hardware", None),
                        strategy=getattr(args, "lagom_strategy", "lagom"),
                        tune_iters=getattr(args, "lagom_tune_iters", 60),
                        tune_seconds=getattr(args, "lagom_tune_seconds", DEFAULT_BUDGET_S),
                        search_seconds=getattr(args, "lagom_search_seconds", DEFAULT_SEARCH_S), report=report, out_dir=out_dir,
                        cache_dir=Path(cache) if cache else DEFAULT_CACHE, flash_overlap=flash and not blockers)
