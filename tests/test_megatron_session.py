"""A session's start-up effects on Megatron, in one process (no process groups): the plan's bucket size,
NCCL options through get_nccl_options, NCCL environment conflicts, the train_step hook, the report
and its TensorBoard / W&B output."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from lagom.runtime.online import report
from lagom_megatron import hooks
from lagom_megatron.session import to_writers
from tests.helpers import megatron_plan_file

HARDWARE = Path(__file__).resolve().parent.parent / "examples" / "megatron" / "cpu-2ranks.yaml"


def job_args(**overrides) -> argparse.Namespace:
    values = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=32, micro_batch_size=2,
        global_batch_size=4, padded_vocab_size=128, world_size=2, rank=0, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1, bf16=True,
        accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
        ddp_bucket_size=20000, ddp_num_buckets=None, tp_comm_overlap=True, tp_comm_overlap_cfg=None,
        lagom=True, lagom_plan=None, lagom_mode="offline", lagom_hardware=str(HARDWARE), lagom_strategy="lagom",
        lagom_tune_iters=2, lagom_report=None, lagom_flash_overlap=False)
    return argparse.Namespace(**(values | overrides))


class Writer:
    """Stands in for a TensorBoard SummaryWriter / W&B run: keeps what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_scalar(self, name, value, step) -> None:
        self.calls.append(("scalar", name, value, step))

    def add_text(self, name, text, step) -> None:
        self.calls.append(("text", name, text, step))

    def log(self, values, step) -> None:
        self.calls.append(("log", values, step))


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path):
    from megatron.core import parallel_state
    from megatron.training import training

    monkeypatch.setenv("NCCL_MAX_CTAS", "3")  # overrides the communicator max_ctas of every group
    monkeypatch.setenv("WORLD_SIZE", "2")
    steps: list[int] = []
    monkeypatch.setattr(training, "train_step", lambda *args, iteration=None, **kwargs: steps.append(iteration) or "out")
    original = parallel_state.get_nccl_options
    caplog.set_level(logging.INFO)
    args = job_args(lagom_plan=megatron_plan_file(job_args(), tmp_path / "plan.json"))
    s = hooks.setup(args)
    assert s is not None and hooks.setup(args) is s  # idempotent for one args object (patch + launcher)
    assert s.plan is None  # WORLD_SIZE 2 and no process group yet: nothing is in force before the ranks agree
    s.agree_start()  # what megatron's initialize_model_parallel triggers (one process: its own plan is rank 0's)
    yield s, args, steps
    assert hooks.setup(argparse.Namespace(lagom=False)) is None and hooks.current() is None
    assert parallel_state.get_nccl_options is original


def test_startup_applies_the_plan_to_megatron(session, caplog: pytest.LogCaptureFixture) -> None:
    from megatron.core import parallel_state
    from megatron.training import training

    s, args, steps = session
    plan = s.plan
    assert args.ddp_bucket_size == plan.framework["megatron"]["bucket_size"]
    dp = s.communicator_configs()["dp"]
    assert set(s.communicator_configs()) == {"dp", "dp_cp", "intra_dp_cp"}  # cp == 1: one plan group, three pg names
    options = parallel_state.get_nccl_options("dp_cp", {})  # the group DDP reduces over
    assert (options.config.max_ctas, options.config.min_ctas) == (dp["max_ctas"], dp["min_ctas"])
    assert s.group_options["dp_cp"] is options
    # every pg_name the plan covers gets its options here; the runtime maps the group_desc to the same plan group
    assert parallel_state.get_nccl_options("dp", {}).config.max_ctas == dp["max_ctas"]
    assert s.runtime.plan_group("DATA_PARALLEL_GROUP") == s.runtime.plan_group("DATA_PARALLEL_GROUP_WITH_CP") == "dp"
    assert parallel_state.get_nccl_options("tp", {}) is None  # no tensor parallelism, nothing planned
    user = parallel_state.get_nccl_options("dp_cp", {"dp_cp": {"max_ctas": 1, "net_name": "IB"}})
    assert (user.config.max_ctas, user.config.min_ctas, user.config.net_name) == (1, 1, "IB")
    assert (f"process group dp_cp: max_ctas=1 (plan: {dp['max_ctas']}) from --nccl-communicator-config-path / "
            "--high-priority-stream-groups kept (explicit flags win); predicted cost") in caplog.text

    startup_log = "\n".join(r.getMessage() for r in caplog.get_records("setup"))
    assert any(c.startswith("NCCL_MAX_CTAS=3 overrides the plan") for c in s.env_conflicts)
    assert "NCCL_MAX_CTAS=3 overrides the plan" in startup_log
    assert args.tp_comm_overlap_cfg is None and "Transformer Engine is not importable" in startup_log

    for i in range(3):
        assert training.train_step("fwd", "data", iteration=i) == "out"
    assert steps == [0, 1, 2] and s.steps_seen == 3 and s.measured.steps == 2  # the first step is warm-up


def test_report_and_megatron_writers(session, tmp_path: Path) -> None:
    from megatron.training import training

    s, _, _ = session
    for i in range(3):
        training.train_step(iteration=i)
    data = s.report()
    assert data["mode"] == "offline" and data["measured"]["tuned_steps"] == 2
    assert [p["key"] for p in data["points"]] == [e.key for e in s.plan.entries]
    assert data["predicted"]["gain"] == pytest.approx(s.plan.predicted_step_s["nccl"] / s.plan.predicted_step_s["lagom"])
    files = (tmp_path / "r.json", tmp_path / "r.md")
    report.write(data, files)
    md = files[1].read_text()
    assert md.startswith("# Lagom report: megatron-gpt-2x64-dp2-tp1-pp1") and "| dp | reduce_scatter |" in md
    tb, wb = Writer(), Writer()
    to_writers(data, 7, tb, wb)
    assert ("scalar", "lagom/predicted_gain", data["predicted"]["gain"], 7) in tb.calls
    assert any(c[0] == "text" and c[1] == "lagom/report" and c[2] == md for c in tb.calls)
    assert wb.calls == [("log", {"lagom/measured_step_ms": data["measured"]["tuned_step_ms"],
                                 "lagom/predicted_gain": data["predicted"]["gain"]}, 7)]


def test_lagom_alone_detects_the_hardware(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--lagom` with no hardware and no plan: the session assumes a profile for this job's layout and says why."""
    monkeypatch.chdir(tmp_path)
    args = job_args(lagom_hardware=None, tp_comm_overlap=False)
    s = hooks.setup(args)
    try:
        assert s is not None and s.hw is not None
        assert s.hw.cluster.world_size == 2 and s.hardware_reason
        assert s.report()["hardware_reason"] == s.hardware_reason
    finally:
        hooks.setup(argparse.Namespace(lagom=False))


def test_a_job_lagom_cannot_describe_runs_on_megatrons_settings(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from megatron.training import training

    monkeypatch.setattr(training, "train_step", lambda *args, iteration=None, **kwargs: "out")
    caplog.set_level(logging.WARNING)
    args = job_args(padded_vocab_size=None, vocab_size=None, tp_comm_overlap=False)
    s = hooks.setup(args)
    try:
        assert s is not None and s.plan is None and s.workload is None
        assert args.ddp_bucket_size == 20000, "nothing of Megatron's was changed"
        assert "Lagom only records this job: --vocab-size" in caplog.text
        assert training.train_step(iteration=1) == "out"
        assert s.report()["why_untuned"].startswith("--vocab-size")
    finally:
        hooks.setup(argparse.Namespace(lagom=False))
