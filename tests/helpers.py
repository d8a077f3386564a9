"""Small problems built by hand, for tests of the model and the search."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from lagom.hardware import load_hardware
from lagom.plan.comm_config import SearchSpace
from lagom.search import Problem
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph


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
