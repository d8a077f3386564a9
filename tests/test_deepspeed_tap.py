"""The process-wide tap on DeepSpeed's comm backend, and describe(), on 2 real gloo ranks.

Two real DeepSpeed engines live in one process (as in RLHF's actor and critic): both record through
one tap, each engine's calls go to its own session inside its ``active()`` block, closing the first
session keeps the second recording, and closing the last puts the backend back exactly as found.
A backend object that DeepSpeed replaces is followed. The expected bytes come from the models'
parameter counts: ZeRO 1 and 2 all-reduce every fp32 gradient once per step (4 bytes each).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "deepspeed"
WRAPPED = ("new_group", "batch_isend_irecv")  # besides every method in comm.SPECS


def _config(stage: int, bucket: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}}


def _regressor() -> Any:
    import torch
    from torch import nn

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.relu(self.first(x))).pow(2).mean()

    torch.manual_seed(1)
    return Regressor()


def _own_methods(backend: Any) -> dict[str, Any]:
    """The backend's instance attributes that shadow a method the tap may wrap."""
    from lagom_deepspeed.comm import SPECS

    return {k: v for k, v in vars(backend).items() if k in SPECS or k in WRAPPED}


def two_engines(rank: int, world: int) -> dict[str, Any]:
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch
    from deepspeed.utils import groups

    from lagom.runtime.apply import torch_tap
    from lagom.runtime.apply.recorder import Recorder
    from lagom_deepspeed.comm import current_tap, subscribe
    from lagom_deepspeed.groups import GroupNames

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import TinyGPT, train

    deepspeed.init_distributed(dist_backend="gloo")
    cdb = ds_comm.cdb
    before = dict(vars(cdb))
    groups._WORLD_GROUP = None  # DeepSpeed makes its data-parallel group inside the first engine

    torch.manual_seed(0)
    gpt = TinyGPT()
    sub_gpt = subscribe(GroupNames.for_job(gpt, None, world))
    engine_gpt, *_ = deepspeed.initialize(model=gpt, model_parameters=gpt.parameters(), config=_config(2, 4000))
    rec_gpt = Recorder(cuda=False)
    sub_gpt.attach(rec_gpt)
    reg = _regressor()
    sub_reg = subscribe(GroupNames.for_job(reg, None, world))
    engine_reg, *_ = deepspeed.initialize(model=reg, model_parameters=reg.parameters(), config=_config(1, 100))
    rec_reg = Recorder(cuda=False)
    sub_reg.attach(rec_reg)
    out: dict[str, Any] = {"group_desc": engine_gpt.optimizer.dp_process_group.group_desc,
                           "params": {"gpt": sum(p.numel() for p in gpt.parameters()),
                                      "reg": sum(p.numel() for p in reg.parameters())}}

    def step_reg(n: int) -> None:
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * n + rank))
        engine_reg.backward(engine_reg(x))
        engine_reg.step()

    def measured(step: int, work: Any, *recorders: Recorder) -> list[list[tuple[str, str, int]]]:
        for r in recorders:
            r.begin_step(step)
        work()
        return [[(c.group, c.collective, c.nbytes) for c in r.end_step()] for r in recorders]

    # each engine inside its session's active() block: its calls reach its own recorder only
    with sub_gpt.active():
        out["gpt_own"] = measured(1, lambda: train(engine_gpt, 1, rank, 1), rec_gpt, rec_reg)
    with sub_reg.active():
        out["reg_own"] = measured(1, lambda: step_reg(1), rec_gpt, rec_reg)
    # a call that bypasses deepspeed.comm (Transformer Engine's, a model's own) reaches the active session
    # through the torch.distributed tap; a call through deepspeed.comm is recorded once, by the backend tap
    probe = torch.ones(6)
    with sub_reg.active():
        out["direct_and_ds"] = measured(5, lambda: (torch.distributed.all_reduce(probe), ds_comm.all_reduce(probe)),
                                        rec_gpt, rec_reg)
    out["probe"] = probe.tolist()
    # outside any active() block the shared dp group does not say whose call it is: both record it
    out["gpt_shared"] = measured(2, lambda: train(engine_gpt, 1, rank, 2), rec_gpt, rec_reg)
    # closing the first session leaves the second recording
    sub_gpt.close()
    out["wrapped_after_first_close"] = bool(_own_methods(cdb))
    out["tap_after_first_close"] = current_tap() is not None
    out["reg_after_first_close"] = measured(3, lambda: step_reg(3), rec_gpt, rec_reg)
    sub_gpt.close()  # idempotent
    sub_reg.close()
    out["tap_after_last_close"] = current_tap() is not None
    out["torch_tap_after_last_close"] = torch_tap.current_tap() is not None
    after = dict(vars(cdb))
    out["restored_keys"] = sorted(set(after) ^ set(before))
    out["restored_identical"] = [k for k in before if after.get(k) is not before[k]]
    out["own_methods_left"] = sorted(_own_methods(cdb))
    out["reg_after_last_close"] = measured(4, lambda: step_reg(4), rec_reg)

    # DeepSpeed replaces its backend object (a second init_distributed): the tap moves with it
    from datetime import timedelta

    from deepspeed.comm.torch import TorchBackend

    from lagom_deepspeed.comm import SPECS

    first_backend = cdb
    sub_one = subscribe(GroupNames.for_job(reg, None, world))
    rec_one = Recorder(cuda=False)
    sub_one.attach(rec_one)
    replacement = TorchBackend("gloo", timedelta(minutes=5), None)
    ds_comm.cdb = replacement
    replacement_before = dict(vars(replacement))
    sub_two = subscribe(GroupNames.for_job(reg, None, world))
    rec_two = Recorder(cuda=False)
    sub_two.attach(rec_two)
    out["first_backend_restored"] = sorted(_own_methods(first_backend))
    out["replacement_wrapped"] = sorted(set(_own_methods(replacement)) & set(SPECS)) == sorted(
        m for m in SPECS if getattr(TorchBackend, m, None) is not None)
    tensor = torch.full((10,), float(rank + 1))
    out["replaced"] = measured(0, lambda: ds_comm.all_reduce(tensor), rec_one, rec_two)
    out["replaced_sum"] = tensor.tolist()
    sub_one.close()
    sub_two.close()
    out["replacement_restored"] = dict(vars(replacement)).keys() == replacement_before.keys() and all(
        vars(replacement)[k] is v for k, v in replacement_before.items())
    ds_comm.cdb = first_backend
    return out


