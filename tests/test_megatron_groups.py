"""Group names on real megatron-core parallel_state (gloo): groups are named by identity, so the size-1
groups of a rank (which all hold the same rank list) get their own names and are marked trivial."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.test_megatron_ddp import cpu_megatron


def names_rank(rank: int, world: int, tps: tuple[int, ...]) -> dict[int, dict]:
    """The names of megatron's groups under each tensor-parallel size in turn (one spawn, one import)."""
    cpu_megatron()
    return {tp: names_for(rank, world, tp) for tp in tps}


def names_for(rank: int, world: int, tp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lagom_megatron.groups import GroupNames

    ps.initialize_model_parallel(tp, 1)
    names = GroupNames()
    groups = {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group(),
              "dp_cp": ps.get_data_parallel_group(with_context_parallel=True), "pp": ps.get_pipeline_model_parallel_group(),
              "cp": ps.get_context_parallel_group(), "expt_dp": ps.get_expert_data_parallel_group(),
              "other_world": dist.new_group(list(range(world))), "other_self": dist.new_group([rank])}
    out = {label: [names.name(g), names.trivial(g)] for label, g in groups.items()}
    out["cached"] = names.name(groups["dp"]) == out["dp"][0]
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[int, dict]]:
    """Two ranks, first with tp = 2 (trivial dp), then with tp = 1 (dp over both)."""
    return run_ranks(names_rank, 2, (2, 1))


@pytest.mark.slow  # a megatron-core world of one rank, spawned on its own: CI's slower tier
def test_one_rank_names_every_size_one_group_by_identity() -> None:
    (by_tp,) = run_ranks(names_rank, 1, (1,))
    out = by_tp[1]
    assert out["dp"] == ["dp", True]  # matched by ranks it was tp/... (every group here is [0])
    assert out["dp_cp"] == ["dp", True]  # cp = 1: the plan's dp
    assert (out["tp"], out["pp"], out["cp"], out["expt_dp"]) == (["tp", True], ["pp", True], ["cp", True],
                                                                 ["expt_dp", True])
    assert out["other_self"] == ["ranks0", True] and out["cached"]


def test_two_ranks_tensor_parallel_names_and_trivial_data_parallel(two_ranks: list[dict[int, dict]]) -> None:
    for rank, by_tp in enumerate(two_ranks):
        out = by_tp[2]
        assert out["tp"] == ["tp", False]
        assert out["dp"] == ["dp", True] and out["dp_cp"] == ["dp", True] and out["pp"] == ["pp", True]
        assert out["other_world"] == ["tp", False]  # not megatron's: named by its ranks, first match
        assert out["other_self"] == [f"ranks{rank}", True]


def test_two_ranks_data_parallel_is_not_trivial(two_ranks: list[dict[int, dict]]) -> None:
    for by_tp in two_ranks:
        out = by_tp[1]
        assert out["dp"] == ["dp", False] and out["dp_cp"] == ["dp", False]
        assert out["tp"] == ["tp", True] and out["other_world"] == ["dp", False]
