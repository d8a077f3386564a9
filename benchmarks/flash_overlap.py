"""Step time and exposed communication of Flash-Overlap operators against collective + GEMM.

The FFN of a GPT-2 XL, BERT-large and T5 v1.1-large layer under tensor parallelism with sequence
parallelism: fc1 is a column-parallel linear (all-gather, then GEMM: ``all_gather_matmul``), fc2 a
row-parallel one (GEMM, then reduce-scatter: ``matmul_reduce_scatter``). For each, on every rank:

  gemm      the GEMM alone, on data already in place
  comm      the collective alone (all_gather_into_tensor / reduce_scatter_tensor)
  serial    collective + GEMM, one after the other (what the frameworks do without overlap)
  fused     the Flash-Overlap operator
  exposed   max(0, time - gemm): the communication the GEMM did not hide
  model     the step simulator's serial and fused times, from a profile whose compute peak and link
            bandwidth are set by this row's "gemm" and "comm" alone (contention off: CPU ranks have no
            SMs to share), so the columns test the model's overlap logic against the measured ones

Times are the median over repeats, the slowest rank's. Runs on NCCL with one GPU per rank where
there are enough GPUs, otherwise on gloo with CPU processes (ranks then share the host's cores, so
the figures describe this machine, not a GPU cluster).

    python benchmarks/flash_overlap.py [--tp 2 4] [--batch 1] [--repeats 5] [--chunks 1 2] [--json]
    torchrun --nproc-per-node 4 benchmarks/flash_overlap.py      # one tp = the launched world
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lagom.flash_overlap import all_gather_matmul, matmul_reduce_scatter
from lagom.hardware import load_hardware
from lagom.model.cost_model import CostModel
from lagom.model.simulator import simulate
from lagom.plan.comm_config import CommConfig
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph


@dataclass(frozen=True)
class Layer:
    hidden: int
    ffn: int
    seq: int


LAYERS = {
    "gpt2-xl": Layer(hidden=1600, ffn=6400, seq=1024),
    "bert-large": Layer(hidden=1024, ffn=4096, seq=512),
    "t5-v1.1-large": Layer(hidden=1024, ffn=2816, seq=512),
}


@dataclass(frozen=True)
class Record:
    model: str
    tp: int
    op: str
    shape: str
    chunks: int
    backend: str
    gemm_ms: float
    comm_ms: float
    serial_ms: float
    fused_ms: float

    @property
    def serial_exposed_ms(self) -> float:
        return max(0.0, self.serial_ms - self.gemm_ms)

    @property
    def fused_exposed_ms(self) -> float:
        return max(0.0, self.fused_ms - self.gemm_ms)

    def as_dict(self) -> dict[str, Any]:
        serial, fused = predict(self)
        return asdict(self) | {"serial_exposed_ms": self.serial_exposed_ms, "fused_exposed_ms": self.fused_exposed_ms,
                               "model_serial_ms": serial, "model_fused_ms": fused}


GEMM_FLOPS = 1e12  # the modelled GEMM's size; the profile's peak is scaled so it takes the measured time
COMM_BYTES = 1 << 30


def predict(r: Record) -> tuple[float, float]:
    """(serial, fused) milliseconds the simulator predicts from this row's standalone GEMM and comm."""
    base = load_hardware("a100-8x-100g")
    n = r.tp
    # no contention in the prediction: the measured standalone times already hold it, and the comm CTAs
    # leave every GEMM CTA room on its SM (no registers, no shared memory, spare threads)
    gpu = replace(base.gpu, peak_tflops=GEMM_FLOPS / (r.gemm_ms * 1e-3) / 1e12, gemm_efficiency=1.0, hbm_gbps=1e9,
                  sm_threads=base.gpu.sm_threads + 1024, persistent_gemm=False)
    bus = COMM_BYTES * (n - 1) / n
    intra = replace(base.cluster.intra, gbps=bus / (r.comm_ms * 1e-3) / 1e9, latency_us=0.0)
    nccl = replace(base.nccl, step_overhead_us=0.0, net_overhead_us=0.0, channel_gbps={intra.kind: 1e9},
                   cta_registers=0, cta_smem_kb=0.0,
                   protocols={"Simple": replace(base.nccl.protocols["Simple"], base_latency_us={}, step_latency_us={})})
    contention = replace(base.contention, hbm_interference=0.0, l2_interference=0.0,
                         comm_slowdown_per_hbm_util=0.0, cta_wait_us=0.0)
    hw = replace(base, gpu=gpu, cluster=replace(base.cluster, intra=intra), nccl=nccl, contention=contention)
    gemm = ComputeSegment("gemm", GEMM_FLOPS, 0.0, 1)
    edge = ComputeSegment("edge", 0.0, 0.0, 1)  # the GEMM's neighbour, to anchor release and need
    gather = r.op.startswith("fc1")
    segs = [edge, gemm] if gather else [gemm, edge]
    point = OverlapPoint("tp.comm", Collective.ALL_GATHER if gather else Collective.REDUCE_SCATTER,
                         Group("tp", n, n, 1), COMM_BYTES, after=segs[0].name, before=segs[1].name, fuse_with="gemm")
    graph = StepGraph("flash-overlap", hw.name, 1, [Phase("op", 1, {0: segs}, [point])])
    model = CostModel(hw)
    times = [simulate(graph, {point.key: CommConfig(decomposition=d, num_chunks=r.chunks, priority=1)}, model).step_s
             for d in ("collective", "p2p")]
    return times[0] * 1e3, times[1] * 1e3


