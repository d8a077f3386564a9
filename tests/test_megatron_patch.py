"""`lagom patch megatron` on a temp copy of the installed megatron/training (never the venv's own files)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lagom.errors import ConfigError
from lagom_megatron import patching
from lagom_megatron.patching import PATCH_FILE, megatron_root, parse_patch, patch_megatron

INSTALLED = megatron_root(None)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "megatron").rglob("*")) if p.is_file()}


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """megatron/training copied alone: with it first on sys.path, megatron.core still comes from the venv."""
    shutil.copytree(INSTALLED / "megatron" / "training", tmp_path / "megatron" / "training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_apply_is_idempotent_and_revert_restores_bytes(copy: Path) -> None:
    before = _digests(copy)
    assert patch_megatron(copy).startswith("patched megatron/training/arguments.py")
    after = _digests(copy)
    assert [k for k in before if before[k] != after[k]] == ["megatron/training/arguments.py"]
    text = (copy / "megatron/training/arguments.py").read_text()
    assert text.count("add_lagom_arguments(parser)") == 1 and text.count("lagom_setup(args)") == 1

    assert patch_megatron(copy / "megatron").startswith("already patched")  # DIR may also name megatron/
    assert _digests(copy) == after

    assert patch_megatron(copy, revert=True).startswith("reverted")
    assert _digests(copy) == before
    assert patch_megatron(copy, revert=True).startswith("not patched")
    assert _digests(copy) == before


def test_gnu_patch_accepts_the_same_file(copy: Path) -> None:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    run = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(PATCH_FILE)], cwd=copy, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_refuses_a_file_it_does_not_fit_and_leaves_it_alone(copy: Path) -> None:
    target = copy / "megatron/training/arguments.py"
    target.write_text(target.read_text().replace("    set_global_variables(args)\n", "    set_globals(args)\n"))
    before = _digests(copy)
    with pytest.raises(ConfigError) as err:
        patch_megatron(copy)
    message = str(err.value)
    assert message.startswith("--path: megatron/training/arguments.py")
    assert "hunk 2 (at 'set_global_variables(args)') not found" in message and "lagom_megatron.run" in message
    assert _digests(copy) == before


def test_refuses_a_partly_patched_file(copy: Path) -> None:
    patch_megatron(copy)
    target = copy / "megatron/training/arguments.py"
    second = "".join(f"{line}\n" for line in parse_patch(PATCH_FILE.read_text())[0].hunks[1].new[2:-2])
    assert "lagom_setup(args)" in second
    assert second in target.read_text()
    target.write_text(target.read_text().replace(second, ""))  # first hunk applied, second not
    with pytest.raises(ConfigError, match="partly patched"):
        patch_megatron(copy, revert=True)


def test_path_without_megatron_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--path: .* holds no megatron/training/arguments.py"):
        patch_megatron(tmp_path)


def test_cli_entry_points(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="lagom patch")
    patching.add_arguments(parser)
    assert patching.run(parser.parse_args(["megatron", "--path", str(copy)])) == 0
    assert patching.run(parser.parse_args(["megatron", "--path", str(copy), "--revert"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("patched") and out[1].startswith("reverted")
    with pytest.raises(SystemExit):
        parser.parse_args(["deepspeed"])


PARSE = textwrap.dedent("""
    import contextlib, io, json, sys
    copy, hardware = sys.argv[1:3]
    sys.path.insert(0, copy)
    import megatron.training.arguments as A
    assert A.__file__.startswith(copy), A.__file__
    base = ["prog", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2"]
    sys.argv = base + ["--lagom", "--lagom-mode", "online", "--lagom-hardware", "a100-8x-100g",
                       "--lagom-tune-iters", "3", "--lagom-report", "out/r.json", "--lagom-flash-overlap",
                       "--my-flag", "7"]
    extra = lambda p: (p.add_argument("--my-flag", type=int), p)[1]
    args = A.parse_args(extra_args_provider=extra)
    good = {k: getattr(args, k) for k in ("lagom", "lagom_mode", "lagom_hardware", "lagom_tune_iters",
                                          "lagom_report", "lagom_flash_overlap", "lagom_strategy", "my_flag")}
    errors = []
    for bad in (["--lagom", "--lagom-mode", "fast"], ["--lagom", "--lagom-tune-iters", "0"]):
        sys.argv = base + bad
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                A.parse_args()
            except SystemExit as exc:
                errors.append([exc.code, err.getvalue().strip().splitlines()[-1]])
    sys.argv = base + ["--global-batch-size", "4", "--max-position-embeddings", "32", "--train-iters", "4",
                       "--lr", "0.1", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer",
                       "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--lagom", "--lagom-hardware", hardware]
    args = A.parse_and_validate_args()  # the patch's second hunk starts Lagom here
    from lagom_megatron.hooks import current
    session = current()
    assert session.plan is None  # WORLD_SIZE 2, no process group yet: nothing in force before the ranks agree
    from megatron.core import parallel_state
    try:  # megatron's initialize_model_parallel agrees on rank 0's plan first (here it then fails: no group)
        parallel_state.initialize_model_parallel()
    except Exception:
        pass
    # no plan file: the job starts on Megatron's settings and rank 0 searches a plan beside it
    started = {"session": session is not None and session.args is args, "plan": session.plan is None,
               "searching": session.searching}
    session.close()
    print(json.dumps({"good": good, "errors": errors, "started": started}))
""")


@pytest.mark.slow  # a patched megatron checkout started in a subprocess (9 s): CI's slower tier
def test_patched_megatron_parses_the_flags_and_starts_lagom(copy: Path) -> None:
    patch_megatron(copy)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
    hardware = Path(__file__).resolve().parent.parent / "examples" / "megatron" / "cpu-2ranks.yaml"
    run = subprocess.run([sys.executable, "-c", PARSE, str(copy), str(hardware)], capture_output=True, text=True,
                         env=env, timeout=300, cwd=copy)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(run.stdout.strip().splitlines()[-1])
    assert data["good"] == {"lagom": True, "lagom_mode": "online", "lagom_hardware": "a100-8x-100g",
                            "lagom_tune_iters": 3, "lagom_report": "out/r.json", "lagom_flash_overlap": True,
                            "lagom_strategy": "lagom", "my_flag": 7}
    (code1, msg1), (code2, msg2) = data["errors"]
    assert code1 == 2 and "argument --lagom-mode: invalid choice: 'fast'" in msg1
    assert code2 == 2 and "argument --lagom-tune-steps/--lagom-tune-iters: must be at least 1, got 0" in msg2
    assert data["started"] == {"session": True, "plan": True, "searching": True}


WITHOUT_LAGOM = textwrap.dedent("""
    import contextlib, io, json, sys
    sys.modules["lagom"] = sys.modules["lagom_megatron"] = None  # every import of Lagom fails
    copy = sys.argv[1]
    sys.path.insert(0, copy)
    import megatron.training.arguments as A
    from megatron.training.global_vars import unset_global_variables
    assert A.__file__.startswith(copy), A.__file__
    base = ["prog", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "0.1", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer"]
    sys.argv = base
    args = A.parse_and_validate_args()
    out = {"plain": [args.num_layers, args.lagom]}
    unset_global_variables()
    sys.argv = base + ["--lagom"]
    try:
        A.parse_and_validate_args()
    except ImportError as err:
        out["lagom"] = str(err)
    unset_global_variables()
    sys.argv = base + ["--lagom-hardware", "a100-8x-100g"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            A.parse_args()
        except SystemExit as exc:
            out["stray"] = [exc.code, err.getvalue().strip().splitlines()[-1]]
    print(json.dumps(out))
""")


@pytest.mark.slow  # a second megatron start-up (about 11 s): CI's slower tier
def test_patched_megatron_runs_where_lagom_does_not_import(copy: Path) -> None:
    patch_megatron(copy)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_LAGOM, str(copy)], capture_output=True, text=True,
                         env=env, timeout=300, cwd=copy)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["plain"] == [2, False]  # Megatron parses and validates as unpatched
    assert out["lagom"].startswith("--lagom: Lagom does not import here (") and "drop --lagom" in out["lagom"]
    assert out["stray"][0] == 2 and "unrecognized arguments: --lagom-hardware a100-8x-100g" in out["stray"][1]
