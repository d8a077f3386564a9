"""Lagom's layers, checked on the source: every import goes to the same layer or one below, and no two modules
import each other, even through others or inside a function.

    base     errors, resources, config_file, outputs, hardware, nccl_tuner   what everything shares
    step     lagom/step     what a training step is: the workload, its overlap points, its calls
    plan     lagom/plan     what can be decided and applied: settings, capability, the plan, its NCCL form
    model    lagom/model    what a step costs under given settings: cost model, contention, simulator
    search   lagom/search   how settings are chosen: the strategies and the one driver
    tune     lagom/tune.py  the planning API: workload in, plan out
    apply    lagom/runtime/apply, flash_overlap, nccl_profiler   a plan in force in one process
    measure  lagom/runtime/measure   measuring a machine (calibrate, probe)
    online   lagom/runtime/online    the online loop of one job (session, tuner, live trials, monitor, report)
    top      cli, validate, published_fit, report, plot, progress   the commands
"""

from __future__ import annotations

import ast
from pathlib import Path

LAGOM = Path(__file__).resolve().parent.parent / "lagom"
LAYERS = [  # (layer, module prefixes), lowest first; a module takes the layer of its longest matching prefix
    ("base", ("lagom.errors", "lagom.resources", "lagom.config_file", "lagom.outputs", "lagom.hardware",
              "lagom.nccl_tuner", "lagom.configs")),
    ("step", ("lagom.step",)),
    ("plan", ("lagom.plan",)),
    ("model", ("lagom.model",)),
    ("search", ("lagom.search",)),
    ("tune", ("lagom.tune",)),
    ("apply", ("lagom.runtime", "lagom.runtime.apply", "lagom.flash_overlap", "lagom.nccl_profiler")),
    ("measure", ("lagom.runtime.measure",)),
    ("online", ("lagom.runtime.online",)),
    ("top", ("lagom.cli", "lagom.__main__", "lagom.validate", "lagom.fidelity", "lagom.published_fit", "lagom.report",
             "lagom.plot",
             "lagom.progress")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def modules() -> dict[str, Path]:
    out = {}
    for path in LAGOM.rglob("*.py"):
        parts = path.relative_to(LAGOM.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer(module: str) -> str:
    if module == "lagom":  # the package's own __init__ (lagom.init, loaded lazily): on top
        return "top"
    best, length = "", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = name, len(prefix)
    assert best, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return best


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The lagom modules a file imports anywhere in it (function-level imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "lagom"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lagom" and not node.level:
            for alias in node.names:  # ``from lagom.x import y``: y may be a module of its own
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import to a higher layer (a module's own package excepted: importing it runs its __init__)."""
    return sorted(f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in g.items() for d in deps
                  if RANK[layer(d)] > RANK[layer(m)] and not m.startswith(d + "."))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module; a package and its own modules
    excepted: that is how a package exports)."""
    g = {m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")} for m, deps in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_every_import_goes_down_or_stays_in_its_layer() -> None:
    assert upward(graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle() -> None:
    made_up = {"lagom.model.a": {"lagom.search.b"}, "lagom.search.b": {"lagom.step.c"},
               "lagom.step.c": {"lagom.model.a"}, "lagom.plan": {"lagom.plan.d"}, "lagom.plan.d": set()}
    assert upward(made_up) == ["lagom.model.a (model) imports lagom.search.b (search)",
                               "lagom.step.c (step) imports lagom.model.a (model)"]
    assert cycles(made_up) == [["lagom.model.a", "lagom.search.b", "lagom.step.c"]]
