"""`lagom calibrate`: measure this machine's collectives and write a hardware profile from them.

Real torch.distributed collectives (NCCL on GPUs, gloo on CPU) are timed over a range of sizes;
per collective, latency and bandwidth are fitted by least squares on the cost model's ring shape
(time = steps x latency + bus bytes / bandwidth). The profile starts from a preset (``base:``) and
overrides only the link it measured, plus the raw samples and fits under ``calibration``.
With ``--contention`` it also times compute kernels alone and beside collectives
(``contention_bench``), fits the contention constants to part of those samples and checks them on the
rest (``lagom.model.contention``); the profile then overrides the constants the samples inform, marked
``source: measured``. Without it the contention constants stay the preset's.
Run it alone (it spawns its own local ranks; one rank on one GPU profiles contention only) or under
torchrun (it uses the launched ranks).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from lagom import nccl_tuner
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.model import contention
from lagom.model.contention import ContentionFit, ContentionSample, KernelShape
from lagom.model.cost_model import ring_shape
from lagom.outputs import output_file
from lagom.plan.comm_config import CommConfig
from lagom.runtime.measure import contention_bench
from lagom.runtime.measure.contention_bench import BenchSettings
from lagom.step.graph import Collective
from lagom.step.workload import Workload, load_workload

log = logging.getLogger("lagom.calibrate")

COLLECTIVES = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.SEND_RECV)
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
         "G": 2**30, "GB": 2**30, "GIB": 2**30}
ELEMENT_BYTES = 4  # float32 buffers
CONTENTION_NOTE = "untouched: the base preset's constants (they come from GPU kernel measurements, not collectives)"
DEFAULT_GEMMS = "4096x12288x4096,4096x4096x4096,4096x16384x4096,4096x4096x16384"  # 4K tokens, hidden 4K, FFN 16K
DEFAULT_ELEMENTS = "128M"
DEFAULT_COMM_BYTES = "64M"
DEFAULT_CHANNELS = "1,2,4,8,16,32,64"
DEFAULT_CHUNKS = "128K,512K,2M"
DEFAULT_PROTOCOLS = "Simple,LL128,LL"
DEFAULT_BUDGET_S = 300.0
COLLECTIVE_TIMEOUT_S = 600  # a rank that never arrives ends the run with an error, not a hang
EMULATED_NOTE = ("one GPU, no peer: a comm-like kernel (exactly N CTAs of NCCL's threads streaming C-byte chunks "
                 "as a copy or reduce-copy) stood in for the collectives; the link is not in these samples")

Samples = dict[str, list[list[float]]]  # collective -> [[bytes, seconds], ...]


def parse_size(item: str, flag: str = "--sizes") -> int:
    """'64K' -> bytes (binary units)."""
    item = item.strip().upper()
    digits = item.rstrip("KMGIB")
    unit = item[len(digits):]
    if not digits.isdigit() or unit not in UNITS or int(digits) <= 0:
        raise ConfigError(flag, f"cannot read '{item}'", "use sizes like 4K, 64K, 1M, 64M")
    return int(digits) * UNITS[unit]


def parse_sizes(text: str) -> list[int]:
    """'4K,64K,1M' -> bytes, at least two different ones (a latency and a bandwidth are fitted)."""
    sizes = [parse_size(item) for item in text.split(",")]
    if len(set(sizes)) < 2:
        raise ConfigError("--sizes", "needs at least two different sizes to fit latency and bandwidth")
    return sorted(set(sizes))


def _sig(x: float, digits: int = 5) -> float:
    """Round to significant digits: the profile stays readable and no noise digits pretend precision."""
    return float(f"{x:.{digits}g}")


def _parse_list[T](text: str, flag: str, item: Callable[[str], T], example: str) -> tuple[T, ...]:
    """A comma list of values, each read by ``item``; any bad item is a ConfigError naming the flag."""
    out = []
    for part in text.split(","):
        try:
            out.append(item(part.strip()))
        except (ValueError, ConfigError):  # one message for every bad item, naming this flag
            raise ConfigError(flag, f"cannot read '{part.strip()}'", f"use a comma list like {example}") from None
    if not out:
        raise ConfigError(flag, "is empty", f"use a comma list like {example}")
    return tuple(dict.fromkeys(out))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _gemm(text: str) -> tuple[int, int, int]:
    m, n, k = (_positive(v) for v in text.lower().split("x"))
    return m, n, k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, metavar="PRESET",
                        help="hardware preset (or YAML) the profile starts from; only measured links are overridden")
    parser.add_argument("--out", metavar="FILE", help="profile to write (default: <base>-calibrated.yaml)")
    parser.add_argument("--name", help="profile name (default: <base>-calibrated)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size (the fastest is kept)")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks to spawn when not launched by torchrun "
                        "(1 with --contention on one GPU: a comm-like kernel stands in for the collectives)")
    group = parser.add_argument_group("contention profiling (--contention)")
    group.add_argument("--contention", action="store_true",
                       help="also time compute beside collectives and fit the contention constants to it")
    group.add_argument("--workload", metavar="FILE",
                       help="take the GEMM shapes (QKV, projection, FFN up and down at its TP) and the collective "
                            f"size from this workload (default GEMMs {DEFAULT_GEMMS}, {DEFAULT_COMM_BYTES} collectives)")
    group.add_argument("--gemms", metavar="MxNxK,...", help="GEMM shapes to profile (instead of the workload's)")
    group.add_argument("--elements", default=DEFAULT_ELEMENTS,
                       help=f"elements of the memory-bound pass (default {DEFAULT_ELEMENTS})")
    group.add_argument("--comm-bytes", metavar="SIZE", help="collective size (default: the workload's, else 64M)")
    group.add_argument("--channels", default=DEFAULT_CHANNELS,
                       help=f"channel counts, capped at the base's nccl.max_channels (default {DEFAULT_CHANNELS})")
    group.add_argument("--chunks", default=DEFAULT_CHUNKS, help=f"chunk sizes (default {DEFAULT_CHUNKS})")
    group.add_argument("--protocols", default=DEFAULT_PROTOCOLS, help=f"NCCL protocols (default {DEFAULT_PROTOCOLS})")
    group.add_argument("--repeats", type=int, default=5, help="timed runs per figure, the median kept (default 5)")
    group.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                       help=f"seconds the contention sweep may take; it stops there (default {DEFAULT_BUDGET_S:g})")


# ---------------------------------------------------------------------------------------------
# Measuring (on every rank)


def _ops(coll: Collective, nbytes: int, device: torch.device) -> tuple[int, Callable[[], None]]:
    """(bytes in the cost model's sense, one blocking call) for a collective of about ``nbytes``."""
    n, rank = dist.get_world_size(), dist.get_rank()
    elems = max(n, nbytes // ELEMENT_BYTES // n * n)
    full = torch.ones(elems, device=device)
    part = torch.ones(elems // n, device=device)
    if coll == Collective.ALL_REDUCE:
        return elems * ELEMENT_BYTES, lambda: dist.all_reduce(full)
    if coll == Collective.ALL_GATHER:  # bytes: the gathered output
        return elems * ELEMENT_BYTES, lambda: dist.all_gather_into_tensor(full, part)
    if coll == Collective.REDUCE_SCATTER:  # bytes: the unreduced input
        return elems * ELEMENT_BYTES, lambda: dist.reduce_scatter_tensor(part, full)
    peer = rank ^ 1  # pairs (0,1), (2,3), ...: each sends its buffer to the other and receives one
    inbox = torch.empty_like(full)

    def exchange() -> None:
        if peer < n:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, inbox, peer)]):
                work.wait()

    return elems * ELEMENT_BYTES, exchange


