"""`lagom calibrate`: measure this machine's collectives and write a hardware profile from them.

Real torch.distributed collectives (NCCL on GPUs, gloo on CPU) are timed over a range of sizes;
per collective, latency and bandwidth are fitted by least squares on the cost model's ring shape
(time = steps x latency + bus bytes / bandwidth). The profile starts from a preset (``base:``) and
overrides only the link it measured, plus the raw samples and fits under ``calibration``. The
contention constants stay the preset's: they need GPU kernel measurements, not collectives.
Run it alone (it spawns its own local ranks) or under torchrun (it uses the launched ranks).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from lagom.cost_model import ring_shape
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.outputs import output_file
from lagom.points import Collective

log = logging.getLogger("lagom.calibrate")

COLLECTIVES = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.SEND_RECV)
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
         "G": 2**30, "GB": 2**30, "GIB": 2**30}
ELEMENT_BYTES = 4  # float32 buffers
CONTENTION_NOTE = "untouched: the base preset's constants (they come from GPU kernel measurements, not collectives)"

Samples = dict[str, list[list[float]]]  # collective -> [[bytes, seconds], ...]


def parse_sizes(text: str) -> list[int]:
    """'4K,64K,1M' -> bytes (binary units)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        digits = item.rstrip("KMGIB")
        unit = item[len(digits):]
        if not digits.isdigit() or unit not in UNITS or int(digits) <= 0:
            raise ConfigError("--sizes", f"cannot read '{item}'", "use a comma list like 4K,64K,1M,64M")
        sizes.append(int(digits) * UNITS[unit])
    if len(set(sizes)) < 2:
        raise ConfigError("--sizes", "needs at least two different sizes to fit latency and bandwidth")
    return sorted(set(sizes))


def _sig(x: float, digits: int = 5) -> float:
    """Round to significant digits: the profile stays readable and no noise digits pretend precision."""
    return float(f"{x:.{digits}g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, metavar="PRESET",
                        help="hardware preset (or YAML) the profile starts from; only measured links are overridden")
    parser.add_argument("--out", metavar="FILE", help="profile to write (default: <base>-calibrated.yaml)")
    parser.add_argument("--name", help="profile name (default: <base>-calibrated)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size (the fastest is kept)")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks to spawn when not launched by torchrun")


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
            slowest = torch.tensor([s for _, s in rows], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if len(rows) >= 2:
                samples[coll.value] = [[b, _sig(s)] for (b, _), s in zip(rows, slowest.tolist())]
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


def profile(base_name: str, base: Hardware, name: str, samples: Samples, fits: dict[str, dict[str, float]],
            measured: dict[str, Any], link: str) -> dict[str, Any]:
    base_ref = str(Path(base_name).resolve()) if Path(base_name).suffix else base_name
    return {
        "base": base_ref,
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
    header = ("# Written by `lagom calibrate`: cluster link overrides fitted from the samples below.\n"
              f"# Contention: {CONTENTION_NOTE}.\n")
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


def _spawned(rank: int, world: int, rendezvous: str, backend: str, sizes: list[int], iters: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        samples = measure(sizes, iters, _device(backend))
        if rank == 0:
            Path(out).write_text(json.dumps(samples))
    finally:
        dist.destroy_process_group()


def _spawn(ranks: int, backend: str, sizes: list[int], iters: int) -> Samples:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        rendezvous = str(Path(tmp) / "rendezvous")  # a file, not a port: nothing to race for on a shared host
        mp.spawn(_spawned, args=(ranks, rendezvous, backend, sizes, iters, out), nprocs=ranks, join=True)
        return json.loads(Path(out).read_text())


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


def run(args: argparse.Namespace) -> int:
    base = load_hardware(args.base)
    sizes = parse_sizes(args.sizes)
    name = args.name or f"{base.name}-calibrated"
    out = output_file(args.out or f"{name}.yaml", "--out")
    if args.iters < 1:
        raise ConfigError("--iters", f"must be at least 1, got {args.iters}")
    if args.ranks < 2 and not (dist.is_initialized() or _launched()):
        raise ConfigError("--ranks", f"needs at least 2 ranks, got {args.ranks}")
    backend = _backend(args)
    started_here = False
    if dist.is_initialized() or _launched():
        if not dist.is_initialized():
            dist.init_process_group(backend)
            started_here = True
        try:
            samples = measure(sizes, args.iters, _device(backend))
            world, rank = dist.get_world_size(), dist.get_rank()
        finally:
            if started_here:
                dist.destroy_process_group()
    else:
        samples, world, rank = _spawn(args.ranks, backend, sizes, args.iters), args.ranks, 0
    if rank != 0:
        return 0
    data = measured_profile(args.base, name, samples, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend)
    write_profile(out, data)
    hw = load_hardware(str(out))  # what the planner will read back
    measured = data["calibration"]["measured"]
    link_cfg = getattr(hw.cluster, measured["link"])
    print(f"wrote {out}: {measured['link']} link {link_cfg.gbps:.3g} GB/s, {link_cfg.latency_us:.3g} us per step "
          f"({backend}, {world} ranks on {measured['device']}); contention constants from {base.name}")
    for coll, f in data["calibration"]["fit"].items():
        print(f"  {coll:15s} {f['gbps']:8.3g} GB/s bus  {f['latency_us']:8.3g} us/step")
    return 0
