"""Tables a user reads: strategy comparison and plan summary (rich), and their JSON/Markdown forms."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from lagom.model.simulator import StepResult
from lagom.plan.plan import Plan


def strategy_summary(result: StepResult, evaluations: int) -> dict[str, Any]:
    return {"step_s": result.step_s, "evaluations": evaluations,
            "overlap_efficiency": result.overlap_efficiency, "exposed_comm_s": result.exposed_comm_s}


def compare_json(workload: str, hardware: str, results: dict[str, tuple[StepResult, int] | None]) -> dict[str, Any]:
    """The shape `lagom compare --json` promises; speedups are over the nccl strategy."""
    strategies = {name: (strategy_summary(*r) if r else None) for name, r in results.items()}
    base = strategies["nccl"]["step_s"]  # type: ignore[index]
    speedup = {name: base / strategies[name]["step_s"] for name in ("autoccl", "lagom")}  # type: ignore[index]
    return {"workload": workload, "hardware": hardware, "strategies": strategies, "speedup": speedup}


def compare_table(data: dict[str, Any], hw_source: str) -> Table:
    table = Table(title=f"{data['workload']} on {data['hardware']} (simulated; contention constants: {hw_source})")
    for col in ("strategy", "step (ms)", "speedup", "exposed comm (ms)", "overlap eff.", "evaluations"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    base = data["strategies"]["nccl"]["step_s"]
    for name, s in data["strategies"].items():
        if s is None:
            table.add_row(name, "-", "-", "-", "-", "too large")
            continue
        table.add_row(name, f"{s['step_s'] * 1e3:.2f}", f"{base / s['step_s']:.3f}x", f"{s['exposed_comm_s'] * 1e3:.2f}",
                      f"{s['overlap_efficiency']:.3f}", str(s["evaluations"]))
    return table


def plan_table(plan: Plan) -> Table:
    table = Table(title=f"plan: {plan.workload} on {plan.hardware} ({plan.strategy}, {plan.evaluations} evaluations)")
    for col in ("group", "collective", "MiB", "calls", "config", "comm ms", "exposed ms", "why"):
        table.add_column(col, justify="right" if col in ("MiB", "calls", "comm ms", "exposed ms") else "left")
    for e in plan.entries:
        table.add_row(e.group, e.collective, f"{e.bytes / 2**20:.2f}", str(e.count), e.config.describe(),
                      f"{e.predicted_comm_s * 1e3:.2f}", f"{e.predicted_exposed_s * 1e3:.2f}", e.note)
    return table


def plan_markdown(plan: Plan) -> str:
    """The plan as a Markdown report (for `lagom tune --emit` and the adapters' reports)."""
    lines = [f"# Lagom plan: {plan.workload} on {plan.hardware}", "",
             f"strategy `{plan.strategy}`, {plan.evaluations} evaluations, world size {plan.world_size}", ""]
    base = plan.predicted_step_s.get("nccl")
    for name, step in plan.predicted_step_s.items():
        gain = f" ({base / step:.3f}x over nccl)" if base and name != "nccl" else ""
        lines.append(f"- predicted step with `{name}`: {step * 1e3:.2f} ms{gain}")
    lines += ["", "| group | collective | MiB | calls | config | comm ms | exposed ms | why |",
              "|---|---|---:|---:|---|---:|---:|---|"]
    for e in plan.entries:
        lines.append(f"| {e.group} | {e.collective} | {e.bytes / 2**20:.2f} | {e.count} | {e.config.describe()} | "
                     f"{e.predicted_comm_s * 1e3:.2f} | {e.predicted_exposed_s * 1e3:.2f} | {e.note} |")
    return "\n".join(lines) + "\n"


NATURAL_MAX = 1000  # the widest a table grows to fit its cells on one line when not on a terminal


def print_table(table: Table, console: Console | None = None) -> None:
    """On a terminal, as wide as the terminal; elsewhere (a pipe, ``| tee log``, a CI log, where rich would
    assume 80 columns and wrap a long "why" one word per line) at the table's natural width, so every
    cell reads on one line."""
    console = console or Console()
    if not console.is_terminal:
        natural = console.measure(table, options=console.options.update_width(NATURAL_MAX)).maximum
        console = Console(file=console.file, width=max(console.width, natural), color_system=None)
    console.print(table)
