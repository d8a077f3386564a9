"""Bad input through the real command line: exit code 2 and one line `lagom: error: <key>: <problem> (<fix>)`
on stderr, for every command, never a traceback; and every Lagom error survives pickle."""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
import pickle
import pkgutil
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import lagom
from lagom.cli import main
from lagom.errors import ConfigError, LagomError
from lagom.hardware import load_hardware
from lagom.step.points import points_for
from lagom.step.workload import (
    MAX_STEP_GRAPH_ITEMS,
    Framework,
    Model,
    Parallel,
    Training,
    Workload,
    load_workload,
    step_graph_size,
    validate,
    workload_names,
)
from tests.helpers import gpt_workload, write_yaml

HW = "a100-8x-100g"


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in this process; it must exit 2 with one error line and no output. Returns the line."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own exit
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("lagom: error: "), captured.err
    return lines[0]


@pytest.fixture()
def workload(tmp_path: Path) -> Path:
    return write_yaml(tmp_path / "w.yaml", gpt_workload(parallel={"tp": 2, "dp": 4}))


def bad_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def as_role(role: str, path: Path, workload: Path) -> list[str]:
    """The tune command with ``path`` as the workload or as the hardware file."""
    return ["tune", str(path), "--hardware", HW] if role == "workload" else ["tune", str(workload), "--hardware", str(path)]


# ---------------------------------------------------------------------------------------------
# YAML


@pytest.mark.parametrize("role", ["workload", "hardware"])
def test_yaml_that_does_not_parse(tmp_path, workload, capsys, role):
    path = bad_file(tmp_path, "name: x\nmodel: {layers: 2\n")
    line = refused(as_role(role, path, workload), capsys)
    assert line == ("lagom: error: bad.yaml: is not valid YAML: expected ',' or '}', but got '<stream end>' "
                    "at line 3, column 1 (fix the YAML syntax)")


@pytest.mark.parametrize("role", ["workload", "hardware"])
@pytest.mark.parametrize("text, shape", [("- a\n- b\n", "a list"), ("just words\n", "a scalar")])
def test_yaml_whose_top_level_is_not_a_mapping(tmp_path, workload, capsys, role, text, shape):
    line = refused(as_role(role, bad_file(tmp_path, text), workload), capsys)
    assert line == (f"lagom: error: bad.yaml: holds {shape} at the top level, not a mapping "
                    "(write the settings as 'key: value' lines)")


@pytest.mark.parametrize("role", ["workload", "hardware"])
def test_empty_yaml(tmp_path, workload, capsys, role):
    line = refused(as_role(role, bad_file(tmp_path, "# nothing\n"), workload), capsys)
    assert line == "lagom: error: bad.yaml: is empty (write the settings as a mapping of keys to values)"


def test_duplicate_keys_are_refused_naming_the_key(tmp_path, workload, capsys):
    text = workload.read_text().replace("  layers: 2\n", "  layers: 2\n  layers: 3\n")
    assert text.count("layers:") == 2
    line = refused(["tune", str(bad_file(tmp_path, text)), "--hardware", HW], capsys)
    assert "lagom: error: bad.yaml: model.layers: appears twice (lines" in line and "(keep one of them)" in line
    hw = bad_file(tmp_path, "base: a100-8x-100g\nname: twice\ncluster:\n  nodes: 1\n  nodes: 2\n")
    line = refused(["tune", str(workload), "--hardware", str(hw)], capsys)
    assert line == "lagom: error: bad.yaml: cluster.nodes: appears twice (lines 4 and 5) (keep one of them)"


# ---------------------------------------------------------------------------------------------
# Sizes


def llama70b(micro_batches: int = 256, **parallel: int) -> Workload:
    """A Llama-3-70B-like job on 1,024 GPUs: 80 layers, tp 8 with sequence parallelism, pp 8, dp 16."""
    layout = {"dp": 16, "tp": 8, "pp": 8} | parallel
    return Workload(
        name="llama70b-like",
        model=Model(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, seq_len=8192, vocab=128256, gated_mlp=True),
        training=Training(micro_batch=1, global_batch=layout["dp"] * micro_batches),
        parallel=Parallel(sequence_parallel=True, distributed_optimizer=True, **layout),
        framework=Framework(name="megatron"),
    )