def described(rank: int, world: int) -> dict[str, Any]:
    """describe() where DeepSpeed's batch rules divide by the data-parallel size and pipeline stages
    each see half of the model."""
    import deepspeed

    from lagom_deepspeed.workload import describe

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import TinyGPT, pipeline

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
    dp = describe(TinyGPT(), cfg, world)
    pipe_model = pipeline()
    pipe = describe(pipe_model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, world,
                    pp=pipe_model.num_stages)
    wl, pl = dp.workload, pipe.workload
    return {"dp": (wl.parallel.dp, wl.training.micro_batch, wl.training.global_batch, wl.microbatches),
            "pipe": (pl.parallel.pp, pl.parallel.dp, pl.model.layers, pl.model.vocab, pl.model.seq_len,
                     pl.training.global_batch),
            "pipe_params": pipe.model_params, "gpt_params": sum(p.numel() for p in TinyGPT().parameters())}


def both(rank: int, world: int) -> dict[str, Any]:
    """One spawn for the whole file: starting ranks that import DeepSpeed is most of its time."""
    return {"engines": two_engines(rank, world), "described": described(rank, world)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(both, 2)


@pytest.fixture(scope="module")
def engines(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["engines"] for r in ranks]


def _grad_bytes(records: list[tuple[str, str, int]]) -> int:
    return sum(n for _, coll, n in records if coll == "all_reduce" and n > 8)


def test_each_engine_records_its_own_calls_in_its_active_block(engines: list) -> None:
    for r in engines:
        gpt, reg = 4 * r["params"]["gpt"], 4 * r["params"]["reg"]
        gpt_rec, reg_rec = r["gpt_own"]
        assert _grad_bytes(gpt_rec) == gpt and reg_rec == []
        gpt_rec, reg_rec = r["reg_own"]
        assert gpt_rec == [] and _grad_bytes(reg_rec) == reg
        assert {g for g, _, _ in r["gpt_own"][0]} == {"dp"}
        assert r["group_desc"] == "dp", "the group DeepSpeed made for the first engine carries its lagom name"


def test_calls_past_deepspeed_comm_are_recorded_once_by_the_torch_tap(engines: list) -> None:
    for r in engines:
        gpt_rec, reg_rec = r["direct_and_ds"]
        assert gpt_rec == [] and reg_rec == [("dp", "all_reduce", 24)] * 2
        assert r["probe"] == [4.0] * 6


def test_calls_outside_any_active_block_reach_every_session(engines: list) -> None:
    for r in engines:
        gpt_rec, reg_rec = r["gpt_shared"]
        assert Counter(gpt_rec) == Counter(reg_rec) and _grad_bytes(gpt_rec) == 4 * r["params"]["gpt"]


def test_closing_the_first_session_keeps_the_second_recording(engines: list) -> None:
    for r in engines:
        assert r["wrapped_after_first_close"] and r["tap_after_first_close"]
        gpt_rec, reg_rec = r["reg_after_first_close"]
        assert gpt_rec == [] and _grad_bytes(reg_rec) == 4 * r["params"]["reg"]


def test_closing_the_last_session_restores_the_backend_exactly(engines: list) -> None:
    for r in engines:
        assert not r["tap_after_last_close"] and not r["torch_tap_after_last_close"]
        assert r["restored_keys"] == [] and r["restored_identical"] == [] and r["own_methods_left"] == []
        assert r["reg_after_last_close"] == [[]], "nothing records once every session is closed"


def test_a_replaced_backend_is_followed(engines: list) -> None:
    for r in engines:
        assert r["first_backend_restored"] == [] and r["replacement_wrapped"]
        one, two = r["replaced"]
        assert one == two == [("dp", "all_reduce", 40)]
        assert r["replaced_sum"] == [3.0] * 10
        assert r["replacement_restored"]


def test_describe_on_two_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in (out["described"] for out in ranks):
        assert r["dp"] == (2, 4, 16, 2)  # DeepSpeed: micro = 16 / (2 ranks x 2 accumulation steps)
        assert r["pipe"] == (2, 1, 2, 64, 16, 4)  # both stages' blocks counted; global = 2 x 2 x dp 1
        assert r["pipe_params"] == r["gpt_params"]
