"""The report of a tuned run, one schema for every adapter: what was tuned, why, predicted and measured.

Rank 0 writes it as JSON (for tools) and Markdown (for people), atomically, at start-up, after the
first measured steps, whenever a plan is adopted, and at exit. Framework-specific facts (DeepSpeed's
inferred model, Megatron's writers) go under ``framework``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from lagom.hardware import Hardware
from lagom.nccl_profiler import what_ran
from lagom.plan.plan import Plan
from lagom.runtime.online.live import Trial
from lagom.runtime.online.state import FlashRouter, KnobChange, Measured, SessionOptions, StepStats, plugin_counters
from lagom.step.calls import KeyIndex
from lagom.step.workload import Workload


class Reported(Protocol):
    """What the report reads of a session. ``TuningSession`` is one; the report never imports the session,
    which imports the report to write it."""

    framework: str
    workload: Workload | None
    hw: Hardware | None
    options: SessionOptions
    world_size: int
    plan: Plan | None
    plan_source: str
    hardware_reason: str
    why_untuned: str
    measured: Measured
    baseline: Measured | None
    steps: list[StepStats]
    trials: list[Trial]
    live_summary: dict[str, Any]
    reconciled: dict[str, Any]
    router: FlashRouter
    applied_at_start: list[KnobChange]
    applied_now: list[str]
    next_start: list[str]
    env_conflicts: list[str]
    events: list[str]
    off: str | None
    off_at: int | None
    searching: bool
    search_cuts: list[str | None]
    runtime: Any  # lagom.runtime.apply.runtime.Runtime, or None before start

    def framework_report(self) -> dict[str, Any]: ...

    def plugin_calls(self) -> dict[str, Any] | None: ...


def _per_step(measured: Measured) -> dict[str, Any]:
    return {"steps": measured.steps, "step_ms": measured.mean_step_s * 1e3}


NOT_LOADED = ("NCCL never loaded Lagom's profiler plugin in this process (a communicator was made before "
              "NCCL_PROFILER_PLUGIN was set, or this NCCL is older than 2.26, the first with profiler interface v4)")


def nccl_ran(session: Reported) -> dict[str, Any]:
    """What NCCL ran for each planned key, from its profiler's records, against the plan: the what-ran table and
    one line per key NCCL did not run as planned; or, where there are no such records, why."""
    runtime = session.runtime
    reader = runtime.recorder.nccl if runtime is not None else None
    why = None
    if reader is None:
        why = ("no runtime was opened" if runtime is None else runtime.nccl_records_off
               or "the session is closed (NCCL's records are read while it runs)")
    elif not reader.loaded:
        why = NOT_LOADED
    elif session.plan is None:
        why = "no plan in force to compare with"
    if why is not None:
        return {"recorded": False, "why": why}
    assert reader is not None and session.plan is not None
    records = reader.collectives()
    if not records:
        return {"recorded": False, "why": "no collective of a step was recorded yet"}
    comparison = what_ran.compare(records, session.plan, reader.matches, plugin_counters())
    methods = sorted({m.method for m in reader.matches.values()})
    return {"recorded": True, "records": len(records), "matched_by": methods,
            "dropped": reader.reader.dropped_total, "table": what_ran.markdown(comparison),
            "mismatches": what_ran.mismatch_lines(comparison)}


def build(session: Reported) -> dict[str, Any]:
    """The report as plain data (the JSON file's content)."""
    plan, tuned, baseline = session.plan, session.measured, session.baseline
    predicted: dict[str, Any] = {}
    if plan is not None:
        base, mine = plan.predicted_step_s.get("nccl"), plan.predicted_step_s.get(plan.strategy)
        predicted = {"strategy": plan.strategy, "nccl_step_ms": (base or 0) * 1e3, "tuned_step_ms": (mine or 0) * 1e3,
                     "gain": base / mine if base and mine else None}
    measured: dict[str, Any] = {"tuned_steps": tuned.steps, "tuned_step_ms": tuned.mean_step_s * 1e3}
    if baseline is not None and baseline.steps:
        measured |= {"baseline_steps": baseline.steps, "baseline_step_ms": baseline.mean_step_s * 1e3,
                     "gain": baseline.mean_step_s / tuned.mean_step_s if tuned.steps else None}
    index = KeyIndex(e.key for e in plan.entries) if plan is not None else KeyIndex(())
    per_entry: dict[str, list[float]] = {}
    unplanned: dict[str, int] = {}
    for key, (calls, seconds) in tuned.per_key.items():
        planned = index.match(key)
        if planned is None:
            unplanned[key] = int(calls)
            continue
        row = per_entry.setdefault(planned, [0, 0.0])
        row[0] += calls
        row[1] += seconds
    steps = max(1, tuned.steps)
    points = []
    for e in plan.entries if plan is not None else []:
        calls, seconds = per_entry.get(e.key, [0, 0.0])
        points.append({
            "key": e.key, "group": e.group, "collective": e.collective, "bytes": e.bytes,
            "config": e.config.describe(), "settings": e.config.to_dict(), "why": e.note,
            "planned_calls_per_step": e.count, "measured_calls_per_step": calls / steps,
            "predicted_comm_ms": e.predicted_comm_s * 1e3, "measured_comm_ms": seconds / steps * 1e3,
            "flash_overlap_calls": session.router.calls.get(e.key, 0),
        })
    workload = session.workload
    available = getattr(session, "capability", None)
    capability = {
        "planned": plan.capability_record().describe() if plan is not None and plan.capability else None,
        "this_process": available.describe() if available is not None else None,
        "process_settings": plan.process if plan is not None else {},
        "registration": plan.registration if plan is not None else [],
    }
    return {
        "workload": asdict(workload) if workload is not None else None,
        "hardware": session.hw.name if session.hw is not None else None,
        "hardware_reason": session.hardware_reason,
        "framework": session.framework, "mode": session.options.mode, "world_size": session.world_size,
        "plan_source": session.plan_source, "why_untuned": session.why_untuned,
        "predicted": predicted, "measured": measured, "points": points, "unplanned_calls": unplanned,
        "capability": capability,
        "applied_at_start": [asdict(c) for c in session.applied_at_start],
        "applied_now": session.applied_now, "applies_on_next_start": session.next_start,
        "env_conflicts": session.env_conflicts, "events": session.events,
        "steps": [asdict(s) for s in session.steps],
        "plan": json.loads(plan.to_json()) if plan is not None else None,
        "live": session.live_summary, "trials": [asdict(t) for t in session.trials],
        "nccl_plugin": session.plugin_calls(),
        "nccl_ran": nccl_ran(session),
        "coverage": session.reconciled,
        "switched_off": {"why": session.off, "at_step": session.off_at} if session.off else None,
        # the searches beside the job: one still under way, and per search adopted why it stopped early (None: it ran
        # to its end; else its budget was spent and the plan is the best it had found)
        "search": {"underway": session.searching, "cut": session.search_cuts},
        "details": session.framework_report(),
    }


def _name(report: dict[str, Any]) -> str:
    return report["workload"]["name"] if report["workload"] else "(not described)"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Lagom report: {_name(report)} on {report['hardware']} ({report['framework']}, {report['mode']}, "
             f"{report['world_size']} ranks)", ""]
    if report["hardware_reason"]:
        lines.append(f"- hardware: {report['hardware_reason']}")
    lines.append(f"- plan: {report['plan_source']}")
    covered = report.get("coverage") or {}
    if covered:
        before, after = covered["before"], covered["after"]
        lines.append(f"- keys: the model's covered {before['calls']:.0%} of the measured calls and {before['bytes']:.0%} "
                     f"of their bytes per step; reconciled with the measured steps, the plan covers {after['calls']:.0%} "
                     f"and {after['bytes']:.0%} ({len(covered['added'])} keys from measured calls, "
                     f"{len(covered['dropped'])} never called dropped"
                     + (f"; still unplanned: {', '.join(covered['unplanned'])})" if covered["unplanned"] else ")"))
    calls = report.get("nccl_plugin")
    if calls is not None:
        lines.append(f"- NCCL tuner plugin: {calls['coll_infos_per_step']:.3g} calls from NCCL per step "
                     f"({calls['applied_per_step']:.3g} with a rule applied), {calls['communicators']} communicators"
                     + (" (NCCL never consulted it while calibrating: NCCL's settings were not tried live)"
                        if calls["consulted_while_calibrating"] is False else ""))
    if report["why_untuned"]:
        lines.append(f"- not tuned: {report['why_untuned']}")
    search = report["search"]
    if search["underway"]:
        lines.append("- search: rank 0 is searching beside the job; its plan is adopted at the first step after it is ready")
    for n, cut in enumerate(search["cut"], 1):
        if cut:
            lines.append(f"- search {n}: {cut}; the plan adopted is the best it had found")
    cap = report["capability"]
    if cap["planned"]:
        lines.append(f"- planned for: {cap['planned']}")
    lines.append(f"- this process: {cap['this_process'] or 'no CUDA, so no NCCL to compare with: the plan is taken as planned'}")
    if cap["process_settings"]:
        lines.append("- per-process settings (one value for every collective): "
                     + ", ".join(f"{k} {v}" for k, v in cap["process_settings"].items()))
    predicted, measured = report["predicted"], report["measured"]
    if predicted:
        gain = f" ({predicted['gain']:.3f}x)" if predicted.get("gain") else ""
        lines.append(f"- predicted step: nccl {predicted['nccl_step_ms']:.2f} ms, {predicted['strategy']} "
                     f"{predicted['tuned_step_ms']:.2f} ms{gain}")
    line = f"- measured step under the plan: {measured['tuned_step_ms']:.2f} ms over {measured['tuned_steps']} steps"
    if measured.get("baseline_steps"):
        line += f"; before tuning {measured['baseline_step_ms']:.2f} ms over {measured['baseline_steps']} steps"
        line += f" ({measured['gain']:.3f}x)" if measured.get("gain") else ""
    lines.append(line)
    sections = (
        ("Applied at start-up", [f"`{c['key']}`: {c['before']} -> {c['after']} ({c['why']})"
                                 for c in report["applied_at_start"]]
         or ["nothing: the framework's own settings are what the plan wants" if report["plan"] else
             "nothing: no plan is in force"]),
        ("Applied now", report["applied_now"]), ("Applies on next start", report["applies_on_next_start"]),
        ("NCCL environment overriding the plan", report["env_conflicts"]),
        ("Buffers to register symmetrically (ZERO CTA policy)",
         [f"{r['group']}: {', '.join(r['collectives'])} up to {r['max_bytes']} bytes ({r['how']})"
          for r in cap["registration"]]),
        ("Events", report["events"]),
    )
    for title, items in sections:
        if items:
            lines += ["", f"## {title}", *[f"- {item}" for item in items]]
    if report["points"]:
        lines += ["", "## Points", "", "| group | collective | MiB | config | calls/step plan / measured | "
                  "comm ms predicted / measured | Flash-Overlap calls | why |", "|---|---|---:|---|---:|---:|---:|---|"]
        for pt in report["points"]:
            lines.append(f"| {pt['group']} | {pt['collective']} | {pt['bytes'] / 2**20:.2f} | {pt['config']} | "
                         f"{pt['planned_calls_per_step']} / {pt['measured_calls_per_step']:.1f} | "
                         f"{pt['predicted_comm_ms']:.3f} / {pt['measured_comm_ms']:.3f} | {pt['flash_overlap_calls']} | "
                         f"{pt['why']} |")
    ran = report.get("nccl_ran") or {"recorded": False, "why": "not in this report"}
    if ran["recorded"]:
        lines += ["", f"## What NCCL ran ({ran['records']} collectives recorded by its profiler; communicators matched "
                  f"by {', '.join(ran['matched_by'])})", "", ran["table"].rstrip("\n"),
                  *([""] + [f"- {line}" for line in ran["mismatches"]] if ran["mismatches"] else
                    ["", "- every recorded call ran as planned"])]
    else:
        lines += ["", f"What NCCL ran: not recorded ({ran['why']})."]
    if report["trials"]:
        live = report["live"]
        cost = (f" The {live.get('steps', 0)} live steps took {live['steps_s']:.3g} s, {live['cost_s']:+.3g} s against "
                f"as many steps at the reference ({live.get('reference_step_s', 0) * 1e3:.2f} ms each)."
                if "cost_s" in live else "")
        lines += ["", f"## Settings tried on live steps ({live.get('steps', 0)} steps, {live.get('evaluations', 0)} "
                  f"evaluations; {live.get('why', '')})", *([cost.strip()] if cost else []), "",
                  "| trial | steps | changed | step ms predicted / measured / reference | decision | confidence |",
                  "|---|---|---|---:|---|---:|"]
        for t in report["trials"]:
            moved = "; ".join(f"{k}: {c['algorithm']}/{c['protocol']}/{c['channels']}ch/{c['chunk_bytes']}B"
                              for k, c in t["changed"].items()) or "(the reference)"
            lines.append(f"| {t['id']} | {t['steps'][0]}-{t['steps'][-1]} | {moved} | "
                         f"{t['predicted']['step_s'] * 1e3:.2f} / {t['measured']['step_s'] * 1e3:.2f} / "
                         f"{t['measured']['reference_step_s'] * 1e3:.2f} | {t['decision']}: {t['note']} | "
                         f"{t['confidence']:.2f} |")
        refit = live.get("refit") or {}
        if "step_error_after" in refit:
            slots = refit.get("gemm_slots_per_comm_cta")
            lines += ["", f"The model refitted to the {refit['observations']} measured windows: median step error "
                      f"{refit['step_error_before']:.1%} before, {refit['step_error_after']:.1%} after (compute "
                      f"x{refit['compute_scale']:.3g}" + ("" if slots is None else f", {slots:g} GEMM CTA slots per "
                                                          "comm CTA, fitted where channel counts differed") + ")."]
    if report["unplanned_calls"]:
        lines += ["", "## Calls with no plan entry", *[f"- `{k}`: {n}" for k, n in sorted(report["unplanned_calls"].items())]]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Atomic, so a reader (or a crash) never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(report: dict[str, Any], files: tuple[Path, Path]) -> None:
    write_atomic(files[0], json.dumps(report, indent=2, default=str) + "\n")
    write_atomic(files[1], markdown(report))


__all__ = ["build", "markdown", "write", "write_atomic"]
