"""Turn a plan into what frameworks and NCCL read: communicator configs, env, tuner rules and CSV, buckets, TE."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lagom import nccl_tuner
from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.nccl_tuner import RULES_FILE_ENV
from lagom.plan.capability import DEFAULT_BUFFSIZE, Scope, buffsize_for
from lagom.plan.comm_config import Algorithm, CTAPolicy
from lagom.plan.plan import Plan, PlanEntry
from lagom.step.calls import SIZE_TOLERANCE  # a tuner row covers the sizes the runtime matches to its key

TUNER_COLL = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}
TUNER_COLUMNS = "coll,min_bytes,max_bytes,algo,proto,channels,nNodes,nRanks,numPipeOps,regBuff"


CTA_POLICY_VALUES = {"default": 0, "efficiency": 1, "zero": 2}  # NCCL_CTA_POLICY_* (nccl.h)
MEGATRON_COMM_KEYS = ("max_ctas", "min_ctas", "is_high_priority_stream")  # what megatron's YAML reads of these


def _on_ctas(entry: PlanEntry, plan: Plan) -> bool:
    """Whether the communicator's CTA range bounds this entry (NVLS takes NVLS CTAs, copy engines none)."""
    c = entry.config
    on_copy_engines = c.cta_policy == CTAPolicy.ZERO and plan.capability_record().zero_applies(entry.collective,
                                                                                              entry.group_nodes,
                                                                                              entry.group)
    return c.decomposition == "collective" and c.algorithm != Algorithm.NVLS and not on_copy_engines


def communicator_configs(plan: Plan) -> dict[str, dict[str, Any]]:
    """Per communicator: its CTA range and stream priority, and where planned its CTA policy and NVLS CTAs
    (``ncclConfig_t`` fields, torch ``ProcessGroupNCCL.Options().config``).

    A communicator has one CTA range; where its sizes want different channel counts (the tuner plugin
    sets them per size) the range spans them, and its NVLS CTAs too (NCCL clamps NVLS CTAs into the
    range). CTA policy and NVLS CTAs are one value per communicator in every plan the search makes.
    """
    per_size = plan.capability_record().per_size
    out: dict[str, dict[str, Any]] = {}
    for group, entries in plan.by_group().items():
        collectives = [e for e in entries if e.config.decomposition == "collective"] or entries
        channels = [e.config.channels for e in ([e for e in entries if _on_ctas(e, plan)] or collectives)]
        cfg: dict[str, Any] = {
            "max_ctas": max(channels),
            "min_ctas": min(channels),
            "is_high_priority_stream": any(e.config.priority for e in collectives),
        }
        policies = sorted({str(e.config.cta_policy) for e in collectives} - {CTAPolicy.DEFAULT})
        if len(policies) > 1:
            raise ConfigError(f"plan group {group}", f"CTA policies {', '.join(policies)} on one communicator",
                              "re-run `lagom tune`: a communicator has one CTA policy")
        if policies:
            cfg["cta_policy"] = policies[0]
        nvls = {e.config.channels for e in collectives if e.config.algorithm == Algorithm.NVLS}
        if nvls:
            cfg["nvls_ctas"] = max(nvls)
            if per_size:  # the rules set every planned size's channels: the range only has to admit them
                cfg["max_ctas"] = max(cfg["max_ctas"], cfg["nvls_ctas"])
        out[group] = cfg
    return out


def megatron_nccl_yaml(plan: Plan) -> str:
    """Megatron's --nccl-communicator-config-path file: the keys it reads (CTA policy and NVLS CTAs have
    none there; the adapter sets them on the options megatron builds)."""
    cfgs = {group: {k: v for k, v in cfg.items() if k in MEGATRON_COMM_KEYS}
            for group, cfg in communicator_configs(plan).items()}
    return yaml.safe_dump(cfgs, sort_keys=True)


def buffsize(plan: Plan) -> int:
    """NCCL_BUFFSIZE for the plan: where it sets the chunk (per process), room for two of its ring
    chunks; else NCCL's default, or more where a rule's chunk needs it (never less: a smaller buffer
    would shrink the P2P chunk and NCCL's own chunks for sizes no rule covers)."""
    chunk = plan.process.get("chunk_bytes")
    if chunk is not None and plan.capability_record().scope("chunk") == Scope.PER_PROCESS:
        return buffsize_for("ring", "Simple", "all_reduce", int(chunk))
    needed = [DEFAULT_BUFFSIZE]
    for e in tuner_entries(plan):
        algorithm, protocol, _, chunk = _tuner_settings(e, plan)
        needed.append(buffsize_for(algorithm, protocol, e.collective, chunk))
    return max(needed)