def _best_time(call: Callable[[], None], iters: int, device: torch.device) -> float:
    """Fastest of ``iters`` calls, every rank starting together (a benchmark may synchronise).

    The minimum, not the mean: other processes on the machine only ever add time to a call.
    """
    cuda = device.type == "cuda"
    call()  # the first call sets up connections
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _out_of_time(deadline: float | None, device: torch.device) -> bool:
    """Whether rank 0's clock has passed the deadline; every rank gets rank 0's answer, so all of them
    stop before the same collective."""
    if deadline is None:
        return False
    if not dist.is_initialized():
        return time.perf_counter() > deadline
    late = torch.tensor([time.perf_counter() > deadline], dtype=torch.int32, device=device)
    dist.broadcast(late, src=0)
    return bool(late.item())


def measure(sizes: list[int], iters: int, device: torch.device, budget_s: float | None = None) -> Samples:
    """Time every collective at every size on the initialised group; the slowest rank's time counts.

    With ``budget_s``, no new measurement starts once that many seconds have passed on rank 0; a
    collective measured at fewer than two sizes is left out (two are needed to fit it).
    """
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    samples: Samples = {}
    for coll in COLLECTIVES:
        rows = []
        for size in sizes:
            if _out_of_time(deadline, device):
                break
            nbytes, call = _ops(coll, size, device)
            rows.append([nbytes, _best_time(call, iters, device)])
        if rows:
            slowest = contention_bench.agree_max([s for _, s in rows], device)
            if len(rows) >= 2:
                samples[coll.value] = [[b, _sig(s)] for (b, _), s in zip(rows, slowest)]
        if len(rows) < len(sizes):
            log.warning("calibration stopped after %.1f s (budget): %s measured", budget_s, ", ".join(samples) or "nothing")
            break
    return samples