def _timed(variants: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of each variant, the slowest rank's.

    The variants run round-robin (after one warm-up each), ranks aligned by a barrier before every
    run, so a drift in the machine's load affects them alike.
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, fn in variants.items():
            sync()
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            if round_:
                samples[name].append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(samples[name]) * 1e3 for name in variants],
                           dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(variants, slowest.tolist(), strict=True))


def _measure(model: str, layer: Layer, batch: int, chunks: int, repeats: int,
             device: torch.device) -> list[Record]:
    tp, backend = dist.get_world_size(), dist.get_backend()
    if layer.seq % tp or layer.ffn % tp:
        raise ValueError(f"{model}: seq {layer.seq} and ffn {layer.ffn} must divide by tp {tp}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    make = lambda *shape: torch.randn(shape, dtype=dtype, device=device)  # noqa: E731
    ffn_shard = layer.ffn // tp

    # fc1, column parallel: this rank's sequence shard [s/tp, b, h] times W1 [ffn/tp, h]
    x_shard, w1 = make(layer.seq // tp, batch, layer.hidden), make(ffn_shard, layer.hidden)
    gathered = make(layer.seq, batch, layer.hidden)

    def fc1_serial() -> torch.Tensor:
        dist.all_gather_into_tensor(gathered, x_shard)
        return gathered @ w1.t()

    fc1 = Record(model, tp, "fc1 all-gather+GEMM", f"{layer.seq}x{batch}x{layer.hidden} @ {layer.hidden}x{ffn_shard}",
                 chunks, backend, **_timed({
                     "gemm_ms": lambda: gathered @ w1.t(),
                     "comm_ms": lambda: dist.all_gather_into_tensor(gathered, x_shard),
                     "serial_ms": fc1_serial,
                     "fused_ms": lambda: all_gather_matmul(x_shard, w1, num_chunks=chunks)}, repeats, device))

    # fc2, row parallel: the full sequence [s, b, ffn/tp] times W2 [h, ffn/tp], reduce-scattered
    hidden_act, w2 = make(layer.seq, batch, ffn_shard), make(layer.hidden, ffn_shard)
    partial, reduced = make(layer.seq, batch, layer.hidden), make(layer.seq // tp, batch, layer.hidden)

    def fc2_serial() -> torch.Tensor:
        dist.reduce_scatter_tensor(reduced, hidden_act @ w2.t())
        return reduced

    fc2 = Record(model, tp, "fc2 GEMM+reduce-scatter", f"{layer.seq}x{batch}x{ffn_shard} @ {ffn_shard}x{layer.hidden}",
                 chunks, backend, **_timed({
                     "gemm_ms": lambda: hidden_act @ w2.t(),
                     "comm_ms": lambda: dist.reduce_scatter_tensor(reduced, partial),
                     "serial_ms": fc2_serial,
                     "fused_ms": lambda: matmul_reduce_scatter(hidden_act, w2, num_chunks=chunks)}, repeats, device))
    return [fc1, fc2]


def _run(args: argparse.Namespace) -> list[Record]:
    """Every layer and chunk count on the process group already set up."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        return [record for model, layer in LAYERS.items() for chunks in args.chunks
                for record in _measure(model, layer, args.batch, chunks, args.repeats, device)]


def _spawned(rank: int, world: int, rendezvous: str, args: argparse.Namespace, out: Any) -> None:
    backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        records = _run(args)
        if rank == 0:
            out.extend(records)
    finally:
        dist.destroy_process_group()


def _print(records: list[Record], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Flash-Overlap vs collective + GEMM (ms; exposed = time - GEMM alone)")
    for column in ("model", "tp", "op", "shape", "chunks", "backend", "GEMM", "comm", "serial", "fused",
                   "exposed serial", "exposed fused", "speed-up", "model serial", "model fused"):
        table.add_column(column, justify="left" if column in ("model", "op", "shape", "backend") else "right")
    for r in records:
        table.add_row(r.model, str(r.tp), r.op, r.shape, str(r.chunks), r.backend,
                      *(f"{v:.2f}" for v in (r.gemm_ms, r.comm_ms, r.serial_ms, r.fused_ms,
                                             r.serial_exposed_ms, r.fused_exposed_ms)),
                      f"{r.serial_ms / r.fused_ms:.2f}x", *(f"{v:.2f}" for v in predict(r)))
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes to spawn")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1], help="Flash-Overlap num_chunks values")
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    args = parser.parse_args()

    if "RANK" in os.environ:  # launched by torchrun: one tp, the launched world
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            records = _run(args)
        finally:
            rank = dist.get_rank()
            dist.destroy_process_group()
        if rank == 0:
            _print(records, args.json)
        return

    manager = mp.Manager()
    records: list[Record] = []
    for tp in args.tp:
        out = manager.list()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(tp, f"{tmp}/rendezvous", args, out), nprocs=tp, join=True)
        records.extend(out)
    _print(records, args.json)


if __name__ == "__main__":
    main()
