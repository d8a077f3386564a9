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

from lagom.errors import ConfigError
from lagom.plan.plan import Plan, PlanEntry
from lagom.step.points import rank_params
from lagom_deepspeed import initialize
from lagom_deepspeed.config import BucketPins, parse_section
from lagom_deepspeed.groups import GroupNames
from lagom_deepspeed.planning import engine_config
from lagom_deepspeed.workload import describe, zero_knobs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "deepspeed"))
from tiny_gpt import TinyGPT


@pytest.mark.parametrize("section,message", [
    ({"enabled": True, "hardware": "x", "bogus": 1}, "lagom.bogus: unknown key (known keys here: enabled, mode"),
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
    assert s is not None and s.mode == "offline" and s.tune_steps == 60 and s.tune_seconds == 300 and s.flash_overlap.enabled
    assert s.buckets == BucketPins(allgather_bucket_size=1000)  # "auto": DeepSpeed's convention for "decide for me"


def test_minimal_section_parses_without_hardware() -> None:
    s = parse_section({"lagom": {"enabled": True}})
    assert s is not None and s.enabled and s.hardware is None and s.cache_dir == ".lagom-cache"


PIN_VALUES = [0, 1, -1, 5e8, 5.5, "auto", "500", True, None]


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "overlap_comm"])
def test_bucket_pins_accept_what_deepspeed_accepts(key: str) -> None:
    """Every value is judged by DeepSpeed's own zero_optimization model and by the pins alike; an
    accepted value is read as the same number (None is the pins' "unset" and not a DeepSpeed value)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    field = DeepSpeedZeroConfig.model_fields[key.removeprefix("stage3_")].alias or key
    for value in PIN_VALUES:
        if value is None:
            assert getattr(BucketPins(**{key: None}), key) is None
            continue
        try:
            theirs = getattr(DeepSpeedZeroConfig(**{field: value}), key.removeprefix("stage3_"))
        except ValidationError:
            theirs = "refused"
        try:
            ours = getattr(BucketPins(**{key: value}), key)
        except ValidationError:
            ours = "refused"
        if value == "auto":  # DeepSpeed falls back to its default, the pins to "the plan decides"
            assert ours is None and theirs != "refused"
        else:
            assert ours == theirs, f"{key}={value!r}: DeepSpeed {theirs!r}, lagom {ours!r}"
    zero_prefetch = parse_section({"lagom": {"enabled": True, "buckets": {"stage3_prefetch_bucket_size": 0}}})
    assert zero_prefetch is not None and zero_prefetch.buckets.stage3_prefetch_bucket_size == 0


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
    d = describe(TinyGPT(), cfg, world_size=1)
    assert d.workload is not None and not d.missing
    m, t, p, f = d.workload.model, d.workload.training, d.workload.parallel, d.workload.framework
    assert (m.layers, m.hidden, m.heads, m.ffn, m.seq_len, m.vocab, m.gated_mlp) == (2, 32, 2, 128, 16, 64, False)
    assert (t.micro_batch, t.global_batch, t.dtype, t.grad_dtype) == (2, 8, "bf16", "fp32")
    assert (p.dp, p.zero_stage, p.fsdp) == (1, 3, True)
    assert (f.prefetch_bucket_size, f.reduce_bucket_size, f.overlap_comm) == (7_000_000, 500_000_000, True)
    assert d.model_params == sum(q.numel() for q in TinyGPT().parameters())
    assert d.largest_layer == sum(q.numel() for q in TinyGPT().blocks[0].parameters())
    assert any("seq_len=16 from the position table" in n for n in d.notes)


def test_implied_params_is_the_step_graphs_count() -> None:
    """2 layers x (attention 4 x 32^2 with 2 heads of 16, MLP 2 x 32 x 128, 4 x 32 norm weights) plus
    a 64 x 32 embedding; with tp = 2 a rank holds half of every matrix and all the norm weights."""
    d = describe(TinyGPT(), {"train_micro_batch_size_per_gpu": 2}, world_size=1)
    assert d.workload is not None
    per_layer = 32 * (32 + 2 * 2 * 16) + 32 * 32 + 32 * 128 * 2 + 4 * 32
    assert d.implied_params == rank_params(d.workload) == 2 * per_layer + 64 * 32
    sharded = replace(d.workload, parallel=replace(d.workload.parallel, tp=2, dp=1))
    assert rank_params(sharded) == 2 * ((per_layer - 4 * 32) // 2 + 4 * 32) + 64 * 32 // 2


def test_zero_knobs_are_deepspeeds_reading_and_lagoms_defaults_agree() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from lagom.step.workload import Framework

    defaults = zero_knobs({})
    ds = DeepSpeedZeroConfig()
    assert defaults == {"stage": 0, "reduce_bucket_size": ds.reduce_bucket_size,
                        "allgather_bucket_size": ds.allgather_bucket_size,
                        "stage3_prefetch_bucket_size": ds.prefetch_bucket_size,
                        "stage3_max_live_parameters": ds.max_live_parameters, "overlap_comm": False}
    lagom = Framework()  # what a workload file leaves out: must be what DeepSpeed does when the config does
    assert (lagom.reduce_bucket_size, lagom.allgather_bucket_size, lagom.prefetch_bucket_size) == \
        (ds.reduce_bucket_size, ds.allgather_bucket_size, ds.prefetch_bucket_size)
    knobs = zero_knobs({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": 5e6,
                                              "stage3_max_live_parameters": 0}})
    assert knobs == {"stage": 3, "reduce_bucket_size": ds.reduce_bucket_size, "allgather_bucket_size":
                     ds.allgather_bucket_size, "stage3_prefetch_bucket_size": 5_000_000,
                     "stage3_max_live_parameters": 0, "overlap_comm": True}


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
    d = describe(_Llama(), {"train_batch_size": 4, "gradient_accumulation_steps": 2}, world_size=1)
    assert d.workload is not None
    m = d.workload.model
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.seq_len, m.gated_mlp) == (3, 64, 8, 2, 96, 128, True)
    assert (d.workload.training.micro_batch, d.workload.training.global_batch) == (2, 4)  # DeepSpeed's batch rule


def test_what_cannot_be_inferred_falls_back_with_the_fields_to_set() -> None:
    d = describe(_Llama(config=False), {"train_batch_size": 4}, world_size=1)
    assert d.workload is None and d.missing == ["model.seq_len"]
    assert d.model_params == sum(q.numel() for q in _Llama(config=False).parameters())
    assert '"lagom": {"workload": {"model": {"seq_len": N}}}' in d.warning()


class _Small(nn.Module):
    """DeepSpeed's unit tests' kind of model: Linear layers, no embedding, no repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])


