"""The DeepSpeed run's report: points, configs, what was applied when, predicted and measured gains.

Written by rank 0 as ``<report>.json`` (for tools and tests) and ``<report>.md`` (for people) at
start-up, after the first ``tune_steps`` steps, whenever a tuned plan is taken, and at close.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

from lagom.report import plan_markdown
from lagom.calls import KeyIndex

if TYPE_CHECKING:
    from lagom_deepspeed.session import Session


def measured(session: "Session") -> dict[str, Any]:
    """Per recorded key: calls and seconds per step, and the plan key it is (same group and
    collective, size within the runtime's tolerance; None: a collective the plan does not model)."""
    steps = max(1, len(session.steps))
    index = KeyIndex(e.key for e in session.plan.entries)
    summary = session.runtime.recorder.summary() if session.runtime is not None else {}
    return {key: {"calls": row["count"], "calls_per_step": row["count"] / steps,
                  "comm_s_per_step": row["total_s"] / steps, "plan_key": index.match(key)}
            for key, row in sorted(summary.items())}


def gains(session: "Session") -> dict[str, Any]:
    """Predicted: the plan's strategy over NCCL's defaults (cost model). Measured: mean step time
    under each plan the run used (first step of each left out: it carries warm-up), and the ratio
    of the start-up plan's to the last tuned plan's when the run had both."""
    plan = session.plan
    base = plan.predicted_step_s.get("nccl")
    predicted = {name: {"step_s": s, "speedup_over_nccl": (base / s) if base else None}
                 for name, s in plan.predicted_step_s.items()}
    by_plan: dict[str, list[float]] = {}
    for st in session.steps:
        by_plan.setdefault(st.plan, []).append(st.step_s)
    steady = {name: mean(ts[1:] if len(ts) > 1 else ts) for name, ts in by_plan.items()}
    tuned = [n for n in steady if n != "start"]
    ratio = steady["start"] / steady[tuned[-1]] if tuned and "start" in steady else None
    return {"predicted": predicted, "measured_step_s": steady, "measured_speedup_tuned_over_start": ratio,
            "note": "a measured gain over DeepSpeed's defaults needs a run with the section disabled"}


def as_dict(session: "Session") -> dict[str, Any]:
    wl = session.derived.workload
    return {
        "mode": session.section.mode,
        "hardware": session.hw.name,
        "world_size": session.world_size,
        "workload": asdict(wl),
        "inferred": session.derived.notes,
        "parameters": {"model": session.derived.model_params, "implied_by_workload": session.derived.implied_params},
        "plan_source": session.plan_source,
        "plan": json.loads(session.plan.to_json()),
        "applied_at_start": [asdict(c) for c in session.changes],
        "group_options": {k: str(v) for k, v in (getattr(session.runtime, "group_options", None) or {}).items()},
        "decomposed_calls": dict(session.router.calls) if session.router else {},
        "events": session.events,
        "steps": [asdict(s) for s in session.steps],
        "measured": measured(session),
        "gains": gains(session),
    }


def markdown(data: dict[str, Any], plan_md: str) -> str:
    wl = data["workload"]
    lines = [f"# Lagom on DeepSpeed: {wl['name']} on {data['hardware']} ({data['world_size']} ranks, {data['mode']})", "",
             f"Plan {data['plan_source']}.", "", "## Workload as inferred", ""]
    lines += [f"- {n}" for n in data["inferred"]] or ["- (from a workload file)"]
    p = data["parameters"]
    lines += [f"- parameters: {p['model']} on the model, {p['implied_by_workload']} implied by the workload", "",
              "## Applied at start-up (bucket buffers are allocated when the engine is built)", ""]
    lines += [f"- `zero_optimization.{c['key']}`: {c['before']} -> {c['after']} ({c['why']})"
              for c in data["applied_at_start"]] or ["- no bucket knob differs from the config"]
    lines += [f"- NCCL options for group `{g}`: {o}" for g, o in data["group_options"].items()]
    lines += ["", "## Applied at run time", ""]
    lines += [f"- Flash-Overlap decomposition of `{k}`: {n} calls" for k, n in data["decomposed_calls"].items()]
    lines += [f"- {e}" for e in data["events"]] or ["- nothing changed while running"]
    g = data["gains"]
    lines += ["", "## Gains", ""]
    lines += [f"- predicted with `{n}`: {v['step_s'] * 1e3:.3f} ms per step"
              + (f" ({v['speedup_over_nccl']:.3f}x over NCCL defaults)" if v["speedup_over_nccl"] and n != "nccl" else "")
              for n, v in g["predicted"].items()]
    lines += [f"- measured with the {n} plan: {s * 1e3:.3f} ms per step" for n, s in g["measured_step_s"].items()]
    if g["measured_speedup_tuned_over_start"]:
        lines.append(f"- measured speed-up of the tuned plan over the start-up plan: {g['measured_speedup_tuned_over_start']:.3f}x")
    lines.append(f"- {g['note']}")
    lines += ["", "## Collectives seen (per step, measured)", "", "| key | calls/step | comm ms/step | plan entry |",
              "|---|---:|---:|---|"]
    lines += [f"| `{k}` | {m['calls_per_step']:.2f} | {m['comm_s_per_step'] * 1e3:.3f} | "
              + (f"`{m['plan_key']}` |" if m["plan_key"] else "not modelled |") for k, m in data["measured"].items()]
    lines += ["", plan_md.replace("# Lagom plan", "## Plan", 1)]
    return "\n".join(lines) + "\n"


def write(session: "Session", prefix: str) -> None:
    data = as_dict(session)
    base = Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    Path(f"{prefix}.md").write_text(markdown(data, plan_markdown(session.plan)))
