"""The command line: its JSON contract, its files, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from lagom.cli import main
from tests.helpers import gpt_workload, write_yaml


@pytest.fixture()
def wl(tmp_path):
    return str(write_yaml(tmp_path / "w.yaml", gpt_workload(parallel={"tp": 2, "dp": 4})))


def test_compare_json_has_the_promised_shape(wl, capsys):
    assert main(["compare", wl, "--hardware", "a100-8x-100g", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"workload", "hardware", "strategies", "speedup", "capability"}
    assert set(data["strategies"]) == {"nccl", "autoccl", "lagom", "exhaustive"}
    for name in ("nccl", "autoccl", "lagom"):
        s = data["strategies"][name]
        assert set(s) == {"step_s", "evaluations", "overlap_efficiency", "exposed_comm_s"}
        assert isinstance(s["evaluations"], int) and 0 < s["overlap_efficiency"] <= 1
    assert data["strategies"]["exhaustive"] is None  # too many keys for brute force
    nccl = data["strategies"]["nccl"]["step_s"]
    assert data["speedup"]["lagom"] == pytest.approx(nccl / data["strategies"]["lagom"]["step_s"])
    assert data["speedup"]["lagom"] >= 1.0
    cap = data["capability"]
    assert cap["nccl_version"] == "2.30.7" and cap["scopes"]["threads"] == "per process"
    assert cap["scopes"]["decomposition"] == "per point" and "NCCL 2.30.7" in cap["description"]


def test_compare_plans_for_the_nccl_version_and_plugin_given(wl, capsys):
    assert main(["compare", wl, "--hardware", "a100-8x-100g", "--json", "--nccl-version", "2.26",
                 "--no-tuner-plugin"]) == 0
    cap = json.loads(capsys.readouterr().out)["capability"]
    assert (cap["nccl_version"], cap["tuner_plugin"], cap["tuner_interface"]) == ("2.26", False, None)
    assert cap["scopes"]["algorithm"] == "not settable" and cap["scopes"]["channels"] == "per communicator"
    assert cap["scopes"]["cta_policy"] == "not settable" and cap["cta_policies"] == ["default"]


def test_tune_writes_a_plan_and_the_framework_files(wl, tmp_path, capsys):
    out = tmp_path / "emit"
    assert main(["tune", wl, "--hardware", "a100-8x-100g", "--out", str(tmp_path / "plan.json"), "--emit", str(out)]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["strategy"] == "lagom"
    assert {p.name for p in out.iterdir()} == {"nccl_comm_cfgs.yaml", "nccl_tuner.csv", "nccl_tuner.lagom", "nccl.env",
                                                "buckets.json", "te_ub_cfgs.yaml", "plan.md"}
    printed = capsys.readouterr().out
    assert "plan: tiny-gpt on a100-8x-100g" in printed
    # stdout is not a terminal here (as under `| tee log`): the table prints at its natural width, so each
    # "why" reads whole on its row rather than wrapped one word per line into 80 columns
    notes = [e["note"] for e in json.loads((tmp_path / "plan.json").read_text())["entries"]]
    rows = [line for line in printed.splitlines() if line.startswith("│")]
    assert len(rows) == len(notes) and max(map(len, rows)) > 80  # 80 columns would have wrapped it
    for note, line in zip(notes, rows):
        assert line.rstrip(" │").endswith(note)


def test_simulate_plots_a_timeline(wl, tmp_path):
    assert main(["simulate", wl, "--hardware", "a100-8x-100g", "--strategy", "nccl", "lagom", "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("override, args, message", [
    ({"model": {"layerz": 2}}, [], "model.layerz"),
    ({"model": {"heads": 7}}, [], "parallel.tp: tp=2 does not divide heads=7"),
    ({"parallel": {"dp": 2}}, [], "dp*tp*pp*cp=4 but the cluster has 8 GPUs"),
    ({"training": {"micro_batch": 0}}, [], "training.micro_batch: must be positive"),
    ({}, ["--hardware", "a100-80x"], "unknown hardware 'a100-80x'"),
    ({}, ["--hardware", "a100-8x-100g", "--nccl-version", "two"], "--nccl-version: 'two' is not an NCCL version"),
])
def test_bad_input_exits_2_with_one_clear_line(tmp_path, override, args, message):
    data = gpt_workload(parallel={"tp": 2, "dp": 4})
    for section, values in override.items():
        data[section].update(values)
    path = write_yaml(tmp_path / "w.yaml", data)
    hw = [] if args else ["--hardware", "a100-8x-100g"]
    proc = subprocess.run([sys.executable, "-m", "lagom.cli", "tune", str(path), *hw, *args],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


PLANNING_MODULES = ("lagom.cli", "lagom.tune", "lagom.plan.plan", "lagom.plan.emit", "lagom.search", "lagom.model.simulator",
                    "lagom.model.cost_model", "lagom.step.points", "lagom.step.workload", "lagom.hardware", "lagom.step.calls", "lagom.report")


def test_planning_and_the_parser_import_neither_torch_nor_matplotlib():
    script = (
        "import importlib, sys\n"
        f"for name in {PLANNING_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = lambda: sorted(m for m in ('torch', 'matplotlib', 'megatron', 'deepspeed') if m in sys.modules)\n"
        "print('imports', heavy())\n"
        "from lagom.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.format_help()\n"
        "print('parser', heavy())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines() == ["imports []", "parser []"]


def test_a_plugged_subcommand_loads_its_flags_when_used(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["calibrate", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--base", "--out", "--name", "--sizes", "--iters", "--backend", "--ranks"):
        assert flag in out


def test_tune_within_a_search_budget_plans_with_what_it_found_and_says_so(wl, tmp_path, capsys):
    """A budget spent before the first evaluation leaves NCCL's own choice, priced once: a plan that runs, whose
    notes and stderr say the search was cut."""
    plan_file = tmp_path / "plan.json"
    assert main(["tune", wl, "--hardware", "a100-8x-100g", "--search-seconds", "1e-9", "--out", str(plan_file)]) == 0
    plan = json.loads(plan_file.read_text())
    assert plan["predicted_step_s"]["lagom"] == plan["predicted_step_s"]["nccl"]
    assert all("cut at its budget of 1e-09 s" in e["note"] for e in plan["entries"])
    assert "cut at its budget of 1e-09 s (--search-seconds)" in capsys.readouterr().err


def test_tune_refuses_a_search_budget_that_is_not_a_positive_number(wl, capsys):
    for bad in ("0", "-3", "soon"):
        with pytest.raises(SystemExit) as ended:
            main(["tune", wl, "--search-seconds", bad])
        assert ended.value.code == 2
        assert "--search-seconds" in capsys.readouterr().err
