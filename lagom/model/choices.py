"""What NCCL itself would run, priced by the cost model: its own algorithm and protocol for a call
(``nccl_choice``), the settings a plan can choose between for one point (``candidates``: without the tuner plugin
NCCL keeps its pick), and a config as it runs under the process's values (``under_process``). These need the cost
model, so they sit above it; the settings themselves are ``lagom.plan.comm_config``'s.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Any

from lagom.hardware import Hardware
from lagom.plan.capability import Capability, Scope
from lagom.plan.comm_config import (
    Algorithm,
    CommConfig,
    CTAPolicy,
    Decomposition,
    ProcessSettings,
    Protocol,
    SearchSpace,
    Transport,
    can_decompose,
    channel_choices,
    channels_for,
    chunk_choices,
    default_config,
    space_capability,
    subspaces,
    transports_for,
    tuner_sets_channels,
    with_process,
)
from lagom.step.graph import OverlapPoint


def nccl_choice(point: OverlapPoint, hw: Hardware, base: CommConfig, model: Any = None) -> CommConfig:
    """``base`` with the algorithm and protocol NCCL's own tuning picks for this point (by the cost model, less
    what NCCL's tuning does not know: ``CostModel.as_nccl_tunes``); NVLS on NCCL's own NVLS CTAs."""
    from lagom.model.cost_model import CostModel  # the model imports this module

    model = (model if model is not None else CostModel(hw)).as_nccl_tunes
    options = {(a, pr): replace(base, algorithm=a, protocol=pr,
                                channels=hw.nccl.nvls_channels if a == Algorithm.NVLS else base.channels)
               for a, pr, _ in subspaces(point, hw, replace(SearchSpace(), transports=(str(base.transport),)))}
    return min(options.values(), key=lambda c: model.comm_time(point.collective, point.group, point.bytes, c))


def settable_subspaces(point: OverlapPoint, hw: Hardware,
                       space: SearchSpace = SearchSpace()) -> list[tuple[Algorithm, Protocol, Transport]]:
    """The subspaces a plan can choose between: all of them with the tuner plugin; without it, per
    transport, the algorithm and protocol NCCL picks itself."""
    if space_capability(space, hw).per_size:
        return subspaces(point, hw, space)
    return list(dict.fromkeys((*nccl_pick(point, hw, transport), transport) for transport in transports_for(point, hw, space)))


def nccl_pick(point: OverlapPoint, hw: Hardware, transport: Transport) -> tuple[Algorithm, Protocol]:
    """The algorithm and protocol NCCL picks for a point on a transport when nothing sets them."""
    chosen = nccl_choice(point, hw, replace(default_config(hw), transport=transport))
    return chosen.algorithm, chosen.protocol


def candidates(point: OverlapPoint, hw: Hardware, space: SearchSpace = SearchSpace()) -> list[CommConfig]:
    """Every setting of the space for one point that the space's capability can apply.

    Without the tuner plugin NCCL picks algorithm and protocol itself (``nccl_choice``); an NVLS
    config's channels are the communicator's NVLS CTAs; the ZERO CTA policy runs the collective on
    copy engines, so it has no channels to choose; Flash-Overlap decompositions are per point.
    """
    cap = space_capability(space, hw)
    combos = settable_subspaces(point, hw, space)
    policies = [CTAPolicy(p) for p in space.cta_policies if p != CTAPolicy.ZERO]
    out = []
    for algo, proto, transport in combos:
        tuned = tuner_sets_channels(point, CommConfig(algo, proto), cap)
        out += [CommConfig(algo, proto, transport, nc, nt, chunk, prio, cta_policy=policy, by_tuner=tuned)
                for nc, nt, chunk, prio, policy in product(channels_for(algo, hw, space), space.threads,
                                                           chunk_choices(point, algo, proto, hw, space),
                                                           space.priorities, policies)]
    base = default_config(hw)
    # copy engines and P2P steps ask NCCL for no chunk: one value (the process's where it is per process)
    inert_chunk = space.chunks[0] if cap.scope("chunk") == Scope.PER_PROCESS else base.chunk_bytes
    if CTAPolicy.ZERO in space.cta_policies and cap.zero_applies(point.collective, point.group.nodes, point.group.name):
        algo, proto, _ = combos[0]
        out += [replace(base, algorithm=algo, protocol=proto, transport=transport, threads=nt, chunk_bytes=inert_chunk,
                        priority=prio, cta_policy=CTAPolicy.ZERO)
                for transport, nt, prio in product(transports_for(point, hw, space), space.threads, space.priorities)]
    if can_decompose(point):
        out += [replace(base, decomposition=Decomposition.P2P, num_chunks=k, channels=nc, priority=prio, threads=nt,
                        chunk_bytes=inert_chunk, transport=transport)
                for k in space.splits for nc in channel_choices(hw, space) for prio in space.priorities
                for nt in space.threads for transport in transports_for(point, hw, space)]
    return out


def under_process(cfg: CommConfig, point: OverlapPoint, hw: Hardware, process: ProcessSettings,
                  cap: Capability) -> CommConfig:
    """``cfg`` as it runs under the process's values: ``with_process``, and where no tuner sets the
    algorithm and protocol, the ones NCCL picks on the transport the process gives the point."""
    out = with_process(cfg, point, hw, process, cap.process_fields())
    if cap.per_size or out.decomposition == Decomposition.P2P or out.transport == cfg.transport:
        return out
    algorithm, protocol = nccl_pick(point, hw, out.transport)
    if (algorithm == Algorithm.NVLS) != (out.algorithm == Algorithm.NVLS):  # NVLS CTAs are not channels: NCCL's own
        out = replace(out, channels=hw.nccl.nvls_channels if algorithm == Algorithm.NVLS else hw.nccl.default_channels)
    return replace(out, algorithm=algorithm, protocol=protocol)
