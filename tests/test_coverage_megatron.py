"""The plan's keys are the calls megatron-core issues: its GPTModel under its DDP, online on 2 gloo ranks, with and
without the distributed optimizer and with ``overlap_param_gather``. The adopted plan covers at least 95% of the
calls and bytes per step once reconciled with the measured steps, the keys modelled from megatron's bucket layout
alone already do, and the parameters equal the same run without Lagom."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks

VARIANTS = {"ddp": (False, False), "distributed-optimizer": (True, False), "overlap-param-gather": (True, True)}
STEPS = 12
TUNE = 4  # calibration steps: rank 0 reconciles and searches after them


def train(rank: int, world: int, dist_opt: bool, overlap_gather: bool, session: Any = None) -> list[torch.Tensor]:
    """SGD by hand as tests/test_megatron_ddp.py does; with ``overlap_gather`` the updated shards are gathered
    asynchronously and each module's forward waits for its bucket (megatron's forward pre-hooks)."""
    from tests.test_deepspeed import searched_by_rank0
    from tests.test_megatron_ddp import SEQ, VOCAB, build, sgd_step

    model, ddp = build(dist_opt, overlap_gather)
    data = torch.Generator().manual_seed(100 + rank)
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    for step in range(STEPS):
        if session is not None:
            searched_by_rank0(session)  # the plan is adopted at the same step however loaded this machine is
            session.step_begin(step)
        ddp.zero_grad_buffer()
        ddp(torch.randint(0, VOCAB, (2, SEQ), generator=data), positions, causal).pow(2).mean().backward()
        ddp.finish_grad_sync()
        sgd_step(model, ddp, rank, world, dist_opt, force_sync=False)
        if session is not None:
            session.step_end()
    if overlap_gather:  # the last step's gathers: no forward follows to wait for them
        for group in ddp.bucket_groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)
    return [p.detach().clone() for p in model.parameters()]


def variants_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from lagom_megatron.arguments import options_from_args
    from lagom_megatron.session import Session
    from tests.test_megatron_ddp import cpu_attention, cpu_megatron, job_args

    cpu_megatron()
    cpu_attention()
    out: dict[str, Any] = {}
    for name, (dist_opt, overlap_gather) in VARIANTS.items():
        parallel_state.initialize_model_parallel(1, 1)
        reference = train(rank, world, dist_opt, overlap_gather)
        parallel_state.destroy_model_parallel()
        args = argparse.Namespace(**{**vars(job_args(world, Path(tmp) / f"report-{name}-{rank}")),
                                     "use_distributed_optimizer": dist_opt, "overlap_param_gather": overlap_gather,
                                     "lagom_mode": "online", "lagom_tune_iters": TUNE,
                                     "lagom_cache_dir": f"{tmp}/cache-{name}"})
        session = Session.start_for(args, options_from_args(args))
        parallel_state.initialize_model_parallel(1, 1)
        params = train(rank, world, dist_opt, overlap_gather, session)
        out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(params, reference)), "off": session.off,
                     "tuned": len(session.tuned), "coverage": session.reconciled}
        session.close()
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(variants_rank, 2, str(tmp_path_factory.mktemp("megatron-coverage")))


@pytest.mark.slow  # 3 megatron-core jobs of 2 ranks, each with and without Lagom: CI's slower tier
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_adopted_plan_covers_megatron_cores_calls(variants: list[dict[str, Any]], name: str) -> None:
    for rank, out in enumerate(variants):
        case = out[name]
        assert case["equal"], f"rank {rank}: parameters differ from the run without Lagom"
        assert case["off"] is None and case["tuned"] == 1, case
        for when in ("before", "after"):  # the modelled bucket layout, then reconciled with the measured steps
            cover = case["coverage"][when]
            assert cover["calls"] >= 0.95 and cover["bytes"] >= 0.95, (when, case["coverage"])
