"""`lagom reproduce`: published figures, table assembly, search cost, and one quick run end to end."""

from __future__ import annotations

import argparse

import pytest

from lagom.errors import ConfigError
from lagom_experiments import reproduce
from lagom_experiments.reproduce import (
    COLUMNS,
    Outcome,
    Published,
    Run,
    Setting,
    gap,
    load_published,
    row_cells,
    runs_for,
    setting_summary,
    synthetic_problem,
    table_rows,
)


def _published() -> Published:
    settings = [
        Setting("user", "a user run", ["w1"], ["hw1"], {"autoccl": 1.08, "lagom": 1.33}, "seed table, long", "seed",
                "real GPUs"),
        Setting("paper", "a paper run", ["w2"], ["hw2", "hw3"], {"autoccl": None, "lagom": (1.10, 1.33)},
                "paper, long", "paper", "Megatron-LM on A40"),
    ]
    return Published(settings, (1.03, 1.27), "paper, long", "paper", {"keys": 2, "lagom": 33, "autoccl": 16})


def _outcome(setting: str, workload: str, hardware: str, steps: dict[str, float], contention: str = "estimate") -> Outcome:
    return Outcome(Run(setting, workload, hardware), contention, keys=2, step_s=steps,
                   evaluations={name: 7 for name in steps}, configs={}, tuned={}, compute_s=0.8, exposed_s=0.1,
                   bound_s=0.8, devices=1, lagom_exposed={"dp/all_gather/1024": 0.05})


def test_table_rows_compare_each_strategy_with_the_published_figure():
    outcomes = [
        _outcome("user", "w1", "hw1", {"nccl": 1.0, "autoccl": 1.0 / 1.08, "lagom": 1.0 / 1.25}),
        _outcome("paper", "w2", "hw2", {"nccl": 1.0, "autoccl": 0.95, "lagom": 1.0 / 1.2, "exhaustive": 1.0 / 1.21}),
        _outcome("paper", "w2", "hw3", {"nccl": 1.0, "autoccl": 1.0, "lagom": 1.0 / 1.02}, contention="measured"),
    ]
    rows = table_rows(outcomes, _published())
    user, inside, below = rows
    assert user.ours["autoccl"] == pytest.approx(1.08) and user.diff["autoccl"] == pytest.approx(0.0)
    assert user.ours["lagom"] == pytest.approx(1.25) and user.diff["lagom"] == pytest.approx(-0.08)
    assert user.ours["exhaustive"] is None
    assert user.why.startswith("model: NCCL step 1000 ms") and "published: real GPUs" in user.why
    assert "datasheet estimates" in user.why
    # inside the published range: no gap, no explanation; no published AutoCCL figure: no diff
    assert inside.diff == {"autoccl": None, "lagom": 0.0} and inside.why == ""
    assert inside.ours["exhaustive"] == pytest.approx(1.21)
    assert below.diff["lagom"] == pytest.approx(1.02 - 1.10)
    assert below.why and "datasheet" not in below.why  # measured contention says nothing about estimates
    assert below.ours_source == "simulated on hw3, contention: measured"

    cells = row_cells(user)
    assert len(cells) == len(COLUMNS)
    named = dict(zip(COLUMNS, cells))
    assert named["AutoCCL ours"] == "1.08x" and named["Lagom published"] == "1.33x" and named["Lagom diff"] == "-0.08"
    assert named["published: source"] == "seed table, long" and named["evaluations a/l/e"] == "7/7/-"
    assert dict(zip(COLUMNS, row_cells(inside, short=True)))["Lagom published"] == "1.10-1.33x"

    summary = setting_summary(rows, _published())
    assert summary[1][:3] == ["a paper run", "1.02-1.20x (2 runs)", "1.10-1.33x"]
    # Lagom over AutoCCL on the paper's runs: 1.2 / (1 / 0.95) and 1.02 / 1.0
    assert summary[2][1] == "1.02-1.14x (2 runs)"


def test_gap_is_zero_inside_a_range_and_signed_outside():
    assert gap(1.2, (1.1, 1.3)) == 0.0
    assert gap(1.0, (1.1, 1.3)) == pytest.approx(-0.1)
    assert gap(1.4, (1.1, 1.3)) == pytest.approx(0.1)
    assert gap(None, 1.2) is None and gap(1.2, None) is None


def test_shipped_published_figures_match_the_sources():
    pub = load_published()
    by_id = {s.id: s for s in pub.settings}
    assert by_id["gpt2-tp8"].speedup == {"autoccl": 1.08, "lagom": 1.33}
    assert by_id["bert-pp4"].speedup == {"autoccl": 1.03, "lagom": 1.27}
    assert by_id["t5-dp-tp"].speedup == {"autoccl": 1.07, "lagom": 1.20}
    assert by_id["fsdp"].speedup["lagom"] == (1.10, 1.33)
    assert by_id["tp8"].speedup["lagom"] == (1.08, 1.16)
    assert by_id["ep8"].speedup["lagom"] == (1.07, 1.08)
    assert pub.lagom_over_autoccl == (1.03, 1.27)
    assert all(s.source and s.setup for s in pub.settings)
    assert len(runs_for(pub, quick=False)) == 3 + 2 * 8
    assert {(r.workload, r.hardware) for r in runs_for(pub, quick=True)} == set(reproduce.QUICK)


