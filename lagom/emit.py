"""Turn a plan into what frameworks and NCCL read: communicator configs, env, tuner CSV, buckets, TE."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

from lagom.calls import SIZE_TOLERANCE  # a tuner row covers the sizes the runtime matches to its key
from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan import Plan, PlanEntry

TUNER_COLL = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}
TUNER_COLUMNS = "coll,min_bytes,max_bytes,algo,proto,channels,nNodes,nRanks,numPipeOps,regBuff"


def communicator_configs(plan: Plan) -> dict[str, dict[str, Any]]:
    """Megatron's ``nccl_comm_cfgs`` ({pg_name: {max_ctas, min_ctas, is_high_priority_stream}}).

    A communicator has one CTA range; where its sizes want different channel counts the range spans
    them and the tuner CSV pins each size inside it.
    """
    out: dict[str, dict[str, Any]] = {}
    for group, entries in plan.by_group().items():
        collectives = [e for e in entries if e.config.decomposition == "collective"] or entries
        channels = [e.config.channels for e in collectives]
        out[group] = {
            "max_ctas": max(channels),
            "min_ctas": min(channels),
            "is_high_priority_stream": any(e.config.priority for e in entries),
        }
    return out


def megatron_nccl_yaml(plan: Plan) -> str:
    return yaml.safe_dump(communicator_configs(plan), sort_keys=True)


def _dominant(plan: Plan, attr: str) -> Any:
    """The value of a per-process knob that the most communication time wants."""
    weight: dict[Any, float] = {}
    for e in plan.entries:
        value = getattr(e.config, attr)
        weight[value] = weight.get(value, 0.0) + (e.predicted_comm_s or e.count)
    return max(weight, key=weight.__getitem__)


def nccl_env(plan: Plan, hw: Hardware) -> dict[str, str]:
    """Process-wide NCCL variables, read at communicator creation: buffer (chunk) size, threads, and the
    intra-node transport (NCCL_P2P_DISABLE=1 sends it through host shared memory). Each takes the value
    that the most communication time wants."""
    if not plan.entries:
        return {}
    env = {
        "NCCL_BUFFSIZE": str(_dominant(plan, "chunk_bytes") * hw.nccl.buffsize_per_chunk),
        "NCCL_NTHREADS": str(_dominant(plan, "threads")),
    }
    if _dominant(plan, "transport") == "shm":
        env["NCCL_P2P_DISABLE"] = "1"
    return env


PLAN_ENV_VARS = ("NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS",
                 "NCCL_MAX_CTAS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_P2P_DISABLE")


def env_conflicts(plan: Plan, hw: Hardware, environ: Mapping[str, str]) -> list[str]:
    """NCCL variables already set that override what the plan sets (env beats communicator config)."""
    wanted = nccl_env(plan, hw)
    return [f"{var}={environ[var]} overrides the plan" + (f" (plan: {wanted[var]})" if var in wanted else "")
            for var in PLAN_ENV_VARS if var in environ and environ[var] != wanted.get(var)]


def check_env(plan: Plan, hw: Hardware, environ: Mapping[str, str]) -> None:
    """Raise on the first NCCL variable that contradicts the plan, naming it and the fix."""
    conflicts = env_conflicts(plan, hw, environ)
    if conflicts:
        var = conflicts[0].split("=", 1)[0]
        raise ConfigError(var, conflicts[0], f"unset {var}, or run without the plan")


def tuner_csv(plan: Plan) -> str:
    """Rows for NCCL's example tuner plugin (NCCL_TUNER_CONFIG_FILE): one per collective size."""
    lines = [TUNER_COLUMNS]
    for e in plan.entries:
        if e.collective not in TUNER_COLL or e.config.decomposition != "collective":
            continue
        lines.append(",".join(str(v) for v in (
            TUNER_COLL[e.collective], math.floor(e.bytes * (1 - SIZE_TOLERANCE)), math.ceil(e.bytes * (1 + SIZE_TOLERANCE)),
            e.config.algorithm, e.config.protocol.lower(),
            e.config.channels, e.group_nodes, e.group_size, -1, -1)))
    return "\n".join(lines) + "\n"


# Transformer Engine userbuffers: which GEMM a tensor-parallel point feeds, by the point's name.
_TE_GEMM = [
    (r"\.(qkv|fc1)\.ag$", "{}_fprop"), (r"\.(proj|fc2)\.rs$", "{}_fprop"),
    (r"\.(proj|fc2)\.bwd\.ag$", "{}_dgrad"), (r"\.(qkv|fc1)\.bwd\.ag$", "{}_dgrad"),
    (r"\.(qkv|fc1)\.bwd\.rs$", "{}_wgrad"),
]


def _te_method(gemm: str, entry: PlanEntry) -> str:
    if gemm.endswith("_wgrad") or (gemm.endswith("_dgrad") and gemm[:3] in ("qkv", "fc1")):
        return "bulk"  # overlapped with an independent GEMM: no splitting needed
    if entry.config.decomposition == "p2p":
        return "ring_exchange"
    return "ring_exchange" if gemm.endswith("_dgrad") or gemm[:3] in ("qkv", "fc1") else "pipeline"


def te_ub_cfgs(plan: Plan) -> dict[str, dict[str, Any]]:
    """``ub_cfgs`` for Transformer Engine's ``initialize_ub`` (megatron ``--tp-comm-overlap-cfg``)."""
    out: dict[str, dict[str, Any]] = {}
    for e in plan.entries:
        if e.group != "tp":
            continue
        for name in e.points:
            for pattern, fmt in _TE_GEMM:
                m = re.search(pattern, name)
                if not m:
                    continue
                gemm = fmt.format(m.group(1))
                method = _te_method(gemm, e)
                cfg: dict[str, Any] = {"method": method, "num_sm": e.config.channels, "cga_size": 2,
                                       "set_sm_margin": method != "bulk", "atomic_gemm": False}
                if method == "pipeline":
                    cfg["num_splits"] = max(1, e.config.num_chunks) * 4
                if e.config.priority:
                    cfg["comm_priority"] = -1  # CUDA: lower number = higher priority
                out.setdefault(gemm, cfg)
    return dict(sorted(out.items()))


def te_ub_yaml(plan: Plan) -> str:
    return yaml.safe_dump(te_ub_cfgs(plan), sort_keys=True)
