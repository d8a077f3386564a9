"""Timeline (Gantt) of the compute and communication streams of a simulated step, per strategy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lagom.model.simulator import PhaseResult, StepResult  # noqa: E402


def _busiest_phase(result: StepResult) -> PhaseResult:
    """The phase worth looking at: the one with the most communication."""
    return max(result.phases, key=lambda ph: sum(p.end - p.start for p in ph.points))


def timeline(results: dict[str, StepResult], path: str | Path, title: str = "") -> Path:
    """One panel per strategy; rows are (device, stream); results must come from simulate(keep_spans=True)."""
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.2 + 1.4 * len(results)), squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items()):
        phase = _busiest_phase(result)
        rows = sorted({(d, s) for d, s, *_ in phase.spans}, key=lambda r: (r[0], r[1] != "compute", r[1]))
        index = {r: i for i, r in enumerate(rows)}
        for device, stream, _, start, end in phase.spans:
            color = "tab:blue" if stream == "compute" else "tab:orange"
            ax.barh(index[(device, stream)], (end - start) * 1e3, left=start * 1e3, color=color, height=0.8, linewidth=0)
        ax.set_yticks(range(len(rows)), [f"gpu{d} {s}" for d, s in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: phase '{phase.name}' {phase.time * 1e3:.2f} ms "
                     f"(exposed comm {phase.exposed_comm * 1e3:.2f} ms)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
