"""What recording a DeepSpeed collective costs: microseconds per call, wrapped vs bare.

Two measurements on 2 processes (gloo on CPU, or NCCL with --nccl on 2 GPUs):
- isolated: the wrapper around a backend whose calls return an already completed work, so the
  difference is the wrapper alone (naming the group, counting bytes, Recorder.track and its
  completion callback, the sync-as-async conversion); the fastest block (noise only adds);
- live: DeepSpeed's real backend (``deepspeed.comm.comm.cdb``), small tensors, bare blocks and
  wrapped blocks interleaved so that machine noise hits both alike; the median of the blocks, as
  wall clock and as CPU time of the calling thread (on a loaded machine the wall clock of a small
  gloo collective is mostly scheduling, and the CPU time is what the wrapper adds).

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_wrap_overhead.py [--calls 2000] [--blocks 7]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BYTES = 4096  # a small message: the overhead is per call, not per byte


class _Completed:
    """A work that is already done (what the isolated backend returns)."""

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _InstantBackend:
    """Backend methods with TorchBackend's signatures that do no communication. Like torch, they
    make a work for every call and wait on it themselves when the call is synchronous."""

    @staticmethod
    def _issue(async_op: bool) -> Any:
        work = _Completed()
        return work if async_op else work.wait() and None

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return self._issue(async_op)

    def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any, group: Any = None,
                               async_op: bool = False) -> Any:
        return self._issue(async_op)

    def reduce_scatter_tensor(self, output_tensor: Any, input_tensor: Any, op: Any = None, group: Any = None,
                              async_op: bool = False) -> Any:
        return self._issue(async_op)


def _calls(backend: Any, world: int, device: str) -> dict[str, Callable[[], Any]]:
    n = BYTES // 4
    t = torch.ones(n, device=device)
    gathered, shard = torch.empty(n * world, device=device), torch.empty(n // world, device=device)
    return {
        "all_reduce (sync)": lambda: backend.all_reduce(t),
        "all_reduce (async + wait)": lambda: backend.all_reduce(t, async_op=True).wait(),
        "all_gather_into_tensor": lambda: backend.all_gather_into_tensor(output_tensor=gathered, input_tensor=t),
        "reduce_scatter_tensor": lambda: backend.reduce_scatter_tensor(shard, t),
    }


def _per_call_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(wall, calling thread's CPU) microseconds per call."""
    sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - wall) / calls * 1e6, (time.thread_time() - cpu) / calls * 1e6


Row = tuple[tuple[float, float], tuple[float, float]]  # (bare, wrapped) x (wall, cpu)


def _measure(backend: Any, names: Any, calls: int, blocks: int, world: int, device: str,
             sync: Callable[[], None], pick: Callable[[list[float]], float]) -> dict[str, Row]:
    """Microseconds per call over ``blocks`` (bare, wrapped) block pairs, per collective: ``pick``
    (min or median) of the blocks' means, wall and CPU."""
    from lagom.runtime import Recorder
    from lagom_deepspeed.comm import subscribe

    results: dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {
        name: ([], []) for name in _calls(backend, world, device)}
    recorder = Recorder()
    for _ in range(blocks):
        for name, fn in _calls(backend, world, device).items():
            results[name][0].append(_per_call_us(fn, calls, sync))
        wrapped = subscribe(names)  # the process's tap on deepspeed.comm.comm.cdb (``backend``)
        wrapped.attach(recorder)
        recorder.begin_step(0)
        for name, fn in _calls(backend, world, device).items():
            results[name][1].append(_per_call_us(fn, calls, sync))
            recorder.end_step()
            recorder.begin_step(0)
        wrapped.close()
    def both(blocks_: list[tuple[float, float]]) -> tuple[float, float]:
        return pick([b[0] for b in blocks_]), pick([b[1] for b in blocks_])

    return {k: (both(b), both(w)) for k, (b, w) in results.items()}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from lagom_deepspeed.groups import GroupNames

    device = "cpu"
    if args.nccl:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    deepspeed.init_distributed(dist_backend="nccl" if args.nccl else "gloo")
    sync = torch.cuda.synchronize if args.nccl else (lambda: None)
    names = GroupNames.for_job(torch.nn.Module(), None, world)
    if rank == 0:  # pure CPU cost: one process at a time, the fastest block (noise only adds)
        isolated = _measure(_InstantBackend(), names, args.calls, args.blocks, world, device, sync, min)
    dist.barrier()
    live = _measure(ds_comm.cdb, names, args.calls, args.blocks, world, device, sync, statistics.median)
    if rank == 0:
        print(f"per call, {BYTES} B messages, {world} ranks, {'NCCL' if args.nccl else 'gloo'}, "
              f"{args.blocks} blocks of {args.calls} calls")
        print(f"{'[us per call]':26s} | {'isolated: bare':>14s} {'wrapped':>8s} {'+':>5s} | "
              f"{'live wall: bare':>15s} {'wrapped':>8s} {'+':>6s} | {'live CPU: bare':>14s} {'wrapped':>8s} {'+':>5s}")
        for name, (bare, wrapped) in live.items():
            ib, iw = isolated[name][0][0], isolated[name][1][0]
            print(f"{name:26s} | {ib:14.1f} {iw:8.1f} {iw - ib:5.1f} | {bare[0]:15.1f} {wrapped[0]:8.1f} "
                  f"{wrapped[0] - bare[0]:6.1f} | {bare[1]:14.1f} {wrapped[1]:8.1f} {wrapped[1] - bare[1]:5.1f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--nccl", action="store_true", help="2 GPUs with NCCL instead of gloo on CPU")
    args = parser.parse_args()
    if not args.nccl:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
