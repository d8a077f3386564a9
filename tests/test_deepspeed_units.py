"""The DeepSpeed adapter's parts that need no process group: the section, the workload read off a
model, the knobs written into the engine's config, what a new plan changes now or at restart."""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lagom.comm_config import CommConfig  # noqa: E402
from lagom.errors import ConfigError  # noqa: E402
from lagom.plan import Plan, PlanEntry  # noqa: E402
from lagom_deepspeed import initialize  # noqa: E402
from lagom_deepspeed.config import BucketPins, parse_section  # noqa: E402
from lagom_deepspeed.groups import GroupNames  # noqa: E402
from lagom_deepspeed.planning import engine_config  # noqa: E402
from lagom_deepspeed.session import plan_changes  # noqa: E402
from lagom_deepspeed.workload import apply_overrides, derive  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "deepspeed"))
from tiny_gpt import TinyGPT  # noqa: E402


@pytest.mark.parametrize("section,message", [
    ({"enabled": True, "hardware": "x", "bogus": 1}, "lagom.bogus: unknown key (known keys here: enabled, mode"),
    ({"enabled": True}, "lagom.hardware: is required when enabled"),
    ({"enabled": True, "hardware": "x", "tune_steps": 0}, "lagom.tune_steps: Input should be greater than 0, got 0"),
    ({"enabled": True, "hardware": "x", "mode": "fast"}, "lagom.mode: Input should be 'offline' or 'online', got 'fast'"),
    ({"enabled": True, "hardware": "x", "strategy": "best"}, "lagom.strategy: unknown strategy 'best'; use one of"),
    ({"enabled": True, "hardware": "x", "buckets": {"reduce_bucket_size": -5}},
     "lagom.buckets.reduce_bucket_size: Input should be greater than 0, got -5"),
    ({"enabled": True, "hardware": "x", "flash_overlap": {"chunks": 2}}, "lagom.flash_overlap.chunks: unknown key"),
    ({"enabled": "sometimes", "hardware": "x"}, "lagom.enabled: Input should be a valid boolean"),
    ({"enabled": True, "hardware": "x", "retune_threshold": 1.5}, "lagom.retune_threshold: Input should be less than 1"),
])
def test_bad_section_names_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_section({"lagom": section})
    assert str(err.value).startswith(message)


def test_section_defaults_and_auto() -> None:
    assert parse_section({"train_batch_size": 8}) is None
    s = parse_section({"lagom": {"enabled": True, "hardware": "a100-8x-100g",
                                 "buckets": {"reduce_bucket_size": "auto", "allgather_bucket_size": 1000}}})
    assert s is not None and s.mode == "offline" and s.tune_steps == 5 and s.flash_overlap.enabled
    assert s.buckets == BucketPins(allgather_bucket_size=1000)  # "auto": DeepSpeed's convention for "decide for me"


def test_initialize_has_deepspeeds_signature() -> None:
    import inspect

    import deepspeed

    import lagom_deepspeed

    ours, theirs = inspect.signature(initialize), inspect.signature(lagom_deepspeed._deepspeed_initialize)
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
        [(p.name, p.default, p.kind) for p in theirs.parameters.values()]
    lagom_deepspeed.patch()
    try:
        assert deepspeed.initialize is initialize
    finally:
        lagom_deepspeed.unpatch()
    assert deepspeed.initialize is lagom_deepspeed._deepspeed_initialize


@pytest.mark.parametrize("config", [{"train_batch_size": 2}, {"train_batch_size": 2, "lagom": {"enabled": False}}])
def test_without_an_enabled_section_deepspeed_gets_the_call_untouched(monkeypatch: pytest.MonkeyPatch,
                                                                       config: dict) -> None:
    import lagom_deepspeed

    seen: dict = {}
    monkeypatch.setattr(lagom_deepspeed, "_deepspeed_initialize", lambda **kw: seen.update(kw) or ("engine",))
    model, args = nn.Linear(2, 2), object()
    assert initialize(args=args, model=model, config=config, distributed_port=1234) == ("engine",)
    assert seen["model"] is model and seen["args"] is args and seen["config"] is config
    assert seen["distributed_port"] == 1234 and seen["mpu"] is None


def test_initialize_rejects_a_bad_section_before_distributed_starts() -> None:
    import torch.distributed as dist

    with pytest.raises(ConfigError, match="lagom.tune_steps"):
        initialize(model=nn.Linear(2, 2), config={"train_batch_size": 2, "lagom": {"enabled": True, "hardware": "x",
                                                                                  "tune_steps": -1}})
    assert not dist.is_initialized()


def test_workload_from_tiny_gpt() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "communication_data_type": "fp32", "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 7e6}}
    d = derive(TinyGPT(), cfg, world_size=1)
    m, t, p, f = d.workload.model, d.workload.training, d.workload.parallel, d.workload.framework
    assert (m.layers, m.hidden, m.heads, m.ffn, m.seq_len, m.vocab, m.gated_mlp) == (2, 32, 2, 128, 16, 64, False)
    assert (t.micro_batch, t.global_batch, t.dtype, t.grad_dtype) == (2, 8, "bf16", "fp32")
    assert (p.dp, p.zero_stage, p.fsdp) == (1, 3, True)
    assert (f.prefetch_bucket_size, f.reduce_bucket_size, f.overlap_comm) == (7_000_000, 500_000_000, True)
    assert d.model_params == sum(q.numel() for q in TinyGPT().parameters())
    assert d.largest_layer == sum(q.numel() for q in TinyGPT().blocks[0].parameters())
    assert any("seq_len=16 from the position table" in n for n in d.notes)