def test_a_1024_gpu_llama70b_job_is_accepted():
    wl = llama70b()
    assert (wl.world_size, wl.microbatches) == (1024, 256)
    validate(wl, 1024)
    size, _ = step_graph_size(wl)
    assert size < MAX_STEP_GRAPH_ITEMS / 4  # the limit leaves room for larger jobs than this one


def test_a_step_graph_too_large_to_build_is_refused_at_once(tmp_path, capsys):
    wl = llama70b(micro_batches=100 * 256)
    path = write_yaml(tmp_path / "huge.yaml", {"name": wl.name, "model": vars(wl.model), "training": vars(wl.training),
                                               "parallel": vars(wl.parallel), "framework": vars(wl.framework)})
    hw = write_yaml(tmp_path / "hw.yaml", {"base": "h100-sxm-8x-400g", "name": "h100-1024", "cluster": {"nodes": 128}})
    start = time.perf_counter()
    line = refused(["compare", str(path), "--hardware", str(hw), "--json"], capsys)
    assert time.perf_counter() - start < 5
    size, key = step_graph_size(wl)
    assert key == "training.global_batch" and size > MAX_STEP_GRAPH_ITEMS
    assert line.startswith(f"lagom: error: training.global_batch: the step graph would hold about {size:,} ")
    assert f"more than the {MAX_STEP_GRAPH_ITEMS:,} Lagom builds" in line


def test_millions_of_experts_are_refused_by_their_tensors(tmp_path, capsys):
    data = gpt_workload(model={"architecture": "moe", "experts": 2**20, "top_k": 2, "moe_ffn": 512, "layers": 8},
                        parallel={"tp": 2, "dp": 4, "ep": 2})
    line = refused(["tune", str(write_yaml(tmp_path / "moe.yaml", data)), "--hardware", HW], capsys)
    assert line.startswith("lagom: error: model.experts: the step graph would hold about ")
    assert line.endswith("(check the expert count and parallel.ep)")


@pytest.mark.parametrize("section, key, value", [
    ("model", "hidden", 10**15), ("training", "global_batch", 10**30), ("model", "kv_heads", -8),
])
def test_absurd_sizes_are_refused(tmp_path, capsys, section, key, value):
    data = gpt_workload(parallel={"tp": 2, "dp": 4})
    data[section][key] = value
    line = refused(["tune", str(write_yaml(tmp_path / "w.yaml", data)), "--hardware", HW], capsys)
    assert line.startswith(f"lagom: error: {section}.{key}: ")


