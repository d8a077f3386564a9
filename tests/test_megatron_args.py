"""The launcher's hooks on the installed (unpatched) megatron/training, the flags' checks, and the
workload read off Megatron's arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pytest

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.tune import make_plan
from lagom_megatron.arguments import options_from_args
from lagom_megatron.hooks import install_launcher_hooks, remove_launcher_hooks
from lagom_megatron.session import Session
from lagom_megatron.workload import workload_from_args

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
         "--max-position-embeddings", "512", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--vocab-size", "1000", "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000000"]


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    """megatron.training.arguments.parse_args of the installed megatron, with the launcher's hooks."""
    from megatron.training import arguments

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    install_launcher_hooks()

    def run(argv: list[str], extra=None) -> argparse.Namespace:
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        return arguments.parse_args(extra_args_provider=extra)

    yield run
    remove_launcher_hooks()
    assert not hasattr(arguments.add_megatron_arguments, "__lagom_original__")


def test_launcher_hooks_register_the_flags_beside_a_scripts_own(parse, tmp_path: Path) -> None:
    def extra(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    args = parse([*MODEL, "--lagom", "--lagom-plan", str(plan), "--lagom-strategy", "autoccl", "--my-flag", "3"], extra)
    assert (args.lagom, args.lagom_plan, args.lagom_strategy, args.lagom_mode, args.my_flag) == \
        (True, str(plan), "autoccl", "offline", 3)
    opts = options_from_args(args)
    assert opts is not None and opts.plan == plan and opts.tune_iters == 60 and opts.tune_seconds == 300.0
    assert parse(MODEL).lagom is False and options_from_args(parse(MODEL)) is None
    install_launcher_hooks()  # a second install (patched megatron + launcher) adds nothing twice
    assert parse([*MODEL, "--lagom-report", "r.json", "--lagom"]).lagom_report == "r.json"


@pytest.mark.parametrize("argv,message", [
    (["--lagom", "--lagom-mode", "fast"], "argument --lagom-mode: invalid choice: 'fast'"),
    (["--lagom", "--lagom-tune-iters", "x"], "argument --lagom-tune-steps/--lagom-tune-iters: 'x' is not an integer"),
    (["--lagom", "--lagom-tune-steps", "0"], "argument --lagom-tune-steps/--lagom-tune-iters: must be at least 1, got 0"),
    (["--lagom", "--lagom-tune-seconds", "-1"], "argument --lagom-tune-seconds: must be positive, got -1.0"),
    (["--lagom", "--lagom-strategy", "best"], "argument --lagom-strategy: invalid choice: 'best'"),
])
def test_bad_flag_values_name_the_flag(parse, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse([*MODEL, *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,key", [
    (["--lagom-plan", "p.json"], "--lagom-plan: is set but --lagom is not"),
    (["--lagom-out", "out"], "--lagom-out: is set but --lagom is not"),
    (["--lagom-cache-dir", "cache"], "--lagom-cache-dir: is set but --lagom is not"),
    (["--lagom", "--lagom-plan", "missing.json"], "--lagom-plan: missing.json does not exist"),
    (["--lagom", "--lagom-hardware", "a100-8x-100g", "--lagom-report", "r.yaml"], "--lagom-report: 'r.yaml'"),
])
def test_flag_combinations_argparse_cannot_check(parse, argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        options_from_args(parse([*MODEL, *argv]))
    assert str(err.value).startswith(key)


def test_plan_in_is_read_only_and_plans_made_go_to_the_out_dir(parse, tmp_path: Path) -> None:
    alone = options_from_args(parse([*MODEL, "--lagom"]))  # hardware: detected by the session
    assert alone is not None and (alone.plan, alone.hardware, alone.report_files) == (None, None, None)
    assert (alone.out_dir, alone.plan_out, alone.cache_dir) == \
        (Path("lagom-out"), Path("lagom-out/lagom-plan.json"), Path(".lagom-cache"))
    plan = tmp_path / "start.json"
    plan.write_text("{}")
    report_dir = options_from_args(parse([*MODEL, "--lagom", "--lagom-plan", str(plan), "--lagom-report",
                                          str(tmp_path / "rep"), "--lagom-cache-dir", str(tmp_path / "c")]))
    assert report_dir is not None and report_dir.plan == plan
    assert (report_dir.plan_out, report_dir.cache_dir) == (tmp_path / "rep" / "lagom-plan.json", tmp_path / "c")
    report_file = options_from_args(parse([*MODEL, "--lagom", "--lagom-report", str(tmp_path / "r" / "x.json")]))
    assert report_file is not None and report_file.out_dir == tmp_path / "r"
    assert report_file.report_files == (tmp_path / "r" / "x.json", tmp_path / "r" / "x.md")
    explicit = options_from_args(parse([*MODEL, "--lagom", "--lagom-report", str(tmp_path / "rep"),
                                        "--lagom-out", str(tmp_path / "o")]))
    assert explicit is not None and explicit.plan_out == tmp_path / "o" / "lagom-plan.json"
    with pytest.raises(ConfigError, match=r"^--lagom-out: .* is a file"):
        options_from_args(parse([*MODEL, "--lagom", "--lagom-out", str(plan)]))


LOCAL = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion"]


@pytest.mark.parametrize("argv,missing", [
    ([], ["--transformer-impl local", "--no-gradient-accumulation-fusion"]),  # megatron's defaults: TE, fused wgrad
    (["--transformer-impl", "local"], ["--no-gradient-accumulation-fusion"]),
    (["--no-gradient-accumulation-fusion"], ["--transformer-impl local"]),
    ([*LOCAL, "--tensor-model-parallel-size", "1"], ["--sequence-parallel with --tensor-model-parallel-size > 1"]),
    (LOCAL, []),
])
def test_flash_overlap_needs_megatrons_own_unfused_tp_sp_linears(parse, caplog: pytest.LogCaptureFixture,
                                                                 argv: list[str], missing: list[str]) -> None:
    caplog.set_level(logging.WARNING, logger="lagom.megatron")
    opts = options_from_args(parse([*MODEL, *argv, "--lagom", "--lagom-flash-overlap"]))
    assert opts is not None and opts.flash_overlap == (not missing)  # a blocked Flash-Overlap is off, not an error
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not missing:
        assert warnings == []
        return
    assert len(warnings) == 1 and "Flash-Overlap will not act" in warnings[0]
    named = [flag for flag in ("--sequence-parallel", "--transformer-impl local", "--no-gradient-accumulation-fusion")
             if flag in warnings[0]]
    assert named == [flag.split(" with ")[0] for flag in missing]


@pytest.mark.parametrize("argv,alternative", [
    (["--no-gradient-accumulation-fusion"],
     "or keep Transformer Engine and add --tp-comm-overlap, with the ub_cfgs that `lagom tune --emit` writes"),
    (["--no-gradient-accumulation-fusion", "--tp-comm-overlap"],
     "--tp-comm-overlap is on: Transformer Engine overlaps them itself with the plan's userbuffers config"),
])
def test_transformer_engine_layers_are_named_once_with_the_flags_that_let_lagom_act(
        parse, caplog: pytest.LogCaptureFixture, argv: list[str], alternative: str) -> None:
    """Megatron's default --transformer-impl transformer_engine: one warning at start-up that names
    --transformer-impl local and the --tp-comm-overlap route (or says it is already taken)."""
    caplog.set_level(logging.WARNING, logger="lagom.megatron")
    opts = options_from_args(parse([*MODEL, *argv, "--lagom", "--lagom-flash-overlap"]))
    assert opts is not None and not opts.flash_overlap
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Flash-Overlap will not act" in warnings[0]
    assert "add: --transformer-impl local (--transformer-impl transformer_engine, Megatron's default" in warnings[0]
    assert alternative in warnings[0]


def test_workload_from_megatron_args(parse) -> None:
    wl = workload_from_args(parse(MODEL), script="pretrain_gpt.py")
    assert (wl.model.architecture, wl.model.layers, wl.model.hidden, wl.model.ffn, wl.model.heads) == ("gpt", 4, 256, 1024, 8)
    assert wl.model.vocab == 1024  # padded to a multiple of 128 x tp, as megatron pads it
    assert (wl.parallel.dp, wl.parallel.tp, wl.parallel.pp) == (4, 2, 1)
    assert wl.parallel.sequence_parallel and wl.parallel.distributed_optimizer
    assert (wl.training.dtype, wl.training.micro_batch, wl.training.global_batch) == ("bf16", 2, 16)
    assert (wl.framework.bucket_size, wl.framework.overlap_grad_reduce) == (1_000_000, True)
    assert workload_from_args(parse(MODEL), script="pretrain_gpt.py").fingerprint() == wl.fingerprint()
    other = workload_from_args(parse([*MODEL, "--ddp-bucket-size", "2000000"]), script="pretrain_gpt.py")
    assert other.fingerprint() != wl.fingerprint()
    gqa = workload_from_args(parse([*MODEL, "--group-query-attention", "--num-query-groups", "2", "--swiglu"]),
                             script="pretrain_gpt.py")
    assert (gqa.model.kv_heads, gqa.model.gated_mlp, gqa.model.ffn) == (2, True, 640)
    assert workload_from_args(parse(MODEL), script="pretrain_bert.py").model.architecture == "bert"


def test_workload_errors_name_the_key(parse, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^parallel.tp: tp=2 does not divide heads=3"):
        workload_from_args(parse([*MODEL, "--num-attention-heads", "3", "--hidden-size", "255"]))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size: tp\*pp\*cp=2 does not divide the world size 3"):
        workload_from_args(parse(MODEL))


def test_plan_for_another_topology_is_refused_naming_the_key(parse, tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    hw = load_hardware("a100-8x-100g")
    plan = make_plan(workload_from_args(parse(MODEL)), hw, "nccl")
    plan.world_size = 16  # as if made for two nodes
    plan.save(plan_file)
    args = parse([*MODEL, "--lagom", "--lagom-plan", str(plan_file), "--lagom-hardware", "a100-8x-100g"])
    with pytest.raises(ConfigError, match=r"plan.json\)?: plan.world_size: plan was made for 16 ranks, this job has 8"):
        Session.start_for(args, options_from_args(args))
    make_plan(workload_from_args(parse([*MODEL, "--num-layers", "8"])), hw, "nccl").save(plan_file)
    with pytest.raises(ConfigError, match=r"plan.json\)?: plan.workload_fingerprint: plan was made for workload"):
        Session.start_for(args, options_from_args(args))
    args.lagom_hardware = "no-such-gpu"
    with pytest.raises(ConfigError, match=r"^--lagom-hardware: .*no-such-gpu"):
        Session.start_for(args, options_from_args(args))