class _Config:
    hidden_size, num_attention_heads, num_key_value_heads, intermediate_size = 64, 8, 2, 96
    vocab_size, max_position_embeddings, num_hidden_layers = 100, 128, 3


class _LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(64, 64), nn.Linear(64, 64)
        self.gate, self.up, self.down = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)


class _Llama(nn.Module):
    def __init__(self, config: bool = True) -> None:
        super().__init__()
        if config:
            self.config = _Config()
        self.embed = nn.Embedding(100, 64)
        self.layers = nn.ModuleList(_LlamaBlock() for _ in range(3))


def test_workload_prefers_model_config_and_sees_gated_mlp() -> None:
    d = derive(_Llama(), {"train_batch_size": 4}, world_size=2)
    m = d.workload.model
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.seq_len, m.gated_mlp) == (3, 64, 8, 2, 96, 128, True)
    assert d.workload.training.micro_batch == 2 and d.workload.parallel.dp == 2


def test_workload_asks_for_what_it_cannot_infer() -> None:
    with pytest.raises(ConfigError, match=r"lagom.workload.model.seq_len: cannot be inferred.*\"seq_len\": N"):
        derive(_Llama(config=False), {"train_batch_size": 4}, world_size=1)


def test_workload_overrides_are_strict() -> None:
    d = derive(TinyGPT(), {"train_batch_size": 2}, world_size=1)
    assert apply_overrides(d, {"model": {"seq_len": 8}}, 1).workload.model.seq_len == 8
    with pytest.raises(ConfigError, match="lagom.workload.model.seq_length"):
        apply_overrides(d, {"model": {"seq_length": 8}}, 1)
    with pytest.raises(ConfigError, match="lagom.workload: parallel"):
        apply_overrides(d, None, 4)  # the model was derived for 1 rank


def _plan(framework: dict, entries: list[PlanEntry] | None = None) -> Plan:
    return Plan("w", "f", "hw", "h", 2, "lagom", entries or [], {"nccl": 1.0}, framework={"deepspeed": framework})


KNOBS = {"reduce_bucket_size": 2000, "allgather_bucket_size": 3000, "stage3_prefetch_bucket_size": 5000,
         "overlap_comm": True}


@pytest.mark.parametrize("stage,expected,changed", [
    (1, {"stage": 1, "prefetch_bucket_size": 10, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000,
         "overlap_comm": True}, {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm"}),
    (3, {"stage": 3, "reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 5000,
         "stage3_max_live_parameters": 1_000_000_000, "overlap_comm": True},
     {"reduce_bucket_size", "stage3_prefetch_bucket_size"}),  # overlap_comm: ZeRO-3's default already
])
def test_engine_config_writes_what_the_stage_reads(stage: int, expected: dict, changed: set) -> None:
    user = {"zero_optimization": {"stage": stage, "prefetch_bucket_size": 10}}
    before = copy.deepcopy(user)
    cfg, changes = engine_config(user, _plan(KNOBS), BucketPins(), largest_layer=100)
    # stage 1 leaves the knob it does not read alone; stage 3 keeps one spelling of it, and
    # DeepSpeed's default max-live (above what the prefetch needs)
    assert cfg["zero_optimization"] == expected
    assert user == before
    assert {c.key for c in changes} == changed


def test_engine_config_pins_and_raises_max_live() -> None:
    user = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000}}
    cfg, changes = engine_config(user, _plan(KNOBS), BucketPins(reduce_bucket_size=777), largest_layer=100)
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == 777
    assert z["stage3_max_live_parameters"] == 5000 + 100  # the prefetch bucket beside the largest module
    why = {c.key: c.why for c in changes}
    assert why["reduce_bucket_size"] == "pinned in lagom.buckets"
    high = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10**9}}
    assert engine_config(high, _plan(KNOBS), BucketPins(), 100)[0]["zero_optimization"]["stage3_max_live_parameters"] == 10**9


def test_plan_changes_split_now_and_next_start() -> None:
    def entry(coll: str, cfg: CommConfig) -> PlanEntry:
        return PlanEntry(f"dp/{coll}/64", "dp", 2, 1, coll, 64, 1, [], cfg)

    base = CommConfig()
    old = _plan(KNOBS, [entry("all_gather", base), entry("all_reduce", base)])
    new = _plan({**KNOBS, "reduce_bucket_size": 4000},
                [entry("all_gather", replace(base, decomposition="p2p", num_chunks=2, channels=4)),
                 entry("all_reduce", replace(base, channels=2))])
    now, later = plan_changes(old, new)
    assert now == ["dp/all_gather/64 decomposition collective -> p2p", "dp/all_gather/64 num_chunks 1 -> 2"]
    assert later == ["dp/all_gather/64 channels 8 -> 4", "dp/all_reduce/64 channels 8 -> 2",
                     "zero_optimization.reduce_bucket_size 2000 -> 4000"]


def test_group_names_from_pipeline_topology() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class Pipe(nn.Module):
        num_stages = 2

        def topology(self) -> PipeModelDataParallelTopology:
            return PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)

    names = GroupNames.for_job(Pipe(), None, 4)
    assert names.name_of_ranks((0, 2)) == "pp" and names.name_of_ranks((0, 1)) == "dp"
    assert names.name_of_ranks((0, 1, 2, 3)) == "world" and names.p2p == "pp"
    assert GroupNames.for_job(TinyGPT(), None, 4).name_of_ranks((0, 1, 2, 3)) == "dp"