# ---------------------------------------------------------------------------------------------
# Fitting and the profile


def fit(samples: Samples, world_size: int) -> dict[str, dict[str, float]]:
    """Per collective: per-step latency (us) and bus bandwidth (GB/s) on the ring shape, by least squares
    on relative errors (the sizes span four orders of magnitude).

    A negative intercept (noise on tiny sizes) is refitted through zero; a time that does not grow
    with size cannot give a bandwidth and is an error.
    """
    out = {}
    for coll, rows in samples.items():
        steps, factor = ring_shape(Collective(coll), world_size, "ring")
        xs = [b * factor for b, _ in rows]
        ts = [s for _, s in rows]
        ws = [1.0 / t**2 for t in ts]  # relative errors: 4 KiB counts as much as 64 MiB
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs)) / sw
        mt = sum(w * t for w, t in zip(ws, ts)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
        slope = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts)) / sxx if sxx else 0.0
        intercept = mt - slope * mx
        if intercept < 0:
            intercept = 0.0
            slope = sum(w * x * t for w, x, t in zip(ws, xs, ts)) / sum(w * x * x for w, x in zip(ws, xs))
        if slope <= 0:
            raise ConfigError("--sizes", f"calibration of {coll}: the time does not grow with the message size "
                              f"({rows})", "measure larger sizes")
        out[coll] = {"latency_us": _sig(intercept / steps * 1e6), "gbps": _sig(1.0 / slope / 1e9),
                     "steps": steps, "intercept_us": _sig(intercept * 1e6)}
    return out


def link_override(fits: dict[str, dict[str, float]], base: Hardware) -> dict[str, float]:
    """The link as the cost model reads it: the median over collectives, less NCCL's own per-call and
    per-step protocol latencies (the Simple protocol's, which large messages use)."""
    simple = base.nccl.protocols["Simple"]
    latency = [max(0.0, (f["intercept_us"] - base.nccl.base_latency_us) / f["steps"] - simple.latency_us) for f in fits.values()]
    gbps = [f["gbps"] / simple.efficiency for f in fits.values()]
    return {"gbps": _sig(statistics.median(gbps)), "latency_us": _sig(statistics.median(latency))}


def _base_ref(base_name: str) -> str:
    """The profile's ``base:``: a preset by name, a file by its absolute path (the profile may move)."""
    return str(Path(base_name).resolve()) if Path(base_name).suffix else base_name


def profile(base_name: str, base: Hardware, name: str, samples: Samples, fits: dict[str, dict[str, float]],
            measured: dict[str, Any], link: str) -> dict[str, Any]:
    return {
        "base": _base_ref(base_name),
        "name": name,
        "description": f"{base.name} with its {link}-node link measured by lagom calibrate "
                       f"({measured['backend']}, {measured['world_size']} ranks, {measured['date']})",
        "cluster": {link: link_override(fits, base)},
        "calibration": {**samples, "fit": fits, "measured": measured},
    }


def measured_profile(base_ref: str, name: str, samples: Samples, world: int, gpus_per_node: int,
                     backend: str) -> dict[str, Any]:
    """The profile for samples taken on ``world`` ranks, ``gpus_per_node`` of them per node: they measured
    the inter-node link when the ranks span nodes, else the intra-node one."""
    if not samples:
        raise ConfigError("calibration", "no collective was measured at two sizes",
                          "give the calibration more time, or name the hardware")
    base = load_hardware(base_ref)
    link = "inter" if world > gpus_per_node else "intra"
    measured = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "backend": backend, "torch": str(torch.__version__),
                "world_size": world, "device": device_name(backend), "link": link, "contention": CONTENTION_NOTE}
    return profile(base_ref, base, name, samples, fit(samples, world), measured, link)


