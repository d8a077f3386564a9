"""Small problems built by hand, for tests of the model and the search."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import yaml
from hypothesis import assume
from hypothesis import strategies as st

from lagom.hardware import load_hardware
from lagom.plan.comm_config import SearchSpace
from lagom.search import Problem
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from lagom.step.workload import Workload


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def gpt_workload(**overrides) -> dict:
    """A small GPT job as a YAML dict; nested keys are merged from overrides."""
    data = {
        "name": "tiny-gpt",
        "model": {"architecture": "gpt", "layers": 2, "hidden": 256, "ffn": 1024, "heads": 8, "seq_len": 512, "vocab": 1024},
        "training": {"micro_batch": 2, "global_batch": 16, "dtype": "bf16"},
        "parallel": {"tp": 2, "sequence_parallel": True, "dp": 4},
        "framework": {"name": "megatron"},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


def synthetic_problem(segments: list[tuple[float, float, int]], points: list[dict], hardware: str = "a40-2x8-nvlink",
                      space: SearchSpace | None = None) -> Problem:
    """One device; segments as (TFLOP, MB, ctas); points as dicts for OverlapPoint (after/before: indices)."""
    hw = load_hardware(hardware)
    segs = [ComputeSegment(f"s{i}", f * 1e12, b * 1e6, c) for i, (f, b, c) in enumerate(segments)]
    pts = []
    for j, p in enumerate(points):
        nodes = p.get("nodes", 1)
        group = Group(p.get("group", f"g{j}"), p.get("size", 8), 8, nodes)
        pts.append(OverlapPoint(
            name=f"p{j}", collective=Collective(p["collective"]), group=group, bytes=int(p["mb"] * 1e6),
            after=None if p.get("after") is None else segs[p["after"]].name,
            before=None if p.get("before") is None else segs[p["before"]].name,
            fuse_with=None if p.get("fuse") is None else segs[p["fuse"]].name))
    graph = StepGraph("synthetic", hw.name, 1, [Phase("step", 1, {0: segs}, pts)])
    return Problem(graph, hw, space or SearchSpace())


SMALL_SPACE = SearchSpace(channels=(1, 2, 4, 8, 16, 32), threads=(512,), chunks=(256 * 1024, 2 * 1024 * 1024),
                          protocols=("Simple",), splits=(), priorities=(0,))

# Channels 2, 8 or 32 with NCCL's buffer: few enough settings for a joint brute force over three keys.
THREE_CHANNELS = SearchSpace(channels=(2, 8, 32), threads=(512,), chunks=(2 * 1024 * 1024,), protocols=("Simple",),
                             splits=(), priorities=(0,))


def with_space(problem: Problem, space: SearchSpace) -> Problem:
    return replace(problem, space=space)


def two_all_reduces_one_gemm() -> Problem:
    """Seed 1173 of the 3-key loop (three random collectives on three communicators, channels 2/8/32): two
    all-reduces on two communicators both hold up the last GEMM; NCCL's channels leave the step 12.7% off
    exhaustive's optimum, where both give SMs back (2 channels each)."""
    segments = [(0.8637563278269482, 144.7763315152631, 300), (0.3782691776934125, 1.316564875405267, 840),
                (0.17992317110980455, 60.71976640134377, 300)]
    points = [{"collective": "all_reduce", "mb": 197.2823314275096, "after": None, "before": 2, "group": "g0"},
              {"collective": "all_reduce", "mb": 257.3947151738264, "after": None, "before": 2, "group": "g1"},
              {"collective": "all_gather", "mb": 236.3976682609433, "after": 0, "before": 2, "nodes": 2, "size": 16,
               "group": "g2"}]
    return synthetic_problem(segments, points, space=THREE_CHANNELS)


def megatron_plan_file(args, path: Path) -> str:
    """A plan file for a Megatron job's arguments, made as `lagom tune` makes one: a job without a plan starts on
    Megatron's own settings and searches beside itself, so tests of what a plan does at start-up start from one."""
    from lagom.tune import make_plan
    from lagom_megatron.workload import workload_from_args

    make_plan(workload_from_args(args), load_hardware(args.lagom_hardware), args.lagom_strategy,
              search_buckets=getattr(args, "ddp_bucket_size", None) is None).save(path)  # as the session searches
    return str(path)


def random_workload(data: st.DataObject, pipeline_sizes: list[int],
                    micro_batches: Callable[[int], st.SearchStrategy[int]]) -> Workload:
    """Any small layout the workload schema accepts (architecture, every parallel size, ZeRO stage or FSDP, overlap
    on or off, bucket sizes), with ``micro_batches(pp)`` of them; layouts ``validate`` refuses are not drawn."""
    from lagom.errors import ConfigError
    from lagom.step.workload import Framework, Model, Parallel, Training, validate

    arch = data.draw(st.sampled_from(["gpt", "bert", "t5", "moe"]))
    deepspeed = data.draw(st.booleans())
    tp, pp, dp, cp = (data.draw(st.sampled_from(sizes)) for sizes in ([1, 2, 4], pipeline_sizes, [1, 2, 4], [1, 2]))
    layers = data.draw(st.integers(1, 4)) * pp
    model = Model(architecture=arch, layers=layers, hidden=256, ffn=512, heads=8, seq_len=256, vocab=1024,
                  decoder_layers=layers if arch == "t5" else 0, experts=4 if arch == "moe" else 0,
                  top_k=2 if arch == "moe" else 0, moe_ffn=256 if arch == "moe" else 0,
                  shared_experts=data.draw(st.integers(0, 1)) if arch == "moe" else 0,
                  gated_mlp=data.draw(st.booleans()), linear_bias=data.draw(st.booleans()))
    parallel = Parallel(dp=dp, tp=tp, pp=pp, cp=cp, ep=data.draw(st.sampled_from([1, 2])) if arch == "moe" else 1,
                        sequence_parallel=tp > 1 and data.draw(st.booleans()),
                        distributed_optimizer=not deepspeed and data.draw(st.booleans()),
                        zero_stage=data.draw(st.integers(0, 3)) if deepspeed else 0,
                        fsdp=not deepspeed and pp == 1 and data.draw(st.booleans()))
    framework = Framework(name="deepspeed" if deepspeed else "megatron", overlap_grad_reduce=data.draw(st.booleans()),
                          overlap_comm=data.draw(st.booleans()), bucket_size=data.draw(st.sampled_from([None, 100_000])),
                          reduce_bucket_size=data.draw(st.sampled_from([50_000, 500_000_000])))
    m = data.draw(micro_batches(pp))
    wl = Workload(name="random", model=model, training=Training(micro_batch=1, global_batch=m * dp), parallel=parallel,
                  framework=framework)
    try:
        validate(wl)
    except ConfigError:
        assume(False)
    return wl