def test_malformed_published_file_names_the_entry(tmp_path):
    bad = tmp_path / "published.yaml"
    bad.write_text("settings:\n  - {id: x, label: x, workloads: [a], hardware: [b], speedup: {lagom: fast},"
                   " source: s, short: s, setup: s}\nlagom_over_autoccl: {range: [1, 2], source: s, short: s}\n"
                   "search_cost: {keys: 2, lagom: 1, autoccl: 1, source: s}\n")
    with pytest.raises(ConfigError, match=r"settings\[0\].speedup.lagom"):
        load_published(bad)


def test_synthetic_search_problems_have_the_requested_number_of_keys():
    for n in (2, 5):
        assert len(synthetic_problem(n).keys) == n
    costs = reproduce.search_cost([2, 8])
    assert costs[1].evaluations["lagom"] > costs[0].evaluations["lagom"]  # one check per key: grows with N
    assert costs[1].evaluations["exhaustive"] > costs[0].evaluations["exhaustive"] ** 3


@pytest.mark.slow  # a whole quick reproduction with its plots (7 s, the path of make demo): CI's slower tier
def test_quick_reproduction_of_one_workload_writes_report_and_plots(tmp_path, capsys, monkeypatch):
    # the search-cost study on 2 and 8 keys, not up to 64: the same code and plot, a tenth of the time
    # (how its cost grows with the key count is test_synthetic_search_problems_have_the_requested_number_of_keys)
    full_search_cost = reproduce.search_cost
    monkeypatch.setattr(reproduce, "search_cost", lambda: full_search_cost([2, 8]))
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    args = parser.parse_args(["--quick", "--only", "olmoe-1b-7b-ep8", "--jobs", "1", "--out", str(tmp_path)])
    assert reproduce.run(args) == 0
    report = (tmp_path / "report.md").read_text()
    header = "| " + " | ".join(COLUMNS) + " |"
    assert header in report
    row = next(line for line in report.splitlines() if line.startswith("| olmoe-1b-7b-ep8 | a40-2x8-pcie |"))
    assert len(row.strip("|").split("|")) == len(COLUMNS)
    assert "simulated on a40-2x8-pcie, contention: estimate" in row and "1.07-1.08x" in row
    for name in ("speedup", "timeline", "choices", "search_cost"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name}.png)" in report
    out = capsys.readouterr().out
    assert "olmoe-1b-7b-ep8" in out and "Lagom pub." in out
    assert "olmoe-1b-7b-ep8 on a40-2x8-pcie: " in out and " steps simulated, " in out  # the planning progress line


def test_only_rejects_a_workload_outside_the_run(tmp_path):
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    with pytest.raises(ConfigError, match="--only"):
        reproduce.run(parser.parse_args(["--quick", "--only", "mpt-7b-tp8", "--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # both frameworks on real ranks (half a minute): CI's slower tier
def test_real_runs_find_the_points_of_each_framework_and_keep_the_losses(tmp_path):
    """T5 (the architecture with the most kinds of points) through DeepSpeed ZeRO-3 and megatron-core TP."""
    from lagom_experiments.real import real_markdown, run_real

    results = {r.framework: r for r in run_real(tmp_path, ("deepspeed", "megatron"), ("t5",))}
    ds, meg = results["deepspeed"], results["megatron"]
    for r in (ds, meg):
        assert r.equal, f"{r.framework}: losses with Lagom {r.losses_lagom} != without {r.losses_plain}"
        assert len(r.losses_plain) == 2 and all(len(x) == 4 for x in r.losses_plain)
        assert r.losses_plain[0][-1] < r.losses_plain[0][0] + 0.5  # it trains, it does not blow up
        assert r.predicted["lagom"] <= r.predicted["nccl"]
    # each job's first start searched its plan beside the steps and saved it; the measured run started from that
    # file, with what is fixed at start-up (bucket sizes, communicator options, NCCL's variables) in force from its
    # first step, and the points reported are that plan's
    assert ds.plan_source == f"loaded from {tmp_path / 't5-plan.json'}"
    assert meg.plan_source == f"loaded from {tmp_path / 'megatron-t5' / 'lagom-plan.json'}"
    assert ds.applied and meg.applied
    # ZeRO-3 gathers parameters and reduce-scatters gradients over the data-parallel ranks, and all-reduces the
    # gradients' squared norm (fp64: 8 bytes) before stepping
    assert {p["key"].split("/")[1] for p in ds.points} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert [p["key"] for p in ds.points if "/all_reduce/" in p["key"]] == ["dp/all_reduce/8"]
    # encoder blocks and (larger, cross-attending) decoder blocks are gathered in calls of different sizes
    assert len({p["key"] for p in ds.points if "/all_gather/" in p["key"]}) >= 2
    assert any(k.startswith("dp/reduce_scatter/") for k in ds.seen)
    # tensor parallel without sequence parallelism: all-reduces over tp, in encoder and decoder blocks
    assert [p["key"].split("/")[:2] for p in meg.points] == [["tp", "all_reduce"]]
    names = meg.points[0]["points"]
    assert names and all(".ar" in n for n in names)
    key = meg.points[0]["key"]
    assert set(meg.seen) == {key} and meg.seen[key] >= 10  # forward alone: 2 encoder x 2 + 2 decoder x 3
    assert (tmp_path / "t5-lagom.md").exists() and (tmp_path / "megatron-t5-lagom.md").exists()
    md = real_markdown(list(results.values()))
    assert "| megatron-core tensor parallel (tp=2) | t5 | 1 |" in md
    assert f"| DeepSpeed ZeRO-3 (dp=2) | t5 | {len(ds.points)} |" in md