def write_profile(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a job reading its cached profile never sees half a file); the folder must exist."""
    fitted = data.get("contention", {}).get("source") == "measured"
    note = ("fitted to the samples under calibration.contention (held-out errors under its fit)" if fitted
            else CONTENTION_NOTE)
    header = ("# Written by `lagom calibrate`: overrides fitted from the samples below.\n"
              f"# Contention: {note}.\n")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Running: under torchrun, inside an initialised job, or spawning local ranks


def device_name(backend: str) -> str:
    """The GPU's name under NCCL, else the CPU's."""
    return torch.cuda.get_device_name() if backend == "nccl" else (platform.processor() or platform.machine() or "cpu")


def _device(backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class Request:
    """What every rank measures: the links at ``sizes`` (none on one rank), and contention when ``bench`` is set."""

    sizes: list[int]
    iters: int
    bench: BenchSettings | None
    base: str  # the --base profile: its topology decides what NCCL can apply here


@dataclass
class Measured:
    links: Samples
    contention: list[ContentionSample]
    skipped: list[str]  # settings that could not be put in force here, and why
    source: str  # nccl | gloo | emulated
    world: int


def _use_tuner_plugin() -> None:
    """Point NCCL at Lagom's tuner plugin, so that its live table sets each sample's algorithm, protocol,
    channels and chunk; a tuner, algorithm or protocol the user set wins."""
    from lagom.plan.emit import ALGO_PROTO_ENV, TUNER_PLUGIN_ENV

    plugin = nccl_tuner.path()
    if plugin is not None and not any(v in os.environ for v in (TUNER_PLUGIN_ENV, *ALGO_PROTO_ENV)):
        os.environ[TUNER_PLUGIN_ENV] = str(plugin)


def measure_here(request: Request, backend: str, nodes: int) -> Measured:
    """On every rank of the initialised group (or alone on one GPU): the links, then contention."""
    device = _device(backend)
    world = dist.get_world_size() if dist.is_initialized() else 1
    links = measure(request.sizes, request.iters, device) if world > 1 else {}
    if request.bench is None:
        return Measured(links, [], [], backend, world)
    from lagom.runtime.apply.runtime import runtime_capability

    deadline = time.perf_counter() + request.bench.budget_s
    capability = runtime_capability(load_hardware(request.base)) if backend == "nccl" else None
    samples, skipped, source = contention_bench.sweep(request.bench, device, capability, nodes,
                                                       lambda: _out_of_time(deadline, device))
    return Measured(links, samples, skipped, source, world)


def _spawned(rank: int, world: int, rendezvous: str, backend: str, request: Request, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if request.bench is not None:
        _use_tuner_plugin()
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        measured = measure_here(request, backend, nodes=1)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(measured, f)
    finally:
        dist.destroy_process_group()


def _spawn(ranks: int, backend: str, request: Request) -> Measured:
    if ranks == 1:  # one GPU, no peer: nothing to rendezvous with
        return measure_here(request, backend, nodes=1)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "measured.pickle")
        rendezvous = str(Path(tmp) / "rendezvous")  # a file, not a port: nothing to race for on a shared host
        mp.spawn(_spawned, args=(ranks, rendezvous, backend, request, out), nprocs=ranks, join=True)
        with open(out, "rb") as f:
            measured: Measured = pickle.load(f)
        return measured


def _launched() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _backend(args: argparse.Namespace) -> str:
    if dist.is_initialized():
        backend = str(dist.get_backend()).lower()
        return "nccl" if "nccl" in backend else "gloo"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks)) if _launched() else args.ranks
    backend = args.backend or ("nccl" if gpus >= wanted else "gloo")
    if backend == "nccl" and gpus < wanted:
        raise ConfigError("--backend", f"nccl needs one GPU per local rank ({wanted}), this machine has {gpus}",
                          "use --backend gloo, or fewer --ranks")
    return backend


def bench_settings(args: argparse.Namespace, base: Hardware) -> BenchSettings:
    """The contention sweep the flags ask for; every bad value is a ConfigError naming its flag."""
    if args.repeats < 1:
        raise ConfigError("--repeats", f"must be at least 1, got {args.repeats}")
    if not args.budget_s > 0 or not math.isfinite(args.budget_s):
        raise ConfigError("--budget-s", f"must be a positive number of seconds, got {args.budget_s}")
    wl = load_workload(args.workload) if args.workload else None
    gemms = _parse_list(args.gemms, "--gemms", _gemm, "4096x4096x4096") if args.gemms else \
        workload_gemms(wl) if wl else _parse_list(DEFAULT_GEMMS, "--gemms", _gemm, "")
    (elements,) = _parse_list(args.elements, "--elements", lambda v: parse_size(v, "--elements"), "128M")
    size = args.comm_bytes or (f"{workload_comm_bytes(wl)}" if wl else DEFAULT_COMM_BYTES)
    (comm_bytes,) = _parse_list(size, "--comm-bytes", lambda v: parse_size(v, "--comm-bytes"), "64M")
    most = base.nccl.max_channels
    channels = _parse_list(args.channels, "--channels", _positive, DEFAULT_CHANNELS)
    if max(channels) > most:
        log.info("contention: channel counts above the base's nccl.max_channels (%d) left out", most)
    channels = tuple(c for c in channels if c <= most) or (most,)
    chunks = _parse_list(args.chunks, "--chunks", lambda v: parse_size(v, "--chunks"), DEFAULT_CHUNKS)
    protocols = _parse_list(args.protocols, "--protocols", _protocol, DEFAULT_PROTOCOLS)
    shapes = tuple(KernelShape(gemm=g) for g in gemms) + (KernelShape(elements=elements),)
    default = CommConfig(channels=base.nccl.default_channels, threads=base.nccl.default_threads,
                         chunk_bytes=base.nccl.default_chunk_bytes)
    return BenchSettings(kernels=shapes, comm_bytes=dict.fromkeys(contention_bench.COLLECTIVES, comm_bytes),
                         channels=channels, chunks=chunks, protocols=protocols,
                         default=default, repeats=args.repeats, budget_s=float(args.budget_s))


def _protocol(text: str) -> str:
    names = {p.lower(): p for p in ("Simple", "LL128", "LL")}
    if text.lower() not in names:
        raise ValueError(text)
    return names[text.lower()]


def workload_gemms(wl: Workload) -> tuple[tuple[int, int, int], ...]:
    """A layer's GEMMs at the workload's TP, for one micro-batch: QKV, projection, FFN up and down."""
    m, tp = wl.model, wl.parallel.tp
    tokens = wl.training.micro_batch * m.seq_len
    head = m.hidden // max(1, m.heads)
    qkv = (m.heads + 2 * (m.kv_heads or m.heads)) * head
    up = m.ffn * (2 if m.gated_mlp else 1)
    return ((tokens, max(1, qkv // tp), m.hidden), (tokens, m.hidden, max(1, m.hidden // tp)),
            (tokens, max(1, up // tp), m.hidden), (tokens, m.hidden, max(1, m.ffn // tp)))


def workload_comm_bytes(wl: Workload) -> int:
    """One layer's activations in bf16: what its tensor-parallel all-gather and reduce-scatter move."""
    return wl.training.micro_batch * wl.model.seq_len * wl.model.hidden * 2