class _Embedded(nn.Module):
    """A token model too small to have repeated blocks: its layer count cannot be inferred."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 50)


@pytest.mark.parametrize("model,missing", [
    (_Small, ["model.layers", "model.vocab", "model.hidden", "model.seq_len"]),
    (_Embedded, ["model.layers", "model.seq_len"]),
])
def test_small_models_fall_back(model: type, missing: list[str]) -> None:
    d = describe(model(), {"train_micro_batch_size_per_gpu": 1}, world_size=1)
    assert d.workload is None and d.missing == missing and d.implied_params == 0
    names = ", ".join(f'"{k.removeprefix("model.")}": N' for k in missing)
    assert f'"lagom": {{"workload": {{"model": {{{names}}}}}}}' in d.warning()


def test_overrides_are_applied_before_inference() -> None:
    given = {"model": {"layers": 2, "vocab": 50, "hidden": 16, "seq_len": 32, "heads": 2}}
    d = describe(_Embedded(), {"train_micro_batch_size_per_gpu": 1}, world_size=1, overrides=given)
    assert d.workload is not None
    m = d.workload.model
    assert (m.layers, m.vocab, m.hidden, m.seq_len, m.heads, m.ffn) == (2, 50, 16, 32, 2, 64)
    assert any("model.ffn=64 assumed" in n for n in d.notes)  # not given: inferred around the given hidden
    d = describe(_Llama(config=False), {"train_batch_size": 4}, world_size=1, overrides={"model": {"seq_len": 64}})
    assert d.workload is not None and d.workload.model.seq_len == 64 and d.workload.model.layers == 3
    small = describe(_Small(), {"train_micro_batch_size_per_gpu": 1}, world_size=1,
                     overrides={"model": {"layers": 2, "vocab": 8, "hidden": 8, "seq_len": 4, "heads": 1}})
    assert small.workload is not None and small.workload.model.layers == 2


def test_overrides_are_strict() -> None:
    cfg = {"train_batch_size": 2}
    with pytest.raises(ConfigError, match="lagom.workload.model.seq_length"):
        describe(TinyGPT(), cfg, 1, overrides={"model": {"seq_length": 8}})
    with pytest.raises(ConfigError, match="lagom.workload.model.layers"):
        describe(TinyGPT(), cfg, 1, overrides={"model": {"layers": "many"}})
    with pytest.raises(ConfigError, match="lagom.workload.model.heads: heads=5 does not divide hidden=32"):
        describe(TinyGPT(), cfg, 1, overrides={"model": {"heads": 5}})  # the user's own value: their error
    with pytest.raises(ConfigError, match="lagom.workload: workload: file nowhere.yaml does not exist"):
        describe(TinyGPT(), cfg, 1, overrides="nowhere.yaml")
    assert describe(TinyGPT(), cfg, 1, overrides={"model": {"seq_len": 8}}).workload.model.seq_len == 8


def test_a_shape_inferred_wrongly_falls_back() -> None:
    class Odd(nn.Module):
        """3 heads do not divide 32 channels: the attention attribute is read, the check refuses it."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = TinyGPT().embed
            self.blocks = TinyGPT().blocks
            self.num_heads = 3

    cfg = {"train_batch_size": 2}
    d = describe(Odd(), cfg, 1)
    assert d.workload is None and d.missing == ["model.heads"] and "heads=3 does not divide hidden=32" in d.why
    assert describe(Odd(), cfg, 1, overrides={"model": {"heads": 2}}).workload is not None