def nccl_env(plan: Plan, hw: Hardware) -> dict[str, str]:
    """Process-wide NCCL variables, read at communicator creation, from the plan's per-process values:
    threads, the intra-node transport (NCCL_P2P_DISABLE=1 sends it through host shared memory) and the
    buffer (``buffsize``)."""
    if not plan.entries:
        return {}
    process = plan.process
    env = {"NCCL_BUFFSIZE": str(buffsize(plan)), "NCCL_NTHREADS": str(process["threads"])}
    if process.get("transport") == "shm":
        env["NCCL_P2P_DISABLE"] = "1"
    return env


PLAN_ENV_VARS = ("NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS",
                 "NCCL_MAX_CTAS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_P2P_DISABLE", "NCCL_CTA_POLICY")


def env_conflicts(plan: Plan, hw: Hardware, environ: Mapping[str, str]) -> list[str]:
    """NCCL variables already set that override what the plan sets (env beats communicator config),
    and a tuner plugin or rules file other than the plan's."""
    wanted = nccl_env(plan, hw)
    conflicts = [f"{var}={environ[var]} overrides the plan" + (f" (plan: {wanted[var]})" if var in wanted else "")
                 for var in PLAN_ENV_VARS if var in environ and environ[var] != wanted.get(var)]
    plugin = nccl_tuner.path()
    if plugin is None or not tuner_entries(plan):
        return conflicts
    if TUNER_PLUGIN_ENV in environ and environ[TUNER_PLUGIN_ENV] != str(plugin):
        conflicts.append(f"{TUNER_PLUGIN_ENV}={environ[TUNER_PLUGIN_ENV]} overrides the plan's per-size algorithm, "
                         f"protocol, channels and chunk (plan: {plugin})")
    if RULES_FILE_ENV in environ and not _holds_rules(environ[RULES_FILE_ENV], plan):
        conflicts.append(f"{RULES_FILE_ENV}={environ[RULES_FILE_ENV]} overrides the plan's tuner rules "
                         "(that file is not this plan's)")
    return conflicts


def check_env(plan: Plan, hw: Hardware, environ: Mapping[str, str]) -> None:
    """Raise on the first NCCL variable that contradicts the plan, naming it and the fix."""
    conflicts = env_conflicts(plan, hw, environ)
    if conflicts:
        var = conflicts[0].split("=", 1)[0]
        raise ConfigError(var, conflicts[0], f"unset {var}, or run without the plan")


def tuner_csv(plan: Plan) -> str:
    """Rows for NCCL's example tuner plugin (NCCL_TUNER_CONFIG_FILE): one per collective size."""
    lines = [TUNER_COLUMNS]
    for e in tuner_entries(plan):
        lines.append(",".join(str(v) for v in (
            TUNER_COLL[e.collective], math.floor(e.bytes * (1 - SIZE_TOLERANCE)), math.ceil(e.bytes * (1 + SIZE_TOLERANCE)),
            e.config.algorithm, e.config.protocol.lower(),
            e.config.channels, e.group_nodes, e.group_size, -1, -1)))
    return "\n".join(lines) + "\n"


TUNER_RULES_HEADER = "lagom-nccl-tuner 1"  # format and version that lagom/nccl_tuner/rules.h reads
TUNER_PLUGIN_ENV = "NCCL_TUNER_PLUGIN"
ALGO_PROTO_ENV = ("NCCL_ALGO", "NCCL_PROTO")  # the user's choice for every size: the plugin stays off


def tuner_entries(plan: Plan) -> list[PlanEntry]:
    """Entries NCCL consults a tuner for: the planned all-reduces, all-gathers and reduce-scatters, when
    the plan was made with per-size settings (a plan made without the plugin leaves them to NCCL)."""
    if plan.capability and not plan.capability_record().per_size:
        return []
    return [e for e in plan.entries if e.collective in TUNER_COLL and e.config.decomposition == "collective"
            and not (e.config.cta_policy == CTAPolicy.ZERO
                     and plan.capability_record().zero_applies(e.collective, e.group_nodes, e.group))]


def _tuner_settings(entry: PlanEntry, plan: Plan) -> tuple[str, str, int, int]:
    """algorithm, protocol, channels, and the chunk NCCL runs for the planned one (LL's at most 32 KiB,
    NVLS's at most NCCL_NVLS_CHUNKSIZE: ``Capability.run_chunk``), as the plugin reads them."""
    c = entry.config
    chunk = plan.capability_record().run_chunk(str(c.algorithm), str(c.protocol), entry.collective, c.chunk_bytes,
                                               entry.group_nodes)
    return (str(c.algorithm), str(c.protocol), c.channels, chunk)


