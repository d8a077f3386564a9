"""megatron-core's GPTModel under megatron-core DDP (overlapped gradient buckets, with and without the
distributed optimizer) and a Lagom session on 2 gloo ranks: the process groups get the plan's options,
every bucket collective is recorded with its real size and matched to the plan's key, and the parameters
after the steps equal a run without Lagom."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import weakref
from pathlib import Path

import torch

from tests.distributed import run_ranks
from tests.helpers import megatron_plan_file

HIDDEN, FFN, LAYERS, HEADS, SEQ, VOCAB, STEPS, LR = 16, 64, 2, 4, 8, 128, 3, 0.1
HARDWARE = Path(__file__).resolve().parent.parent / "examples" / "megatron" / "cpu-2ranks.yaml"  # 2 ranks, A100-like
BUCKET = 1500  # elements: several buckets, several bucket groups


def cpu_megatron() -> None:
    """megatron-core allocates on torch.cuda.current_device() and reads the current stream; on CPU both are the host."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None


def cpu_attention() -> None:
    """megatron-core's attention draws its dropout under the CUDA RNG tracker; without dropout it needs none."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def job_args(world: int, report: Path, plan: Path | None = None) -> argparse.Namespace:
    """The Megatron arguments Lagom reads (a subset of what megatron's parser produces); ``plan``: a plan file to
    start from (``megatron_plan_file``), else Lagom searches one beside the job."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, seq_length=SEQ,
        max_position_embeddings=SEQ, micro_batch_size=2, global_batch_size=2 * world, padded_vocab_size=VOCAB,
        world_size=world, rank=0,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, use_distributed_optimizer=True, overlap_grad_reduce=True,
        ddp_bucket_size=BUCKET, ddp_num_buckets=None, tp_comm_overlap=False, lagom=True, lagom_plan=plan and str(plan),
        lagom_mode="offline", lagom_hardware=str(HARDWARE), lagom_strategy="lagom",
        lagom_tune_iters=2, lagom_report=str(report), lagom_flash_overlap=False)


