"""What the runtime recorder costs per collective call, in microseconds (medians of many calls).

    python benchmarks/recorder_overhead.py [--calls 5000] [--nccl-steps 1500] [--nccl-per-step 20 200]

1. ``Recorder.track`` alone: without a work, and with a work whose future is done (the callback path);
   ``end_step`` per resolved record.
2. A small gloo all-reduce on 2 local ranks: bare, with an empty completion callback (what any
   Python callback costs: gloo's thread takes the GIL to run it), and tracked; the three are
   interleaved in rotating order so drift and ordering hit them alike.
3. The torch.distributed tap (lagom.runtime.apply.torch_tap): the same all-reduce in blocks of calls
   with the tap off (bare), recorded the adapters' way (``Recorder.track`` on the work: the
   existing recorder), recorded by the tap (``dist.all_reduce`` as Transformer Engine calls it),
   and with the tap on but the call claimed by an adapter layer (the hooks run and return at
   once); blocks rotate, each timed as wall clock and as CPU time of the calling thread (on a
   loaded machine the wall clock of a small gloo call is mostly scheduling).
   ``torch hook`` is the floor of torch's process-group hook API: torch's own C++ hook pair
   (``FlightRecorderHook``, which on gloo returns at once: gloo records itself), no Python at all.
   ``nccl records``: the tap on a group whose collectives a recorder takes from NCCL's profiler records
   (its hooks run and leave the call at once), what a tapped NCCL call costs where the plugin is loaded.
   ``end_step`` is what closing the tapped steps cost, per recorded call.
4. The NCCL profiler plugin's drain (lagom.nccl_profiler), the path that replaces the tap where NCCL is
   the backend: a step's records are put in the plugin's ring (as NCCL's calls would; their C cost is
   benchmarks/profiler_overhead.py's), then one ``drain()`` per step, alone and with the records turned
   into ``CollectiveRecord`` objects; per collective of the step. Then the recorder's own path
   (lagom.runtime.apply.nccl_calls), on a communicator initialised through the plugin's NCCL entry point
   and matched to its group by name: what the calling thread pays per call (``Recorder.track`` leaving a call
   NCCL's records carry, as the adapters call it), and ``end_step``'s one drain turned into the recorder's
   rows, per call; their sum is the added CPU per call, amortised over the step. Once for all-reduces, once
   for sends (NCCL's P2p records, which the recorder takes once the communicator has reported one), each for steps
   of every size ``--nccl-per-step`` names (default 20 and 200 calls: a drain's fixed cost weighs most on the
   steps of few collectives, and a drain of few records takes another path than a large one's). Medians
   over the steps after the first 100, when the recorder keeps its full 100 step windows, as in a long job; and
   the mean over those steps (``--nccl-steps`` of them, long enough that it holds the garbage collections that the
   recording of a long job sets off, which a median leaves out): what a call costs amortised over a long job.

Runs on torch 2.4 and later; the ``torch hook`` rows need torch's ``FlightRecorderHook`` (2.14+: its
``attach`` takes the group alone there, and the group and its ranks in builds that ask for them).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lagom import nccl_profiler
from lagom.nccl_profiler import drain as profiler_drain
from lagom.runtime import Recorder
from lagom.runtime.apply import nccl_calls, torch_tap

BATCH = 100  # calls timed together: one perf_counter pair per batch, not per call


class _DoneWork:
    """A work whose future has completed: track registers the callback and it runs inline."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result(None)

    def get_future(self) -> torch.futures.Future:
        return self.future