def test_the_size_estimate_never_undercounts_the_graph():
    """The check refuses by an estimate, so the estimate must bound what points_for really builds, with
    pipelines and context parallelism, and with buckets far smaller than a parameter."""
    for name in workload_names():
        wl = load_workload(name)
        hw = load_hardware(wl.hardware)
        half = max(1, wl.parallel.dp // 2)
        for parallel, bucket in (({}, None), ({"pp": 2, "dp": half}, None), ({"cp": 2, "dp": half}, None),
                                 ({"distributed_optimizer": wl.framework.name == "megatron"}, 1000)):
            layout = replace(wl.parallel, **parallel)
            variant = replace(wl, parallel=layout, framework=replace(wl.framework, bucket_size=bucket),
                              training=replace(wl.training, global_batch=wl.training.micro_batch * layout.dp * 4))
            try:
                validate(variant)
            except ConfigError:
                continue  # a layout this model does not divide into
            graph = points_for(variant, hw)
            built = sum(len(segs) for ph in graph.phases for segs in ph.segments.values()) + len(graph.points)
            estimate, _ = step_graph_size(variant)
            assert built <= estimate <= 6 * built, (name, parallel, bucket, built, estimate)


# ---------------------------------------------------------------------------------------------
# Hardware files: relative bases and cycles


def test_a_relative_base_is_found_beside_the_file_that_names_it(tmp_path, workload, monkeypatch, capsys):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "jobs").mkdir()
    write_yaml(tmp_path / "site" / "common.yaml", {"base": "a40-2x8-nvlink", "name": "common", "cluster": {"nodes": 1}})
    job = write_yaml(tmp_path / "site" / "jobs" / "job.yaml", {"base": "../common.yaml", "name": "job"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    hw = load_hardware(str(job))
    assert (hw.name, hw.gpu.sms, hw.cluster.world_size) == ("job", 84, 8)  # A40 from the preset the base names
    assert main(["tune", str(workload), "--hardware", str(job)]) == 0
    assert "plan: tiny-gpt on job" in capsys.readouterr().out


@pytest.mark.parametrize("files, cycle", [
    ({"a.yaml": "b.yaml", "b.yaml": "./a.yaml"}, "a.yaml -> b.yaml -> a.yaml"),
    ({"a.yaml": "a.yaml"}, "a.yaml -> a.yaml"),
])
def test_a_cycle_of_base_files_is_named(tmp_path, workload, capsys, files, cycle):
    for name, base in files.items():
        write_yaml(tmp_path / name, {"base": base, "name": name})
    line = refused(["tune", str(workload), "--hardware", str(tmp_path / "a.yaml")], capsys)
    assert line == f"lagom: error: hardware.base: the base files form a cycle: {cycle} (remove one of the 'base' keys)"


def test_a_missing_relative_base_says_where_it_looked(tmp_path, workload, capsys):
    write_yaml(tmp_path / "a.yaml", {"base": "nope.yaml", "name": "a"})
    line = refused(["tune", str(workload), "--hardware", str(tmp_path / "a.yaml")], capsys)
    assert line == (f"lagom: error: a.yaml: base: file nope.yaml does not exist (looked in {tmp_path}) "
                    "(pass a preset name or an existing YAML file)")


# ---------------------------------------------------------------------------------------------
# Output paths


def test_out_into_a_missing_folder(tmp_path, workload, capsys):
    line = refused(["tune", str(workload), "--hardware", HW, "--out", str(tmp_path / "no" / "plan.json")], capsys)
    assert line == f"lagom: error: --out: folder {tmp_path / 'no'} does not exist (create it first, or write elsewhere)"
    assert not (tmp_path / "no").exists()


def test_out_into_a_folder_nobody_may_write(workload, capsys):
    if not Path("/sys").is_dir():
        pytest.skip("needs Linux /sys, a folder even root cannot write")
    line = refused(["tune", str(workload), "--hardware", HW, "--out", "/sys/plan.json"], capsys)
    assert line == "lagom: error: --out: cannot write into /sys: Permission denied (pick a folder you can write to)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (the /sys test covers root)")
def test_out_into_a_read_only_folder(tmp_path, workload, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        line = refused(["tune", str(workload), "--hardware", HW, "--out", str(read_only / "plan.json")], capsys)
    finally:
        read_only.chmod(stat.S_IRWXU)
    assert line == f"lagom: error: --out: cannot write into {read_only}: Permission denied (pick a folder you can write to)"


def test_out_that_is_a_folder(tmp_path, workload, capsys):
    line = refused(["tune", str(workload), "--hardware", HW, "--out", str(tmp_path)], capsys)
    assert line == f"lagom: error: --out: {tmp_path} is a folder (pass a file name)"


def test_emit_pointing_at_an_existing_file(tmp_path, workload, capsys):
    line = refused(["tune", str(workload), "--hardware", HW, "--emit", str(workload)], capsys)
    assert line == f"lagom: error: --emit: {workload} is an existing file, not a folder (pass a folder name)"


def test_plot_into_a_missing_folder(tmp_path, workload, capsys):
    line = refused(["simulate", str(workload), "--hardware", HW, "--plot", str(tmp_path / "no" / "t.png")], capsys)
    assert line.startswith("lagom: error: --plot: folder ")


def test_calibrate_checks_its_out_before_measuring(tmp_path, capsys):
    start = time.perf_counter()
    line = refused(["calibrate", "--base", HW, "--out", str(tmp_path / "no" / "p.yaml")], capsys)
    assert line == f"lagom: error: --out: folder {tmp_path / 'no'} does not exist (create it first, or write elsewhere)"
    assert time.perf_counter() - start < 10  # refused before any rank was spawned


def test_os_errors_of_a_plugged_command_are_one_line(capsys):
    if not Path("/sys").is_dir():
        pytest.skip("needs Linux /sys, a folder even root cannot write")
    line = refused(["reproduce", "--quick", "--out", "/sys/lagom-reproduce"], capsys)
    # checked (by writing a probe file) before any simulation; EPERM or EACCES, as the kernel says
    assert line.startswith("lagom: error: --out: cannot write into /sys: ")
    assert line.endswith(" (pick a folder you can write to)")


# ---------------------------------------------------------------------------------------------
# Flags, and the process as a whole


@pytest.mark.parametrize("argv, start", [
    (["tune"], "lagom: error: lagom tune: the following arguments are required: workload"),
    (["calibrate", "--base", HW, "--iters", "many"], "lagom: error: lagom calibrate: argument --iters: invalid int value"),
    (["nope"], "lagom: error: lagom: argument command: invalid choice: 'nope'"),
])
def test_bad_flags_are_one_line_too(capsys, argv, start):
    assert refused(argv, capsys).startswith(start)


def test_the_process_exits_2_without_a_traceback(tmp_path, workload):
    cases = [
        ["tune", str(bad_file(tmp_path, "a: [1\n")), "--hardware", HW],
        ["tune", str(workload), "--hardware", HW, "--emit", str(workload)],
        ["compare", str(workload), "--hardware", str(tmp_path / "missing.yaml")],
    ]
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "lagom.cli", *argv], capture_output=True, text=True, check=False)
        assert proc.returncode == 2 and proc.stdout == "", (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


# ---------------------------------------------------------------------------------------------
# Pickle


def _lagom_errors() -> list[type[LagomError]]:
    """Every LagomError subclass defined anywhere in the lagom package (all modules imported first)."""
    for info in pkgutil.walk_packages(lagom.__path__, "lagom."):
        importlib.import_module(info.name)
    found: list[type[LagomError]] = [LagomError]
    for cls in found:
        found.extend(sub for sub in cls.__subclasses__() if sub not in found)
    return found


def _example(cls: type[LagomError]) -> LagomError:
    """An instance built from the constructor's own parameters, each given a distinct string."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return cls(*[f"<{p.name}>" for p in params]) if params else cls("<message>")


def test_every_lagom_error_survives_pickle():
    classes = _lagom_errors()
    assert ConfigError in classes
    for cls in classes:
        err = _example(cls)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.args == err.args and str(back) == str(err), cls
        assert vars(back) == vars(err), cls
    config = pickle.loads(pickle.dumps(ConfigError("model.layers", "must be positive", "set it")))
    assert (config.key, config.problem, config.fix) == ("model.layers", "must be positive", "set it")
    assert str(config) == "model.layers: must be positive (set it)"


def _raise_config_error(key: str) -> None:
    raise ConfigError(key, "is wrong", "fix it")


def test_a_config_error_raised_in_a_pool_worker_reaches_the_parent():
    """Before the fix, unpickling failed in the pool's result thread and the parent waited forever."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply_async(_raise_config_error, ("lagom.hardware",))
        with pytest.raises(ConfigError) as caught:
            result.get(timeout=60)
    assert str(caught.value) == "lagom.hardware: is wrong (fix it)" and caught.value.key == "lagom.hardware"

