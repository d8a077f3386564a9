"""Names of Megatron's process groups, as Lagom's plans call them (tp, dp, pp, cp, dp_cp, ep, expt_dp).

An intercepted collective carries a ProcessGroup object; the recorder and the plan want a name. A
group is named by identity first: the parallel_state global that holds this very object. Groups of
one rank all hold the same rank list, so only identity tells them apart; they carry no
communication and are ``trivial`` (nothing to record or plan). A group megatron does not hold
(one built elsewhere over the same ranks) is named by its ranks, first match in the order below.
With context parallel of size 1 the data-parallel group with context parallel (the group DDP
reduces over) holds the same ranks as the data-parallel group, and the plan calls both ``dp``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# (Lagom name, parallel_state module global), in the order ties are broken.
_GROUPS: tuple[tuple[str, str], ...] = (
    ("tp", "_TENSOR_MODEL_PARALLEL_GROUP"),
    ("dp", "_DATA_PARALLEL_GROUP"),
    ("cp", "_CONTEXT_PARALLEL_GROUP"),
    ("dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP"),
    ("dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"),
    ("pp", "_PIPELINE_MODEL_PARALLEL_GROUP"),
    ("ep", "_EXPERT_MODEL_PARALLEL_GROUP"),
    ("expt_dp", "_EXPERT_DATA_PARALLEL_GROUP"),
    ("expt_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"),
    ("tp_cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP"),
    ("tp_dp", "_TENSOR_AND_DATA_PARALLEL_GROUP"),
    ("tp_dp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"),
    ("mp", "_MODEL_PARALLEL_GROUP"),
    ("embd", "_EMBEDDING_GROUP"),
    ("pos_embd", "_POSITION_EMBEDDING_GROUP"),
)


def megatron_pg_names(lagom_name: str, cp: int) -> tuple[str, ...]:
    """The ``pg_name`` keys megatron's get_nccl_options is asked for that a plan group covers.

    With cp == 1 the data-parallel groups with and without context parallel hold the same ranks,
    and DDP reduces over the former; the plan, which knows no cp, calls both ``dp``.
    """
    names = {"dp": ("dp", "dp_cp", "intra_dp_cp") if cp == 1 else ("dp",),
             "dp_cp": ("dp_cp", "intra_dp_cp"), "expt_dp": ("ep_dp", "intra_ep_dp")}
    return names.get(lagom_name, (lagom_name,))


def _holds(known: Any, group: Any) -> bool:
    """Whether a parallel_state global (a group, a list of groups, or None) is or contains ``group``."""
    if isinstance(known, list):
        return any(candidate is group for candidate in known)
    return known is group


def _plan_name(name: str, cp: int) -> str:
    return "dp" if name == "dp_cp" and cp == 1 else name


class GroupNames:
    """Resolves ProcessGroup objects to names, once per group (the lookup reads megatron's globals)."""

    def __init__(self) -> None:
        # id -> (group kept alive so the id stays unique, name, trivial)
        self._cache: dict[int, tuple[Any, str, bool]] = {}

    def name(self, group: Any) -> str:
        return self._lookup(group)[0]

    def trivial(self, group: Any) -> bool:
        """A group of one rank: its collectives move no data, so they are neither recorded nor planned."""
        return self._lookup(group)[1]

    def _lookup(self, group: Any) -> tuple[str, bool]:
        if group is None or group is dist.group.WORLD:
            return "world", dist.get_world_size() == 1
        hit = self._cache.get(id(group))
        if hit is None:
            hit = (group, self._resolve(group), len(dist.get_process_group_ranks(group)) == 1)
            self._cache[id(group)] = hit
        return hit[1], hit[2]

    @staticmethod
    def _resolve(group: Any) -> str:
        from megatron.core import parallel_state

        cp_group = getattr(parallel_state, "_CONTEXT_PARALLEL_GROUP", None)
        cp = cp_group.size() if cp_group is not None and not isinstance(cp_group, list) else 1
        for name, attr in _GROUPS:
            if _holds(getattr(parallel_state, attr, None), group):
                return _plan_name(name, cp)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) > 1:
            for name, attr in _GROUPS:
                known = getattr(parallel_state, attr, None)
                if known is not None and not isinstance(known, list) and dist.get_process_group_ranks(known) == ranks:
                    return name
            if ranks == list(range(dist.get_world_size())):
                return "world"
        return f"ranks{'-'.join(map(str, ranks))}"
