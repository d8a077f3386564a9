"""Real DeepSpeed engines on 2 CPU ranks (gloo) with and without the "lagom" section.

One pair of processes runs every scenario (DeepSpeed's first engine costs seconds of imports per
process); each test asserts on what its scenario returned. On CPU DeepSpeed picks gloo because
oneCCL's bindings are not installed (accelerator/cpu_accelerator.py), and its TorchBackend JIT-builds
a shared-memory comm op with the system C++ compiler once (cached in ~/.cache/torch_extensions).

Loss tolerance: exact equality. With two ranks every reduced element is one addition a + b, which
is commutative, and neither the plan's bucket sizes nor the Flash-Overlap P2P schedule change which
elements are added or how they are scaled (ZeRO pre-divides elementwise either way); no gradient
clipping is configured, so no norm is summed in a bucket-dependent order.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "deepspeed"
STEPS = 5
BUCKET = 4000  # elements: small enough that the tiny GPT's gradients fill several buckets


def ds_config(stage: int | None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                           "steps_per_print": 10_000}
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                                    "stage3_prefetch_bucket_size": BUCKET, "stage3_max_live_parameters": 1000}
    return {**cfg, **extra}


class Spy:
    """Counts (collective, bytes) at torch.distributed itself, below DeepSpeed's backend: an
    observation independent of the wrappers under test. Installed before DeepSpeed's backend
    exists, because the backend keeps references to two of these functions."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on = False
        self.seen: Counter = Counter()

        def size(t: Any) -> int:
            return sum(size(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()

        table = {"all_reduce": ("all_reduce", "tensor"), "reduce": ("reduce", "tensor"),
                 "broadcast": ("broadcast", "tensor"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
                 "all_gather": ("all_gather", "tensor_list"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
                 "isend": ("send_recv", "tensor"), "send": ("send_recv", "tensor"), "irecv": ("recv", "tensor"),
                 "recv": ("recv", "tensor")}
        for fn, (name, param) in table.items():
            setattr(dist, fn, self._counting(getattr(dist, fn), name, param, size))
        # P2POp accepts only the isend/irecv that distributed_c10d itself names
        dist.distributed_c10d.isend, dist.distributed_c10d.irecv = dist.isend, dist.irecv
        batch = dist.batch_isend_irecv

        def batch_spy(ops: list) -> Any:
            if self.on:
                self.seen[("p2p", sum(size(op.tensor) for op in ops))] += 1
            return batch(ops)

        dist.batch_isend_irecv = batch_spy

    def _counting(self, fn: Any, name: str, param: str, size: Any) -> Any:
        signature = inspect.signature(fn)

        def spy(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.seen[(name, size(signature.bind(*args, **kwargs).arguments[param]))] += 1
            return fn(*args, **kwargs)

        return spy


def _train(spy: Spy, engine: Any, rank: int, steps: int = STEPS, first: int = 0) -> list[float]:
    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import train

    spy.seen.clear()
    spy.on = True
    try:
        return train(engine, steps, rank, first)
    finally:
        spy.on = False


def _model(kind: str = "gpt") -> Any:
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import TinyGPT, pipeline

    torch.manual_seed(0)
    return pipeline() if kind == "pipe" else TinyGPT()


def _searched_beside(spy: Spy, rank: int, stage: int, section: dict[str, Any], init: Any) -> int:
    """A first engine with no plan file: it starts on DeepSpeed's settings, rank 0 searches beside its steps, and
    the plan adopted at an agreed step is saved to the section's plan file for the next start. Returns the step."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    fresh = groups._WORLD_GROUP is None
    model = _model()
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(stage, lagom=section))
    session = engine.lagom
    assert session.plan is None and session.searching
    step = 0
    while session.plan is None:
        searched_by_rank0(session)
        _train(spy, engine, rank, 1, first=step)
        step += 1
    session.close()
    if fresh:  # the next engine makes its dp group as in a fresh process, now with the plan's options
        groups._WORLD_GROUP = None
    dist.barrier()  # rank 0 wrote the plan file
    return step


def _lagom_run(spy: Spy, rank: int, stage: int, section: dict[str, Any], init: Any) -> dict[str, Any]:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    searched_at = _searched_beside(spy, rank, stage, section, init) if not Path(section["plan"]).exists() else None
    model = _model()
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(stage, lagom=section))
    losses = _train(spy, engine, rank)
    session = engine.lagom
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        effective = {"reduce_bucket_size": opt.reduce_bucket_size,
                     "stage3_prefetch_bucket_size": opt.parameter_offload._prefetch_bucket_sz,
                     "stage3_max_live_parameters": opt.parameter_offload._max_available_parameters_in_numel}
    else:
        effective = {"reduce_bucket_size": opt.reduce_bucket_size, "allgather_bucket_size": opt.allgather_bucket_size,
                     "overlap_comm": opt.overlap_comm}
    params = {n: p.ds_numel if hasattr(p, "ds_numel") else p.numel() for n, p in model.named_parameters()}
    out = {"losses": losses, "effective": effective, "plan": session.plan.framework["deepspeed"],
           "largest_layer": session.derived.largest_layer, "params": params,
           "records": [(r.step, r.group, r.collective, r.nbytes, r.end_s >= r.start_s)
                       for r in session.runtime.recorder.records],
           "spy": dict(spy.seen), "steps": len(session.steps), "decomposed": dict(session.router.calls),
           "group_desc": engine.optimizer.dp_process_group.group_desc,
           "group_options": sorted(session.runtime.group_options), "searched_at": searched_at}
    session.close()
    return out


def _expect_error(init: Any, config: dict[str, Any]) -> str:
    import torch.distributed as dist

    from lagom.errors import ConfigError

    before = dist.new_group
    model = _model()
    try:
        init(model=model, model_parameters=model.parameters(), config=config)
    except ConfigError as err:
        assert dist.new_group is before, "a failed start must leave group creation unwrapped"
        return str(err)
    raise AssertionError(f"no error for {config['lagom']}")


def scenarios(rank: int, world: int, tmp: str) -> dict[str, Any]:
    spy = Spy()  # before DeepSpeed's backend is created
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    import lagom_deepspeed
    from lagom.plan.plan import Plan

    hw = f"{tmp}/hw.yaml"
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
        out[f"base{stage}"] = _train(spy, engine, rank)
        section = {"enabled": True, "hardware": hw, "report": f"{tmp}/report{stage}", "plan": f"{tmp}/plan{stage}.json",
                   "cache_dir": f"{tmp}/cache{stage}"}
        # stage 1 goes through patch(): plain deepspeed.initialize honours the section
        if stage == 1:
            lagom_deepspeed.patch()
            groups._WORLD_GROUP = None  # as in a fresh process: DeepSpeed makes its dp group inside the engine
        init = deepspeed.initialize if stage == 1 else lagom_deepspeed.initialize
        out[f"lagom{stage}"] = _lagom_run(spy, rank, stage, section, init)
        lagom_deepspeed.unpatch()

    # enabled: false -> DeepSpeed untouched (the user's bucket size, no session)
    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(2, lagom={"enabled": False, "hardware": "nowhere"}))
    out["disabled"] = {"losses": _train(spy, engine, rank), "has_session": hasattr(engine, "lagom"),
                       "reduce_bucket_size": engine.optimizer.reduce_bucket_size}

    # ZeRO-3 started from a plan edited to decompose every data-parallel collective (Flash-Overlap)
    if rank == 0:
        p2p(Plan.load(f"{tmp}/plan3.json")).save(f"{tmp}/plan3_p2p.json")
    dist.barrier()
    out["flash3"] = _lagom_run(spy, rank, 3, {"enabled": True, "hardware": hw, "plan": f"{tmp}/plan3_p2p.json"},
                               lagom_deepspeed.initialize)

    out["online"] = online(spy, rank, tmp, hw)

    # pipeline engine, 2 stages, 2 micro-batches per step
    model = _model("pipe")
    engine, *_ = lagom_deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(None, gradient_accumulation_steps=2, lagom={"enabled": True, "hardware": hw,
                                                                    "cache_dir": f"{tmp}/pipe-cache"}))
    searched_by_rank0(engine.lagom)  # the plan searched beside the job is adopted at the end of the first step
    losses = _train(spy, engine, 0)
    session = engine.lagom
    out["pipe"] = {"losses": losses, "records": [(r.step, r.group, r.collective, r.nbytes)
                                                 for r in session.runtime.recorder.records],
                   "plan_keys": [e.key for e in session.plan.entries], "spy": dict(spy.seen)}
    session.close()

    # bad sections: each fails in initialize, before an engine exists
    if rank == 0:
        stale = json.loads(Path(f"{tmp}/plan2.json").read_text())
        Path(f"{tmp}/plan_ws4.json").write_text(json.dumps({**stale, "world_size": 4}))
    dist.barrier()
    Path(f"{tmp}/hw8.yaml").write_text("base: a100-8x-100g\n")
    bad = {"unknown_key": {"enabled": True, "hardware": hw, "tune_step": 3},
           "negative_bucket": {"enabled": True, "hardware": hw, "buckets": {"reduce_bucket_size": -1}},
           "unknown_hardware": {"enabled": True, "hardware": "no-such-gpu"},
           "hardware_size": {"enabled": True, "hardware": f"{tmp}/hw8.yaml"},
           "plan_world_size": {"enabled": True, "hardware": hw, "plan": f"{tmp}/plan_ws4.json"}}
    out["errors"] = {name: _expect_error(lagom_deepspeed.initialize, ds_config(2, lagom=sec)) for name, sec in bad.items()}
    return out


def p2p(plan: Any) -> Any:
    """The plan with every data-parallel all-gather and reduce-scatter decomposed (Flash-Overlap)."""
    from dataclasses import replace

    out = copy.deepcopy(plan)
    for e in out.entries:
        if e.collective in ("all_gather", "reduce_scatter"):
            e.config = replace(e.config, decomposition="p2p", num_chunks=2)
    return out


def searched_by_rank0(session: Any) -> None:
    """Rank 0 waits until its search beside the steps is done (its peers wait for it in the next agreement), so
    that the plan is adopted at the next step whatever this machine's speed."""
    import time

    while session._search is not None and not session._search.done:
        time.sleep(0.01)


def online(spy: Spy, rank: int, tmp: str, hw: str) -> dict[str, Any]:
    """ZeRO-3 online: tune after 2 measured steps, switch to Flash-Overlap while running, start again
    from the cache, then slow one step down so the monitor asks for a second tuning round."""
    import time

    import lagom_deepspeed
    from lagom.runtime.online.monitor import Monitor

    section = {"enabled": True, "mode": "online", "hardware": hw, "tune_steps": 2, "cache_dir": f"{tmp}/cache",
               "report": f"{tmp}/online", "monitor_interval": 1}
    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(3, lagom=section))
    session = engine.lagom
    losses = _train(spy, engine, rank, 2)
    searched_by_rank0(session)  # the job's third step takes as long as rank 0's search, which runs beside it
    losses += _train(spy, engine, rank, 1, first=2)
    out: dict[str, Any] = {"source": session.plan_source, "tuned_after_3_steps": len(session.tuned),
                           "events": list(session.events)}
    session.adopt(p2p(session.plan), 3)  # what a tuned plan that decomposes does to the running engine
    losses += _train(spy, engine, rank, STEPS - 3, first=3)
    out |= {"losses": losses, "decomposed": sum(session.router.calls.values()),
            "cache": sorted(p.name for p in Path(f"{tmp}/cache").glob("*.json"))}
    session.close()

    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(3, lagom=section))
    session = engine.lagom
    out["restart_source"] = session.plan_source
    session.monitor = Monitor(1.0, 1.0, threshold=0.1, warmup=1, window=1)  # judge from the second step on
    slow = engine.module.register_forward_pre_hook(lambda *_: time.sleep(1.0) if len(session.steps) == 1 else None)
    _train(spy, engine, rank, 4)
    slow.remove()
    searched_by_rank0(session)
    _train(spy, engine, rank, 1, first=4)
    out |= {"restart_events": list(session.events), "restart_tuned": len(session.tuned)}
    session.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ds")
    (tmp / "hw.yaml").write_text("base: a100-8x-100g\ncluster: {gpus_per_node: 2, nodes: 1}\n")
    return run_ranks(scenarios, 2, str(tmp)) + [{"tmp": tmp}]


def padded(n: int, world: int = 2) -> int:
    return math.ceil(n / world) * world


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_losses_equal_without_section(runs: list, stage: int) -> None:
    for rank in (0, 1):
        assert len(runs[rank][f"base{stage}"]) == STEPS
        assert runs[rank][f"lagom{stage}"]["losses"] == runs[rank][f"base{stage}"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_bucket_sizes_are_the_plans(runs: list, stage: int) -> None:
    r = runs[0][f"lagom{stage}"]
    plan, eff = r["plan"], r["effective"]
    assert eff["reduce_bucket_size"] == plan["reduce_bucket_size"]
    if stage < 3:
        assert eff["allgather_bucket_size"] == plan["allgather_bucket_size"]
        assert eff["overlap_comm"] == plan["overlap_comm"]
    else:
        assert eff["stage3_prefetch_bucket_size"] == plan["stage3_prefetch_bucket_size"]
        # the config said 1000: raised to the prefetch bucket plus the largest module
        assert eff["stage3_max_live_parameters"] == plan["stage3_prefetch_bucket_size"] + r["largest_layer"]
    assert runs[0][f"lagom{stage}"]["plan"] == runs[1][f"lagom{stage}"]["plan"]
    # the plan was searched beside a first engine's steps and adopted by both ranks at one step, then read at this start
    assert runs[0][f"lagom{stage}"]["searched_at"] == runs[1][f"lagom{stage}"]["searched_at"] >= 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backend_saw_every_collective_with_its_bytes(runs: list, stage: int) -> None:
    for rank in (0, 1):
        r = runs[rank][f"lagom{stage}"]
        assert {step for step, *_ in r["records"]} == set(range(STEPS)), "one record set per optimizer step"
        assert all(ok for *_, ok in r["records"])
        seen = Counter((coll, n) for _, group, coll, n, _ in r["records"])
        assert seen == Counter(r["spy"]), "the wrapped backend and torch.distributed disagree"
        assert {group for _, group, *_ in r["records"]} == {"dp"}
        per_step = [(coll, n) for step, _, coll, n, _ in r["records"] if step == 1]
        sizes = r["params"].values()
        if stage < 3:  # gradient buckets (all-reduce), then the flat parameter all-gather
            grads = [n for coll, n in per_step if coll == "all_reduce" and n > 8]
            assert sum(grads) == 4 * sum(sizes)
            assert max(grads) <= 4 * max(r["plan"]["reduce_bucket_size"], max(sizes))
            assert len(grads) >= 2, "the plan's bucket size splits the gradients"
            assert [n for coll, n in per_step if coll == "all_gather"] == [4 * padded(sum(sizes))]
        else:  # per-parameter gathers, bucketed reduce-scatter of padded gradients
            assert sum(n for coll, n in per_step if coll == "reduce_scatter") == 4 * sum(padded(n) for n in sizes)
            gathered = {n for coll, n in per_step if coll == "all_gather"}
            assert gathered <= {4 * padded(n) for n in sizes}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_report_written(runs: list, stage: int) -> None:
    tmp = runs[-1]["tmp"]
    data = json.loads((tmp / f"report{stage}.json").read_text())
    assert data["workload"]["parallel"]["zero_stage"] == stage
    assert data["plan"]["entries"] and data["measured"]
    assert len(data["steps"]) == STEPS
    plan = runs[0][f"lagom{stage}"]["plan"]
    config = ds_config(stage)["zero_optimization"]
    knobs = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm") if stage < 3 else \
        ("reduce_bucket_size", "stage3_prefetch_bucket_size")
    changed = {k for k in knobs if plan[k] != config.get(k, False)} | ({"stage3_max_live_parameters"} if stage == 3 else set())
    assert {c["key"].removeprefix("zero_optimization."): c["after"] for c in data["applied_at_start"]} == \
        {k: v for k, v in runs[0][f"lagom{stage}"]["effective"].items() if k in changed}
    assert data["measured"]["tuned_steps"] == STEPS and data["measured"]["tuned_step_ms"] > 0
    assert data["predicted"]["gain"] == pytest.approx(plan_gain(data["plan"]))
    md = (tmp / f"report{stage}.md").read_text()
    assert "## Applied at start-up" in md
    assert all(f"zero_optimization.{key}" in md for key in changed)


def plan_gain(plan: dict[str, Any]) -> float:
    return plan["predicted_step_s"]["nccl"] / plan["predicted_step_s"][plan["strategy"]]


def test_dp_group_created_under_its_lagom_name(runs: list) -> None:
    for rank in (0, 1):
        r = runs[rank]["lagom1"]
        assert r["group_desc"] == "dp"
        assert r["group_options"] == ["dp"], "the plan's NCCL options were built for it (passed on NCCL only)"


def test_disabled_section_is_plain_deepspeed(runs: list) -> None:
    for rank in (0, 1):
        d = runs[rank]["disabled"]
        assert not d["has_session"]
        assert d["reduce_bucket_size"] == BUCKET
        assert d["losses"] == runs[rank]["base2"]


def test_zero3_flash_overlap_decomposition(runs: list) -> None:
    for rank in (0, 1):
        r = runs[rank]["flash3"]
        assert r["losses"] == runs[rank]["base3"]
        assert r["decomposed"] and all(n > 0 for n in r["decomposed"].values())
        spy = Counter(r["spy"])
        assert not [k for k in spy if k[0] in ("all_gather", "reduce_scatter")], "no collective left for ZeRO-3 buckets"
        assert sum(n for k, n in spy.items() if k[0] == "p2p") > 0
        recorded = Counter(coll for _, _, coll, _, _ in r["records"])
        assert recorded["all_gather"] > 0 and recorded["reduce_scatter"] > 0


def test_pipeline_send_recv_recorded(runs: list) -> None:
    act = 2 * 16 * 32 * 4  # micro-batch x seq x hidden x fp32: one activation (or its gradient)
    for rank in (0, 1):
        p = runs[rank]["pipe"]
        assert len(p["losses"]) == STEPS and all(math.isfinite(x) for x in p["losses"])
        assert f"pp/send_recv/{act}" in p["plan_keys"]
        for step in range(1, STEPS):  # step 0 also carries the pipeline's one-off shape messages
            rec = Counter((g, c, n) for s, g, c, n in p["records"] if s == step)
            assert rec[("pp", "send_recv", act)] == 2, "2 micro-batches: activations out or gradients back"
            assert rec[("pp", "recv", act)] == 2
        sends = Counter((c, n) for _, g, c, n in p["records"] if g == "pp" and c in ("send_recv", "recv"))
        assert all(Counter(p["spy"])[k] == v for k, v in sends.items())


@pytest.mark.parametrize("case,key", [
    ("unknown_key", "lagom.tune_step: unknown key"),
    ("negative_bucket", "lagom.buckets.reduce_bucket_size"),
    ("unknown_hardware", "lagom.hardware: unknown hardware 'no-such-gpu'"),
    ("hardware_size", "lagom.hardware: 'a100-8x-100g' describes 8 GPUs"),
    ("plan_world_size", "plan.world_size: plan was made for 4 ranks, this job has 2"),
])
def test_bad_sections_fail_before_training(runs: list, case: str, key: str) -> None:
    for rank in (0, 1):
        assert key in runs[rank]["errors"][case]


def test_online_tunes_applies_at_runtime_and_caches(runs: list) -> None:
    for rank in (0, 1):
        o = runs[rank]["online"]
        assert o["source"].startswith("none at start-up"), "no search before the job starts"
        assert o["tuned_after_3_steps"] == 1
        assert any("Applied now:" in e and "On the next start" in e for e in o["events"])
        assert o["losses"] == runs[rank]["base3"], "switching to Flash-Overlap mid-run keeps the numerics"
        assert o["decomposed"] > 0
        assert len(o["cache"]) == 1
        assert o["restart_source"].startswith("tuned by an earlier online run")
        assert any("re-tuning" in e for e in o["restart_events"])
        assert o["restart_tuned"] == 1, "the monitor's drift started a second tuning round, which finished"
    report = json.loads((runs[-1]["tmp"] / "online.json").read_text())
    assert report["mode"] == "online" and report["events"]
