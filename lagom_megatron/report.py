"""The tuning report of a Megatron run: planned points, chosen configs, predicted and measured gains.

Written as JSON and Markdown where ``--lagom-report`` says, and handed to Megatron's TensorBoard and
W&B writers when the run has them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagom.plan import Plan


@dataclass
class Measured:
    """Per-step wall time and per-plan-entry communication time, measured under one plan."""

    steps: int = 0
    step_s: float = 0.0  # total over ``steps``
    per_entry: dict[str, list[float]] = field(default_factory=dict)  # plan key -> [calls, seconds]
    unplanned: dict[str, int] = field(default_factory=dict)  # observed key -> calls, no plan entry for it

    @property
    def mean_step_s(self) -> float:
        return self.step_s / self.steps if self.steps else 0.0

    def add(self, step_s: float, records: list[Any], plan: Plan | None) -> None:
        self.steps += 1
        self.step_s += step_s
        for r in records:
            entry = plan.lookup(r.group, r.collective, r.nbytes) if plan else None
            if entry is None:
                self.unplanned[r.key] = self.unplanned.get(r.key, 0) + 1
                continue
            row = self.per_entry.setdefault(entry.key, [0, 0.0])
            row[0] += 1
            row[1] += max(0.0, r.end_s - r.start_s)


def build(plan: Plan | None, *, mode: str, workload: str, hardware: str, baseline: Measured | None,
          tuned: Measured, applied_now: list[str], next_start: list[str], env_conflicts: list[str],
          decomposed: dict[str, int]) -> dict[str, Any]:
    """The report as plain data (the JSON file's content)."""
    predicted = {}
    if plan is not None:
        base, mine = plan.predicted_step_s.get("nccl"), plan.predicted_step_s.get(plan.strategy)
        predicted = {"strategy": plan.strategy, "nccl_step_ms": (base or 0) * 1e3, "tuned_step_ms": (mine or 0) * 1e3,
                     "gain": base / mine if base and mine else None}
    measured: dict[str, Any] = {"tuned_steps": tuned.steps, "tuned_step_ms": tuned.mean_step_s * 1e3}
    if baseline is not None and baseline.steps:
        measured |= {"baseline_steps": baseline.steps, "baseline_step_ms": baseline.mean_step_s * 1e3,
                     "gain": baseline.mean_step_s / tuned.mean_step_s if tuned.steps else None}
    points = []
    for e in plan.entries if plan else []:
        calls, seconds = tuned.per_entry.get(e.key, [0, 0.0])
        points.append({
            "key": e.key, "group": e.group, "collective": e.collective, "bytes": e.bytes,
            "config": e.config.describe(), "settings": e.config.to_dict(), "why": e.note,
            "planned_calls_per_step": e.count, "measured_calls_per_step": calls / tuned.steps if tuned.steps else 0.0,
            "predicted_comm_ms": e.predicted_comm_s * 1e3,
            "measured_comm_ms": seconds / tuned.steps * 1e3 if tuned.steps else 0.0,
            "flash_overlap_calls": decomposed.get(e.key, 0),
        })
    return {"workload": workload, "hardware": hardware, "mode": mode, "predicted": predicted, "measured": measured,
            "points": points, "unplanned_calls": tuned.unplanned, "applied_now": applied_now,
            "applies_on_next_start": next_start, "env_conflicts": env_conflicts}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Lagom report: {report['workload']} on {report['hardware']} ({report['mode']})", ""]
    p, m = report["predicted"], report["measured"]
    if p:
        gain = f" ({p['gain']:.3f}x)" if p.get("gain") else ""
        lines.append(f"- predicted step: nccl {p['nccl_step_ms']:.2f} ms, {p['strategy']} {p['tuned_step_ms']:.2f} ms{gain}")
    line = f"- measured step under the plan: {m['tuned_step_ms']:.2f} ms over {m['tuned_steps']} steps"
    if m.get("baseline_steps"):
        line += f"; before tuning {m['baseline_step_ms']:.2f} ms over {m['baseline_steps']} steps"
        line += f" ({m['gain']:.3f}x)" if m.get("gain") else ""
    lines.append(line)
    for title, items in (("Applied now", report["applied_now"]), ("Applies on next start", report["applies_on_next_start"]),
                         ("NCCL environment overriding the plan", report["env_conflicts"])):
        if items:
            lines += ["", f"## {title}", *[f"- {item}" for item in items]]
    lines += ["", "## Points", "", "| group | collective | MiB | config | calls/step plan / measured | "
              "comm ms predicted / measured | Flash-Overlap calls | why |", "|---|---|---:|---|---:|---:|---:|---|"]
    for pt in report["points"]:
        lines.append(f"| {pt['group']} | {pt['collective']} | {pt['bytes'] / 2**20:.2f} | {pt['config']} | "
                     f"{pt['planned_calls_per_step']} / {pt['measured_calls_per_step']:.1f} | "
                     f"{pt['predicted_comm_ms']:.3f} / {pt['measured_comm_ms']:.3f} | {pt['flash_overlap_calls']} | {pt['why']} |")
    if report["unplanned_calls"]:
        lines += ["", "## Calls with no plan entry", *[f"- `{k}`: {n}" for k, n in sorted(report["unplanned_calls"].items())]]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Atomic, so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(report: dict[str, Any], files: tuple[Path, Path]) -> None:
    write_atomic(files[0], json.dumps(report, indent=2) + "\n")
    write_atomic(files[1], markdown(report))


def to_writers(report: dict[str, Any], iteration: int, tensorboard: Any = None, wandb: Any = None) -> None:
    """Scalars and the Markdown table through Megatron's writers (each may be None)."""
    scalars = {"lagom/measured_step_ms": report["measured"]["tuned_step_ms"]}
    for name, value in (("lagom/measured_gain", report["measured"].get("gain")),
                        ("lagom/predicted_gain", report["predicted"].get("gain") if report["predicted"] else None)):
        if value is not None:
            scalars[name] = value
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
        tensorboard.add_text("lagom/report", markdown(report), iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)