@pytest.mark.parametrize("zero", [
    {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": 5e8},
    {"stage": 2, "allgather_bucket_size": 5e8, "reduce_bucket_size": "auto"},
    {"stage": 3, "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 1e6},
])
def test_values_deepspeed_accepts_are_read_as_deepspeed_reads_them(zero: dict) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    d = describe(TinyGPT(), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, 1)
    ds = DeepSpeedZeroConfig(**zero)
    assert d.workload is not None
    f = d.workload.framework
    assert (f.reduce_bucket_size, f.allgather_bucket_size, f.prefetch_bucket_size, f.overlap_comm) == \
        (ds.reduce_bucket_size, ds.allgather_bucket_size, ds.prefetch_bucket_size, ds.overlap_comm)


def test_zero_prefetch_does_not_fail_the_job() -> None:
    """stage3_prefetch_bucket_size 0 (prefetching off) is valid DeepSpeed: describing never raises."""
    d = describe(TinyGPT(), {"train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}, 1)
    assert d.workload is not None or "prefetch_bucket_size" in d.why


def test_zero_prefetch_is_planned_for() -> None:
    d = describe(TinyGPT(), {"train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}, 1)
    assert d.workload is not None and d.workload.framework.prefetch_bucket_size == 0


def test_a_config_deepspeed_refuses_is_left_to_deepspeed() -> None:
    d = describe(TinyGPT(), {"gradient_accumulation_steps": 2}, 1)  # no batch size: DeepSpeed asserts
    assert d.workload is None and d.missing == []
    assert "DeepSpeed refuses its config (Either train_batch_size or train_micro_batch_size_per_gpu" in d.why


def test_mixture_of_experts_asks_for_its_experts() -> None:
    from deepspeed.moe.layer import MoE

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = TinyGPT().embed
            self.blocks = TinyGPT().blocks
            self.moe = MoE(32, nn.Linear(32, 32), num_experts=2, k=1)

    d = describe(Moe(), {"train_batch_size": 2}, 1)
    assert d.workload is None and d.missing == ["model.architecture"]
    assert '"model": {"architecture": "moe", "experts": N, "top_k": N, "moe_ffn": N}' in d.warning()


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