def build(dist_opt: bool, overlap_param_gather: bool = False):
    """GPTModel with megatron's default layout (biases, LayerNorm, learned positions, tied output layer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=dist_opt,
                                               overlap_param_gather=overlap_param_gather, bucket_size=BUCKET)
    return model, DistributedDataParallel(config, ddp_config, model)


def train(rank: int, world: int, dist_opt: bool, session=None, alive: list | None = None
          ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """STEPS of SGD; returns the parameters and, per bucket group, its buckets' gradient buffer sizes.
    ``alive`` gets a weak reference to the DDP wrapper (to check nothing keeps it once training is over)."""
    model, ddp = build(dist_opt)
    if alive is not None:
        alive.append(weakref.ref(ddp))
    data = torch.Generator().manual_seed(100 + rank)
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked out
    for step in range(STEPS):
        if session:
            session.step_begin(step)
        ddp.zero_grad_buffer()
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        ddp(tokens, positions, causal).pow(2).mean().backward()
        ddp.finish_grad_sync()
        sgd_step(model, ddp, rank, world, dist_opt, force_sync=True)
        if session:
            session.step_end()
    sizes = [[b.grad_data.numel() * b.grad_data.element_size() for b in g.buckets] for g in ddp.bucket_groups]
    return [p.detach().clone() for p in model.parameters()], sizes


def sgd_step(model, ddp, rank: int, world: int, dist_opt: bool, force_sync: bool) -> None:
    """SGD by hand: with the distributed optimizer each rank updates its shard of every bucket, then the shards are
    all-gathered (``force_sync=False`` with overlap_param_gather: dispatched, waited for by the next forward)."""
    with torch.no_grad():
        if dist_opt:
            for buffer in ddp.buffers:
                for bucket in buffer.buckets:
                    n = bucket.param_data.numel() // world
                    bucket.param_data[rank * n:(rank + 1) * n] -= LR * bucket.grad_data[rank * n:(rank + 1) * n]
            ddp.start_param_sync(force_sync=force_sync)
        else:
            for p in model.parameters():
                p -= LR * p.main_grad


def ddp_rank(rank: int, world: int, report: Path) -> dict:
    cpu_megatron()
    cpu_attention()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lagom_megatron.arguments import options_from_args
    from lagom_megatron.session import Session

    parallel_state.initialize_model_parallel(1, 1)
    reference = {opt: train(rank, world, opt) for opt in (False, True)}
    parallel_state.destroy_model_parallel()

    created: dict[str, object] = {}  # group_desc -> pg_options megatron created the group with

    def spy(*args, **kwargs):
        created[kwargs.get("group_desc")] = kwargs.get("pg_options")
        return new_group(*args, **kwargs)

    args = job_args(world, report, report.parent / "plan.json")  # the test wrote it before the ranks started
    session = Session.start_for(args, options_from_args(args))
    new_group = dist.new_group  # the runtime's wrapper: it gives groups it knows by group_desc the plan's options
    dist.new_group = spy  # what megatron itself passes (options from get_nccl_options)
    parallel_state.initialize_model_parallel(1, 1)
    dist.new_group = new_group
    out = {"plan_dp": session.plan and next(e.config.channels for e in session.plan.entries if e.group == "dp"),
           "dp_cp_options": None, "runtime_dp_options": None}
    dp_cp = created.get("DATA_PARALLEL_GROUP_WITH_CP")  # the group DDP reduces over: options from get_nccl_options
    if dp_cp is not None:
        out["dp_cp_options"] = [dp_cp.config.max_ctas, dp_cp.config.min_ctas, dp_cp.is_high_priority_stream]
    runtime_dp = session.runtime.group_options.get("dp")  # DATA_PARALLEL_GROUP: the runtime's wrapper (gloo: not passed)
    if runtime_dp is not None:
        out["runtime_dp_options"] = [runtime_dp.config.max_ctas, runtime_dp.config.min_ctas]
    out["comm_cfg_dp"] = session.communicator_configs().get("dp")

    for opt in (False, True):
        first = len(session.runtime.recorder.records)
        params, sizes = train(rank, world, opt, session)
        records = session.runtime.recorder.records[first:]
        out[f"equal_{opt}"] = all(torch.equal(a, b) for a, b in zip(params, reference[opt][0]))
        out[f"params_{opt}"] = params
        out[f"buckets_{opt}"] = sizes
        out[f"records_{opt}"] = [(r.step, r.group, r.collective, r.nbytes, r.end_s >= r.start_s) for r in records]
    session.write_report()  # rank 0; megatron's training loop leaves this to the exit hook
    session.close()

    # a second session in the same process, as a notebook or a test suite makes one: it starts as if first,
    # and neither session keeps a model alive or leaves a hook behind
    from megatron.core.tensor_parallel import mappings

    from lagom.runtime.apply import torch_tap
    alive: list = []
    again = argparse.Namespace(**{**vars(args), "lagom_report": f"{report}-second"})
    second = Session.start_for(again, options_from_args(again))
    params, _ = train(rank, world, True, second, alive)
    out["second_equal"] = all(torch.equal(a, b) for a, b in zip(params, reference[True][0]))
    out["second_recorded"] = len(second.runtime.recorder.records) > 0
    second.close()
    gc.collect()
    out["models_alive"] = sum(ref() is not None for ref in alive)
    out["left_behind"] = [torch_tap.current_tap() is not None, hasattr(mappings._reduce, "__wrapped__")]
    return out


def test_ddp_buckets_are_recorded_and_training_is_unchanged(tmp_path: Path) -> None:
    megatron_plan_file(job_args(2, tmp_path / "report"), tmp_path / "plan.json")
    results = run_ranks(ddp_rank, 2, tmp_path / "report")
    for opt in (False, True):  # data parallel: both ranks hold the same, finite, trained parameters
        assert all(torch.equal(a, b) and a.isfinite().all() for a, b in zip(results[0][f"params_{opt}"],
                                                                             results[1][f"params_{opt}"]))
    for rank, out in enumerate(results):
        assert out["second_equal"] and out["second_recorded"] and out["models_alive"] == 0
        assert out["left_behind"] == [False, False]
        for opt in (False, True):
            assert out[f"equal_{opt}"], f"rank {rank}, distributed optimizer {opt}: parameters differ from the reference"
            groups = out[f"buckets_{opt}"]
            assert len(groups) > 1, "the test wants several bucket groups"
            sizes = sorted(s for g in groups for s in g)
            for step in range(STEPS):
                calls = [r for r in out[f"records_{opt}"] if r[0] == step]
                assert all(r[1] == "dp" and r[4] for r in calls)
                reduce = "reduce_scatter" if opt else "all_reduce"
                assert sorted(r[3] for r in calls if r[2] == reduce) == sizes, (step, calls)
                # the distributed optimizer all-gathers each bucket's parameters (fp32 here: same size)
                gathered = sorted(r[3] for r in calls if r[2] == "all_gather")
                assert gathered == (sizes if opt else [])
                assert len(calls) == len(sizes) * (2 if opt else 1)
        channels = out["plan_dp"]
        assert out["comm_cfg_dp"]["max_ctas"] >= channels >= out["comm_cfg_dp"]["min_ctas"]
        assert out["dp_cp_options"] == [out["comm_cfg_dp"]["max_ctas"], out["comm_cfg_dp"]["min_ctas"],
                                        out["comm_cfg_dp"]["is_high_priority_stream"]]
        assert out["runtime_dp_options"] == [out["comm_cfg_dp"]["max_ctas"], out["comm_cfg_dp"]["min_ctas"]]
    report = json.loads((tmp_path / "report" / "lagom-report.json").read_text())
    assert report["mode"] == "offline" and report["points"] and report["measured"]["tuned_steps"] >= 2
    # the plan is for the distributed optimizer's reduce-scatter / all-gather; the all-reduce run is not in it
    assert {p["collective"] for p in report["points"] if p["measured_calls_per_step"] > 0} == {"reduce_scatter", "all_gather"}
    # every planned bucket key is one the job runs (the modelled buckets are megatron's), and no bucket is unplanned
    assert all(p["measured_calls_per_step"] > 0 for p in report["points"])
    assert report["unplanned_calls"] and all("/all_reduce/" in key for key in report["unplanned_calls"])