def measured_facts(backend: str, source: str, world: int) -> dict[str, Any]:
    """Date, device, and every version a measurement depends on."""
    cuda = backend == "nccl" or source == "emulated"
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device_name("nccl" if cuda else backend),
                             "device_type": "cuda" if cuda else "cpu", "backend": backend, "source": source,
                             "world_size": world, "torch": str(torch.__version__)}
    if cuda:
        facts.update(cuda=str(torch.version.cuda), nccl=".".join(map(str, torch.cuda.nccl.version())),
                     driver=_driver_version())
    return facts


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - NVML missing or refused: the profile says so
        return "unknown (NVML not available)"


def with_contention(data: dict[str, Any], base: Hardware, measured: Measured, backend: str) -> ContentionFit:
    """Fit the contention constants and put what they override, the samples and the fit into the profile."""
    result = contention.fit(measured.contention, base)
    facts = measured_facts(backend, measured.source, measured.world)
    if "measured" in data["calibration"]:
        data["calibration"]["measured"]["contention"] = "fitted: see calibration.contention"
    for section, values in contention.profile_overrides(result, facts).items():
        data.setdefault(section, {}).update(values)
    data.setdefault("calibration", {})["contention"] = {
        "samples": [s.to_dict() for s in measured.contention], "fit": result.to_dict(),
        "skipped": measured.skipped, "measured": facts,
    }
    if measured.source == "emulated":
        data["calibration"]["contention"]["note"] = EMULATED_NOTE
    return result