@dataclass
class _TunerRule:
    """A planned size as the plugin sees it: NCCL's collective name, the byte range it covers."""

    entry: PlanEntry
    low: int
    high: int
    settings: tuple[str, str, int, int]

    def line(self) -> str:
        e = self.entry
        algorithm, protocol, channels, chunk = self.settings
        fields = (TUNER_COLL[e.collective], self.low, self.high, e.group_size, e.group_nodes, algorithm,
                  protocol.lower(), channels, chunk)
        return " ".join(str(v) for v in fields) + f"  # {e.key}"


def _tuner_rules_for(entries: list[PlanEntry], plan: Plan) -> tuple[list[_TunerRule], list[str]]:
    """Non-overlapping rules for one (ranks, nodes, collective), and a note per conflict resolved.

    Each size gets the byte range ``lagom.step.calls.KeyIndex`` matches to it; where two ranges overlap they
    are cut where a call is equally near both sizes (KeyIndex takes the nearest). Equal sizes from
    communicators the plugin cannot tell apart keep the settings of the one with more communication time.
    """
    by_size: dict[int, list[PlanEntry]] = {}
    for e in entries:
        by_size.setdefault(e.bytes, []).append(e)
    rules: list[_TunerRule] = []
    notes: list[str] = []
    for size in sorted(by_size):
        heaviest, *others = sorted(by_size[size], key=lambda e: -(e.predicted_comm_s or e.count))
        settings = _tuner_settings(heaviest, plan)
        differing = [e.key for e in others if _tuner_settings(e, plan) != settings]
        if differing:
            notes.append(f"{', '.join(differing)}: settings of {heaviest.key} used (same size and counts, more time)")
        reach = math.floor(SIZE_TOLERANCE * max(size, 1))  # the integer form of TuningKey.within
        rule = _TunerRule(heaviest, max(0, size - reach), size + reach, settings)
        if rules and rules[-1].high >= rule.low:
            cut = (rules[-1].entry.bytes + size) // 2
            rules[-1].high = min(rules[-1].high, cut)
            rule.low = max(rule.low, cut + 1)
        rules.append(rule)
    return rules, notes


def tuner_rules(plan: Plan) -> str:
    """The rules file of Lagom's NCCL tuner plugin (lagom/nccl_tuner/rules.h has the format).

    One rule per planned collective size that NCCL asks a tuner about. The plugin knows a communicator
    only by its rank and node counts, so communicators that share both share rules.
    """
    groups: dict[tuple[int, int, str], list[PlanEntry]] = {}
    for e in tuner_entries(plan):
        groups.setdefault((e.group_size, e.group_nodes, e.collective), []).append(e)
    lines = [TUNER_RULES_HEADER,
             f"# plan: {plan.workload} on {plan.hardware} ({plan.strategy}), {plan.created}",
             f"world {plan.world_size}"]
    sharing: dict[tuple[int, int], set[str]] = {}
    for (ranks, nodes, _), entries in groups.items():
        sharing.setdefault((ranks, nodes), set()).update(e.group for e in entries)
    for (ranks, nodes), names in sorted(sharing.items()):
        if len(names) > 1:
            lines.append(f"# {', '.join(sorted(names))} have {ranks} ranks on {nodes} node(s): NCCL cannot tell "
                         "them apart, they share these rules")
    lines.append("# collective min_bytes max_bytes ranks nodes algorithm protocol channels chunk_bytes")
    for group in sorted(groups):
        rules, notes = _tuner_rules_for(groups[group], plan)
        lines += [f"# {note}" for note in notes] + [rule.line() for rule in rules]
    return "\n".join(lines) + "\n"


def _holds_rules(rules_file: str, plan: Plan) -> bool:
    try:
        return Path(rules_file).read_text() == tuner_rules(plan)
    except (OSError, UnicodeDecodeError):
        return False


def tuner_env(plan: Plan, rules_file: str | Path) -> dict[str, str]:
    """What turns Lagom's tuner plugin on for a plan whose rules are in ``rules_file``: nothing when the
    plan has no size for it or the plugin is not built."""
    plugin = nccl_tuner.path()
    if plugin is None or not tuner_entries(plan):
        return {}
    return {TUNER_PLUGIN_ENV: str(plugin), RULES_FILE_ENV: str(Path(rules_file).resolve())}


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
