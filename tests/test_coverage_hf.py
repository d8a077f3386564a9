"""The plan is the job: stock Hugging Face causal LMs built from their configs (GPT-2; Llama with grouped KV heads)
under DeepSpeed ZeRO-1, 2 and 3, with overlap_comm on and off, and DeepSpeed's pipeline engine (2 stages), on 2
gloo ranks in online mode. After the
calibration steps the model's keys are reconciled with the calls the job issued (``lagom.model.reconcile``): at least
95% of the calls and of the bytes per step are keys of the adopted plan, and the losses are those of the same
job without Lagom. The model's own coverage (before reconciliation) is kept in each report, for the record.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.test_long_lived import HW

pytest.importorskip("transformers")
CASES = [(arch, stage, overlap) for arch in ("gpt2", "llama") for stage in (1, 2, 3) for overlap in (True, False)]
STEPS = 12


def model(arch: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=32))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32))


def config(stage: int, overlap: bool, lagom: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 100_000,
                              "allgather_bucket_size": 100_000, "stage3_prefetch_bucket_size": 50_000}}
    if lagom is not None:
        cfg["lagom"] = lagom
    return cfg


def train(engine: Any, rank: int, session: Any = None) -> list[float]:
    """STEPS steps; with a session, rank 0's search beside the steps is let finish before the 7th, so the plan is
    adopted at the same step however fast this machine is."""
    import torch

    from tests.test_deepspeed import searched_by_rank0

    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS):
        if session is not None and step == 6:
            searched_by_rank0(session)
        ids = torch.randint(0, 256, (2, 32), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def every_case(rank: int, world: int, tmp: str) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    import lagom_deepspeed

    out: dict[str, Any] = {}
    for arch, stage, overlap in CASES:
        m = model(arch)
        plain, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config(stage, overlap))
        reference = train(plain, rank)
        plain.destroy()
        section = {"enabled": True, "mode": "online", "hardware": f"{tmp}/hw.yaml", "tune_steps": 5,
                   "cache_dir": f"{tmp}/cache-{arch}-{stage}-{overlap}-{rank}", "monitor_interval": 1000}
        m = model(arch)
        engine, *_ = lagom_deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                config=config(stage, overlap, section))
        losses = train(engine, rank, engine.lagom)
        out[f"{arch}-{stage}-{overlap}"] = {"same_losses": losses == reference, "coverage": engine.lagom.reconciled,
                                           "off": engine.lagom.off, "tuned": len(engine.lagom.tuned)}
        engine.destroy()
    out["pipeline"] = pipeline_case(rank, tmp)
    return out


def pipeline_case(rank: int, tmp: str) -> dict[str, Any]:
    """examples/deepspeed/tiny_gpt.py's 2-stage PipelineModule, 2 micro-batches a step, with and without Lagom."""
    import sys

    import deepspeed
    import torch

    import lagom_deepspeed
    from tests.test_deepspeed import EXAMPLES, ds_config, searched_by_rank0

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import pipeline
    from tiny_gpt import train as train_pipeline

    def engine_for(init: Any, lagom: dict[str, Any] | None) -> Any:
        torch.manual_seed(0)  # the same initial weights for both engines
        module = pipeline()
        engine, *_ = init(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                          config=ds_config(None, gradient_accumulation_steps=2, lagom=lagom))
        return engine

    plain = engine_for(deepspeed.initialize, None)
    reference = train_pipeline(plain, STEPS, rank)
    plain.destroy()
    engine = engine_for(lagom_deepspeed.initialize, {"enabled": True, "mode": "online", "hardware": f"{tmp}/hw.yaml",
                                                     "tune_steps": 5, "cache_dir": f"{tmp}/cache-pipe-{rank}",
                                                     "monitor_interval": 1000})
    session = engine.lagom
    losses = train_pipeline(engine, 6, rank)
    searched_by_rank0(session)  # as ``train`` does for the ZeRO cases
    losses += train_pipeline(engine, STEPS - 6, rank, first=6)
    out = {"same_losses": losses == reference, "coverage": session.reconciled, "off": session.off,
           "tuned": len(session.tuned)}
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("coverage")
    (tmp / "hw.yaml").write_text(HW)
    return run_ranks(every_case, 2, str(tmp))


@pytest.mark.slow  # 13 jobs of 2 ranks, each with and without Lagom (about 2 minutes): CI's slower tier
@pytest.mark.parametrize("name", [f"{arch}-{stage}-{overlap}" for arch, stage, overlap in CASES] + ["pipeline"])
def test_the_adopted_plan_covers_the_calls_the_job_issues(cases: list[dict[str, Any]], name: str) -> None:
    for rank, out in enumerate(cases):
        case = out[name]
        assert case["same_losses"], f"rank {rank}: losses differ from the job without Lagom"
        assert case["off"] is None and case["tuned"] == 1, case
        after = case["coverage"]["after"]
        assert after["calls"] >= 0.95 and after["bytes"] >= 0.95, case["coverage"]
        if name.split("-")[1:2] in (["1"], ["2"]):  # ZeRO-1/2: the keys cut from the model's own tensors by DeepSpeed's
            before = case["coverage"]["before"]  # rules already are the job's calls, before any measurement
            assert before["calls"] >= 0.95 and before["bytes"] >= 0.95, case["coverage"]