def run(args: argparse.Namespace) -> int:
    base = load_hardware(args.base)
    sizes = parse_sizes(args.sizes)
    name = args.name or f"{base.name}-calibrated"
    out = output_file(args.out or f"{name}.yaml", "--out")
    if args.iters < 1:
        raise ConfigError("--iters", f"must be at least 1, got {args.iters}")
    bench = bench_settings(args, base) if args.contention else None
    in_job = dist.is_initialized() or _launched()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not in_job and args.ranks < 2 and not (args.ranks == 1 and bench is not None and gpus >= 1):
        raise ConfigError("--ranks", f"needs at least 2 ranks, got {args.ranks}",
                          "one rank is for --contention on a GPU only" if args.ranks == 1 else "")
    backend = _backend(args)
    request = Request(sizes, args.iters, bench, args.base)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks if not in_job else 1))
    started_here = False
    if in_job:
        if not dist.is_initialized():
            if bench is not None:
                _use_tuner_plugin()
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            started_here = True
        try:
            world, rank = dist.get_world_size(), dist.get_rank()
            measured = measure_here(request, backend, nodes=max(1, world // max(1, local)))
        finally:
            if started_here:
                dist.destroy_process_group()
    else:
        measured, rank = _spawn(args.ranks, backend, request), 0
        world = measured.world
    if rank != 0:
        return 0
    if measured.links:
        data = measured_profile(args.base, name, measured.links, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                backend)
    else:
        data = {"base": _base_ref(args.base), "name": name, "calibration": {}}
    fitted = with_contention(data, base, measured, backend) if bench is not None else None
    data["description"] = _description(base, data, measured, backend)
    write_profile(out, data)
    hw = load_hardware(str(out))  # what the planner will read back
    if measured.links:
        link = data["calibration"]["measured"]["link"]
        link_cfg = getattr(hw.cluster, link)
        print(f"wrote {out}: {link} link {link_cfg.gbps:.3g} GB/s, {link_cfg.latency_us:.3g} us per step "
              f"({backend}, {world} ranks on {data['calibration']['measured']['device']})"
              + ("" if fitted else f"; contention constants from {base.name}"))
        for coll, f in data["calibration"]["fit"].items():
            print(f"  {coll:15s} {f['gbps']:8.3g} GB/s bus  {f['latency_us']:8.3g} us/step")
    else:
        print(f"wrote {out}: no link measured (one rank)")
    if fitted is not None:
        _print_fit(fitted, measured, hw)
    return 0


def _description(base: Hardware, data: dict[str, Any], measured: Measured, backend: str) -> str:
    parts = []
    if measured.links:
        parts.append(f"its {data['calibration']['measured']['link']}-node link")
    if measured.contention:
        parts.append(f"contention ({measured.source}, {len(measured.contention)} samples)")
    facts = data["calibration"].get("contention", {}).get("measured") or measured_facts(backend, measured.source,
                                                                                         measured.world)
    return (f"{base.name} with {' and '.join(parts)} measured by lagom calibrate on {facts['device']} "
            f"({backend}, {measured.world} rank(s), {facts['date']})")


def _print_fit(fitted: ContentionFit, measured: Measured, hw: Hardware) -> None:
    print(f"contention: {len(measured.contention)} samples ({measured.source}), {len(fitted.fit_ids)} fitted, "
          f"{len(fitted.held_out_ids)} held out")
    for key, value in fitted.constants.items():
        print(f"  {key:28s} {value:.4g}")
    if fitted.uninformed:
        print(f"  not informed by these samples (the base's kept): {', '.join(fitted.uninformed)}")
    for label in ("estimate", "fitted"):
        errs = fitted.held_out.get(label) or {}
        if errs:
            print(f"  held-out error, {label:8s}: median {errs['median']:.1%}, max {errs['max']:.1%}")
    before, after = fitted.held_out.get("estimate"), fitted.held_out.get("fitted")
    if before and after and after["median"] > before["median"]:
        print("  warning: the fitted constants predict the held-out samples worse than the estimates they replace "
              "(noisy samples? measure longer with --repeats or --budget-s)")
    for why in measured.skipped:
        print(f"  not measured here: {why}")
    if measured.source == "emulated":
        print(f"  {EMULATED_NOTE}")