def _us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def track_alone(calls: int) -> dict[str, float]:
    rec = Recorder(cuda=False)
    works = [_DoneWork() for _ in range(BATCH)]
    plain, with_work, resolve = [], [], []
    for step in range(max(1, calls // BATCH)):
        rec.begin_step(step)
        t = time.perf_counter()
        for _ in range(BATCH):
            rec.track("dp", "all_reduce", 4096)
        plain.append((time.perf_counter() - t) / BATCH)
        t = time.perf_counter()
        for w in works:
            rec.track("dp", "all_reduce", 4096, w)
        with_work.append((time.perf_counter() - t) / BATCH)
        t = time.perf_counter()
        rec.end_step()
        resolve.append((time.perf_counter() - t) / (2 * BATCH))
    return {"track, no work": _us(plain), "track, work with future": _us(with_work), "end_step per record": _us(resolve)}


def _ranks(rank: int, world: int, rendezvous: str, calls: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    rec = Recorder(cuda=False)
    t = torch.ones(1024)

    def bare() -> None:
        dist.all_reduce(t, async_op=True).wait()

    def callback() -> None:
        work = dist.all_reduce(t, async_op=True)
        work.get_future().add_done_callback(lambda _: None)
        work.wait()

    def tracked() -> None:
        rec.track("dp", "all_reduce", 4096, dist.all_reduce(t, async_op=True)).wait()

    variants = {"bare": bare, "empty callback": callback, "tracked": tracked}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(20):  # warm-up: connections and allocator
        bare()
    names = list(variants)
    for i in range(calls):
        if i % BATCH == 0:
            rec.begin_step(i // BATCH)
        for name in names[i % 3:] + names[:i % 3]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
        if i % BATCH == BATCH - 1:
            rec.end_step()
    tap = _tap_blocks(t, calls)
    if rank == 0:
        Path(out).write_text(" ".join(str(_us(times[name])) for name in names) + "\n" +
                             " ".join(str(_us(tap[name])) for name in (*TAP_VARIANTS, "end_step")))
    dist.destroy_process_group()


# "nccl records": the tap on a group whose collectives come from NCCL's records (its pre-hook leaves them at once)
TAP_KINDS = ("bare", "tracked", "tapped", "claimed", "torch hook") + (("nccl records",) if nccl_profiler.path() else ())
TAP_VARIANTS = tuple(f"{kind} {clock}" for clock in ("wall", "cpu") for kind in TAP_KINDS)


def _tap_blocks(tensor: torch.Tensor, calls: int) -> dict[str, list[float]]:
    """Per-call seconds of blocks of all-reduces: tap off, tracked by the adapters' way, tapped, claimed."""
    from torch._C._distributed_c10d import FlightRecorderHook
    from torch.distributed import distributed_c10d

    rec = Recorder(cuda=False)
    times: dict[str, list[float]] = {name: [] for name in (*TAP_VARIANTS, "end_step")}

    def block(kind: str, call: Callable[[], object]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(BATCH):
            call()
        times[f"{kind} wall"].append((time.perf_counter() - wall) / BATCH)
        times[f"{kind} cpu"].append((time.thread_time() - cpu) / BATCH)

    def plain() -> None:
        dist.all_reduce(tensor)

    def tracked() -> None:
        rec.track("dp", "all_reduce", 4096, dist.all_reduce(tensor, async_op=True)).wait()

    def tap_on(kind: str) -> None:
        subscription = torch_tap.subscribe(lambda group: "dp", rec)
        if kind == "claimed":
            with torch_tap.claimed:
                block(kind, plain)
        else:
            block(kind, plain)
        if subscription is not None:
            subscription.close()

    def torch_hook() -> None:
        group = distributed_c10d._get_default_group()
        try:
            hook = FlightRecorderHook.attach(group)  # torch 2.14: the group alone
        except TypeError:
            hook = FlightRecorderHook.attach(group, [0, 1])  # builds whose attach also takes the group's ranks
        block("torch hook", plain)
        hook.remove()

    def nccl_records() -> None:
        subscription = torch_tap.subscribe(lambda group: "dp", owned)
        owned.begin_step(owned.step + 1)
        block("nccl records", plain)
        owned.end_step()
        if subscription is not None:
            subscription.close()

    runs = {"bare": lambda: block("bare", plain), "tracked": lambda: block("tracked", tracked),
            "tapped": lambda: tap_on("tapped"), "claimed": lambda: tap_on("claimed"), "torch hook": torch_hook,
            "nccl records": nccl_records}
    owned = Recorder(cuda=False)  # reads NCCL's records: "dp" is matched by its commName at the first step's end
    library = nccl_profiler.path()
    if library is not None:
        name = distributed_c10d._get_default_group().group_name
        _init_communicator(library, comm_hash=11, n_ranks=2, name=name.encode())
        owned.nccl = nccl_calls.NcclCalls(profiler_drain.ProfilerDrain(library),
                                          lambda: [nccl_calls.NcclGroup("dp", 2, (name,))])
        for step in (1, 2):
            owned.begin_step(step)
            owned.end_step()
        assert owned.from_nccl("dp", "all_reduce")
    for i in range(max(1, calls // BATCH)):
        rec.begin_step(i)
        n = i % len(TAP_KINDS)
        for kind in TAP_KINDS[n:] + TAP_KINDS[:n]:
            runs[kind]()
        cpu = time.thread_time()
        resolved = rec.end_step()
        times["end_step"].append((time.thread_time() - cpu) / max(1, len(resolved)))
    return times


def all_reduce_pair(calls: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_ranks, args=(2, str(Path(tmp) / "rendezvous"), calls, out), nprocs=2, join=True)
        recorder_line, tap_line = Path(out).read_text().splitlines()
        bare, callback, tracked = map(float, recorder_line.split())
        tap = dict(zip((*TAP_VARIANTS, "end_step"), map(float, tap_line.split())))
    rows = {"gloo all_reduce 4 KiB, bare": bare, "gloo all_reduce 4 KiB, empty done-callback": callback,
            "gloo all_reduce 4 KiB, tracked": tracked, "tracked - bare": tracked - bare}
    for clock in ("wall", "cpu"):
        rows |= {f"blocks, all_reduce 4 KiB, {kind} ({clock})": tap[f"{kind} {clock}"] for kind in TAP_KINDS}
        rows |= {f"blocks: {kind} - bare ({clock})": tap[f"{kind} {clock}"] - tap[f"bare {clock}"]
                 for kind in TAP_KINDS[1:]}
    rows["tapped steps: end_step per recorded call (cpu)"] = tap["end_step"]
    return rows


def profiler_drain_per_call(calls: int, per_step: int = 200) -> dict[str, float]:
    """Python's cost per collective of reading the profiler's ring once per step of ``per_step`` collectives."""
    library = nccl_profiler.path()
    if library is None:
        print(nccl_profiler.UNAVAILABLE)
        return {}
    reader = profiler_drain.ProfilerDrain(library)
    records = [profiler_drain.RecordC(comm_hash=7, seq_number=i, count=1 << 20, n_ranks=8, func=4, algorithm=1,
                                      protocol=2, type_size=2, channels=8, warps=16) for i in range(per_step)]
    alone, objects = [], []
    reader.drain()
    for _ in range(max(1, calls // per_step)):
        for r in records:
            reader.push(r)
        cpu = time.thread_time()
        got = reader.drain()
        alone.append((time.thread_time() - cpu) / len(got))
        for r in records:
            reader.push(r)
        cpu = time.thread_time()
        made = reader.drain().collectives()
        objects.append((time.thread_time() - cpu) / len(made))
    return {f"profiler drain, one per step of {per_step} (cpu)": _us(alone),
            f"profiler drain + CollectiveRecord objects, step of {per_step} (cpu)": _us(objects)}


def _init_communicator(library: Path, comm_hash: int, n_ranks: int, name: bytes) -> None:
    """One communicator initialised as NCCL initialises it, through the plugin's ncclProfiler_v6 (its ``init``)."""
    handle = ctypes.POINTER(ctypes.c_void_p)
    init = ctypes.CFUNCTYPE(ctypes.c_int, handle, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    plugin = type("Plugin", (ctypes.Structure,), {"_fields_": [("name", ctypes.c_char_p), ("init", init)]})
    context, mask = ctypes.c_void_p(), ctypes.c_int(0)
    plugin.in_dll(ctypes.CDLL(str(library)), "ncclProfiler_v6").init(ctypes.byref(context), comm_hash,
                                                                      ctypes.byref(mask), name, 1, n_ranks, 0, None)


WARM_STEPS = 100  # steps before timing: the recorder then keeps its full nccl_calls.WINDOWS step windows


def recorder_on_nccl_records(steps: int, per_step: int = 200, collective: str = "all_reduce") -> dict[str, float]:
    """The recorder reading NCCL's records: per call, ``track`` on the calling thread and ``end_step``, over ``steps``
    steps after the warm-up ones. ``collective``: "all_reduce", or "send_recv" for NCCL's P2p records of sends."""
    library = nccl_profiler.path()
    if library is None:
        return {}
    comm_hash = 9 if collective == "all_reduce" else 10  # one communicator each: the library is loaded once
    _init_communicator(library, comm_hash=comm_hash, n_ranks=8, name=collective.encode())
    reader = profiler_drain.ProfilerDrain(library)
    rec = Recorder(cuda=False)
    rec.nccl = nccl_calls.NcclCalls(reader, lambda: [nccl_calls.NcclGroup(collective, 8)])
    func = profiler_drain.FUNCTIONS.index("all_reduce" if collective == "all_reduce" else "send")
    record = profiler_drain.RecordC(comm_hash=comm_hash, count=1 << 20, n_ranks=8, func=func, algorithm=1,
                                    protocol=2, type_size=2, channels=8, warps=16, channel_events=8, gpu_start_ns=1,
                                    gpu_stop_ns=1_000_001, peer=1)
    tracked, ended = [], []
    for i in range(WARM_STEPS + steps):
        # matched at step 0's end; its all-reduces recorded from NCCL's from step 1, its sends from step 2
        timed = i >= WARM_STEPS
        rec.begin_step(i)
        cpu = time.thread_time()
        for _ in range(per_step if timed else 1):
            rec.track(collective, collective, 1 << 21)
        tracked.append((time.thread_time() - cpu) / per_step)
        launched = time.monotonic_ns()
        for k in range(per_step if timed else 1):  # one launch each, as ungrouped calls are: after the last stopped
            record.host_start_ns, record.host_stop_ns = launched + k * 100, launched + k * 100 + 50
            reader.push(record)
        cpu = time.thread_time()
        rows = rec.end_step()
        ended.append((time.thread_time() - cpu) / max(1, len(rows)))
        if timed:
            assert len(rows) == per_step and all(r.exact for r in rows), f"{len(rows)} rows for {per_step} calls"
        if i == WARM_STEPS - 1:
            gc.collect()  # what the earlier parts left for the collector is not this part's
    track_us, end_us = _us(tracked[WARM_STEPS:]), _us(ended[WARM_STEPS:])
    mean_us = statistics.fmean(t + e for t, e in zip(tracked[WARM_STEPS:], ended[WARM_STEPS:])) * 1e6
    what = "collective" if collective == "all_reduce" else "send"
    part = f"recorder on NCCL's records, {collective}, {per_step} a step"
    return {f"{part}: track, left at once (cpu)": track_us,
            f"{part}: end_step per {what} (cpu)": end_us,
            f"{part}: added per {what} (cpu)": track_us + end_us,
            f"{part}: added per {what}, mean of {steps} steps (cpu)": mean_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--nccl-steps", type=int, default=1500, help="timed steps of part 4, per step size")
    parser.add_argument("--nccl-per-step", type=int, nargs="+", default=[20, 200],
                        help="calls a step of part 4 (each size a run of its own)")
    args = parser.parse_args()
    rows = {**track_alone(args.calls), **profiler_drain_per_call(args.calls)}
    for per_step in args.nccl_per_step:
        for collective in ("all_reduce", "send_recv"):
            rows |= recorder_on_nccl_records(args.nccl_steps, per_step, collective)
    rows |= all_reduce_pair(args.calls)
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:{width}s} {us:8.2f} us")


if __name__ == "__main__":
    main()
