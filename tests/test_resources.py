"""Lagom as a package: shipped data found through lagom.resources, a user's presets through
LAGOM_HARDWARE_PATH, `lagom --version` and `python -m lagom`, and the compiler the tuner plugin is built with.
(scripts/wheel_smoke.sh checks the same from an installed wheel, outside the checkout.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lagom
from lagom import resources
from lagom.cli import main
from lagom.errors import ConfigError
from lagom.hardware import closest_preset, load_hardware, preset_names
from lagom.nccl_tuner import build
from tests.helpers import write_yaml

ROOT = Path(__file__).resolve().parent.parent
B200 = {"base": "h100-sxm-8x-400g", "name": "b200-site", "gpu": {"name": "NVIDIA B200", "sms": 148}}


@pytest.fixture
def presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder of presets, the one LAGOM_HARDWARE_PATH names."""
    folder = tmp_path / "presets"
    folder.mkdir()
    monkeypatch.setenv(resources.HARDWARE_PATH_ENV, str(folder))
    return folder


def test_shipped_data_lives_in_the_packages_and_the_checkouts_configs_and_patches_link_to_it() -> None:
    assert resources.CONFIGS == Path(lagom.__file__).parent / "configs"
    for folder in (resources.HARDWARE_DIR, resources.WORKLOAD_DIR, resources.FIDELITY_DIR):
        assert any(folder.glob("*.yaml")), folder
    assert resources.PUBLISHED_FILE.is_file()
    assert resources.megatron_patch().read_text().startswith("Lagom hooks for megatron/training")
    assert (ROOT / "configs").is_symlink() and (ROOT / "configs").resolve() == resources.CONFIGS.resolve()
    # one copy of the patch, in lagom_megatron/patches (package data); the checkout's top-level patches links to it
    assert (ROOT / "patches").is_symlink() and (ROOT / "patches").resolve() == resources.megatron_patch().parent.resolve()


def test_without_user_presets_only_the_shipped_ones_are_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(resources.HARDWARE_PATH_ENV, raising=False)
    assert resources.hardware_dirs() == [resources.HARDWARE_DIR]
    assert preset_names() == sorted(p.stem for p in resources.HARDWARE_DIR.glob("[!_]*.yaml"))


def test_a_users_preset_is_listed_loaded_and_detected(presets: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert closest_preset("NVIDIA B200", gpus_per_node=8, nodes=1) is None  # no shipped preset has a B200
    write_yaml(presets / "b200-site.yaml", B200)
    assert "b200-site" in preset_names() and "h100-sxm-8x-400g" in preset_names()
    hw = load_hardware("b200-site")
    assert (hw.name, hw.gpu.sms, hw.cluster.world_size) == ("b200-site", 148, 8)  # the rest from the shipped base
    assert closest_preset("NVIDIA B200", gpus_per_node=8, nodes=1) == "b200-site"


def test_a_users_preset_shadows_the_shipped_one_and_may_build_on_it(presets: Path) -> None:
    shipped = load_hardware("a100-8x-100g")
    write_yaml(presets / "a100-8x-100g.yaml", {"base": "a100-8x-100g", "gpu": {"sms": 100}})
    mine = load_hardware("a100-8x-100g")
    assert (mine.gpu.sms, mine.gpu.peak_tflops, mine.cluster.world_size) == (100, shipped.gpu.peak_tflops, 8)
    assert preset_names().count("a100-8x-100g") == 1


def test_folders_are_searched_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    write_yaml(first / "site.yaml", {"base": "site", "name": "first"})  # builds on the next folder's site
    write_yaml(second / "site.yaml", {"base": "a100-8x-100g", "name": "second", "cluster": {"nodes": 2}})
    monkeypatch.setenv(resources.HARDWARE_PATH_ENV, f"{first}{os.pathsep}{second}")
    hw = load_hardware("site")
    assert (hw.name, hw.cluster.nodes) == ("first", 2)


def test_a_cycle_among_users_presets_is_still_refused(presets: Path) -> None:
    write_yaml(presets / "a.yaml", {"base": "b"})
    write_yaml(presets / "b.yaml", {"base": "a"})
    with pytest.raises(ConfigError, match="the base files form a cycle: a -> b -> a"):
        load_hardware("a")


def test_an_unknown_preset_lists_the_users_and_the_shipped_ones(presets: Path, capsys) -> None:
    write_yaml(presets / "b200-site.yaml", B200)
    assert main(["compare", "gpt2-tp8", "--hardware", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lagom: error: hardware: unknown hardware 'nope' (no nope.yaml in {presets}, "
                          f"{resources.HARDWARE_DIR}) (use one of a100-2x8-100g, a100-8x-100g, a40-2x8-nvlink, ")
    assert "b200-site" in err and err.endswith("or a folder in LAGOM_HARDWARE_PATH holding nope.yaml)\n")


def test_a_folder_in_lagom_hardware_path_that_does_not_exist_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(resources.HARDWARE_PATH_ENV, str(tmp_path / "missing"))
    assert main(["compare", "gpt2-tp8", "--hardware", "a100-8x-100g"]) == 2
    assert capsys.readouterr().err == (f"lagom: error: LAGOM_HARDWARE_PATH: {tmp_path / 'missing'} is not a folder "
                                       f"(set it to folders of hardware YAML files separated by '{os.pathsep}')\n")


def test_version_and_python_m_lagom(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"lagom {lagom.__version__}\n"
    run = subprocess.run([sys.executable, "-m", "lagom", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (0, f"lagom {lagom.__version__}\n")
    bad = subprocess.run([sys.executable, "-m", "lagom", "compare", "no-such-workload"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("lagom: error: workload: file no-such-workload does not exist")


def test_cc_names_the_compiler_or_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "/nonexistent")
    assert build.c_compiler() is None  # not another compiler found on PATH
    with pytest.raises(build.BuildError, match="^CC=/nonexistent names no program$"):
        build.compile_plugin(tmp_path / build.LIBRARY_NAME)
    found = shutil.which("cc") or shutil.which("gcc")
    if found is not None:
        monkeypatch.setenv("CC", f"{found} -O1")
        assert build.c_compiler() == [found, "-O1"]
