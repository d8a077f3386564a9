"""Everything this project owes a GPU, in one driver that fits a short lease (10 minutes a command).

    python benchmarks/gpu_suite.py --out benchmarks/results/<date>-<gpu> [--parts calibrate,cuda,window,profiler]
                                   [--budget-s 240] [--part-timeout-s 540]

Each part runs in its own process under a time limit and writes its CSV and log into ``--out``; a part
that fails writes its exact error (``<part>.error``) and the driver goes on with the next:

1. ``calibrate``: ``lagom calibrate --contention`` on this GPU (one rank: the comm-like kernel stands in
   for collectives), the fitted profile and its samples as CSV; then two ranks on one GPU (separate
   processes with different ``NCCL_HOSTID``, and under MPS where ``nvidia-cuda-mps-control`` exists), with
   what happened recorded in ``two_ranks.csv``.
2. ``cuda``: Lagom's CUDA paths: the recorder's device events against a timed kernel;
   ``ProcessGroupNCCL.Options`` from a plan read back from the communicator; the tuner plugin loaded by
   the real NCCL (``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING``), its log lines checked against the rules;
   a live table switched between steps on two ranks in two phases, NCCL's TUNING lines showing the new
   protocol and channel count after it, an LL chunk above LL's cap run, and the plugin's counters of NCCL's
   calls checked.
3. ``window``: a layer's FFN GEMMs beside the next layer's parameter all-gather (emulated on one GPU): the
   makespan at every (channels, chunk) pair, and at the pairs the ``nccl``, ``autoccl`` and ``lagom``
   strategies pick on the calibrated model. Targets: Lagom >= 1.15x faster than AutoCCL's pick and within
   3% of the measured best; the figures are written whether or not they are met.
4. ``profiler``: both of Lagom's plugins loaded into the real NCCL by two ranks on one GPU (as ``two_ranks``),
   all-reduces at two sizes under two tuner rules (ring Simple on 2 channels, ring LL on 1), each call timed by
   CUDA events around it, then sends from rank 0 to rank 1; the profiler's records, drained as the recorder
   drains them, must show each rule's algorithm, protocol, channels and chunk (the two ranks' host ids differ,
   so NCCL moves the data through its network proxy, whose operations report the chunk), each send and receive
   with its peer and bytes, and GPU times within the events' (``profiler_vs_events.csv``, ``profiler_nccl.log``).

Every part needs a CUDA device: without one the driver says so and runs nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = ("calibrate", "cuda", "window", "profiler")
REPO = Path(__file__).resolve().parent.parent
WINDOW_WORKLOAD = "llama3-8b-fsdp"
WINDOW_CHANNELS = (1, 2, 4, 8, 16, 32, 64)
WINDOW_CHUNKS = (65536, 131072, 524288, 2097152, 8388608)
REPEATS = 7


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def profile_path(out: Path) -> Path:
    return out / "contention-profile.yaml"


def base_preset() -> str:
    """The shipped preset for this GPU (the profile builds on it)."""
    import torch

    from lagom.hardware import closest_preset

    name = closest_preset(torch.cuda.get_device_name(), gpus_per_node=8, nodes=1)
    if name is None:
        raise RuntimeError(f"no preset for GPU '{torch.cuda.get_device_name()}'")
    return name


# ---------------------------------------------------------------------------------------------
# Part 1: contention profiling


def part_calibrate(out: Path, budget_s: float) -> None:
    from lagom.cli import main
    from lagom.hardware import load_hardware

    code = main(["calibrate", "--base", base_preset(), "--contention", "--ranks", "1", "--out", str(profile_path(out)),
                 "--name", f"{base_preset()}-contention", "--budget-s", str(budget_s)])
    if code != 0:
        raise RuntimeError(f"lagom calibrate --contention exited {code}")
    section = load_hardware(str(profile_path(out))).calibration["contention"]
    rows = []
    for s in section["samples"]:
        rows.append({"id": s["id"], "kernel": json.dumps(s["kernel"]), "collective": s["collective"], "bytes": s["bytes"],
                     "channels": s["config"]["channels"], "chunk_bytes": s["config"]["chunk_bytes"],
                     "protocol": s["config"]["protocol"], "source": s["source"],
                     "role": "check" if s["id"] in section["fit"]["held_out_ids"] else "fit",
                     **{k: s[k] for k in ("kernel_alone_s", "kernel_beside_s", "comm_alone_s", "comm_beside_s")}})
    write_csv(out / "contention_samples.csv", rows)
    (out / "contention_fit.json").write_text(json.dumps(section["fit"], indent=2))
    two_ranks(out)


TWO_RANKS = """
import os, sys, datetime, torch, torch.distributed as dist
rank = int(sys.argv[1])
os.environ["NCCL_HOSTID"] = f"lagom-suite-host-{rank}"
dist.init_process_group("nccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.cuda.set_device(0)
t = torch.full((1 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("all_reduce", t[0].item())
dist.destroy_process_group()
"""


def _run_pair(script: str, env: dict[str, str], rendezvous: Path) -> tuple[list[int | None], list[str]]:
    """``script`` as ranks 0 and 1 (argv: rank, rendezvous file); their exit codes and outputs."""
    rendezvous.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(rendezvous)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n[killed after 120 s]")
    return [p.returncode for p in procs], outputs


def _two_processes(label: str, env: dict[str, str], folder: Path) -> dict[str, Any]:
    codes, outputs = _run_pair(TWO_RANKS, env, folder / f"rendezvous-{label}")
    ok = all(c == 0 for c in codes) and all("all_reduce 3.0" in o for o in outputs)
    (folder / f"two_ranks_{label}.log").write_text("\n---\n".join(outputs))
    last = [line for o in outputs for line in o.splitlines() if line.strip()][-1:] or [""]
    return {"setup": label, "worked": ok, "exit_codes": " ".join(str(c) for c in codes), "last_line": last[0]}


def two_ranks(out: Path) -> None:
    """Two NCCL ranks on one GPU: plain (NCCL refuses duplicate GPUs unless the host ids differ), then MPS."""
    rows = [_two_processes("hostid", dict(os.environ), out)]
    mps = shutil.which("nvidia-cuda-mps-control")
    if mps is None:
        rows.append({"setup": "mps", "worked": False, "exit_codes": "", "last_line": "nvidia-cuda-mps-control not found"})
    else:
        pipes = out / "mps"
        pipes.mkdir(exist_ok=True)
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipes), "CUDA_MPS_LOG_DIRECTORY": str(pipes)}
        started = subprocess.run([mps, "-d"], env=env, capture_output=True, text=True, timeout=30)
        try:
            rows.append(_two_processes("mps", env, out) if started.returncode == 0 else
                        {"setup": "mps", "worked": False, "exit_codes": str(started.returncode),
                         "last_line": (started.stderr or started.stdout).strip()[-200:]})
        finally:
            subprocess.run([mps], input="quit\n", env=env, capture_output=True, text=True, timeout=30)
    write_csv(out / "two_ranks.csv", rows)


# ---------------------------------------------------------------------------------------------
# Part 2: Lagom's CUDA paths


def _check(rows: list[dict[str, Any]], name: str, fn: Callable[[], str]) -> None:
    try:
        rows.append({"check": name, "passed": True, "detail": fn()})
    except Exception as err:  # noqa: BLE001 - each check says what failed and the next one runs
        rows.append({"check": name, "passed": False, "detail": f"{type(err).__name__}: {err}"})


def _recorder_events() -> str:
    """A collective's recorded duration (device events) against the same call timed by events around it."""
    import torch
    import torch.distributed as dist

    from lagom.runtime.apply.recorder import Recorder

    recorder = Recorder(cuda=True)
    t = torch.randn(1 << 26, device="cuda")
    dist.all_reduce(t)
    recorder.begin_step(0)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    recorder.track("dp", "all_reduce", t.numel() * 4, dist.all_reduce(t, async_op=True))
    end.record()
    torch.cuda.synchronize()
    records = recorder.end_step()
    outer = begin.elapsed_time(end) / 1e3
    if len(records) != 1 or not 0 < records[0].duration_s <= outer * 1.05:
        raise AssertionError(f"recorded {[r.duration_s for r in records]} s, outer events {outer} s")
    return f"recorded {records[0].duration_s * 1e6:.1f} us inside {outer * 1e6:.1f} us"


def _options_read_back() -> str:
    import torch
    import torch.distributed as dist

    from lagom.runtime.apply.runtime import nccl_options

    cfg = {"max_ctas": 4, "min_ctas": 2, "is_high_priority_stream": True}
    group = dist.new_group([0], pg_options=nccl_options(cfg))
    backend = group._get_backend(torch.device("cuda"))
    options = backend.options
    got = {"max_ctas": options.config.max_ctas, "min_ctas": options.config.min_ctas,
           "is_high_priority_stream": options.is_high_priority_stream}
    dist.destroy_process_group(group)
    if got != cfg:
        raise AssertionError(f"communicator has {got}, plan asked {cfg}")
    return json.dumps(got)


TUNER_CHECK = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.randn(1 << 24, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
dist.destroy_process_group()
"""


def _plugin_env(rules: Path, text: str) -> dict[str, str]:
    """The environment of a process whose NCCL loads Lagom's plugin with ``text`` as its rules file, logging
    its INIT and TUNING lines."""
    from lagom import nccl_tuner

    plugin = nccl_tuner.path()
    if plugin is None:
        raise RuntimeError(nccl_tuner.UNAVAILABLE)
    rules.write_text(text)
    rules.chmod(0o600)
    return {**os.environ, "NCCL_TUNER_PLUGIN": str(plugin), nccl_tuner.RULES_FILE_ENV: str(rules),
            "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING"}


def _tuner_plugin_loaded(out: Path) -> str:
    """NCCL loads Lagom's plugin and its rules file (its log says which rules apply to the communicator)."""
    env = {**_plugin_env(out / "tuner_rules.lagom", "lagom-nccl-tuner 1\nworld 1\n"
                         "allreduce 1 1099511627776 1 1 ring simple 2 2097152\n"), "WORLD_SIZE": "1"}
    rendezvous = out / "rendezvous-tuner"
    rendezvous.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", TUNER_CHECK, str(rendezvous)], env=env, capture_output=True,
                          text=True, timeout=180)
    log = done.stdout + done.stderr
    (out / "tuner_plugin_nccl.log").write_text(log)
    lagom_lines = [line for line in log.splitlines() if "Lagom tuner" in line]
    if done.returncode != 0 or not lagom_lines:
        raise AssertionError(f"exit {done.returncode}; Lagom lines: {lagom_lines[:3]}")
    return "; ".join(lagom_lines[:3])


# Two NCCL ranks on one GPU (as ``two_ranks``) with Lagom's plugin: each rank stages a live table, the ranks agree
# (a barrier, as the session's acknowledgement), each publishes it, and runs three 16 MiB all-reduces; then a table
# with another protocol and channel count, and three more. The LL rule asks for a 64 KiB chunk, above LL's 32 KiB
# cap, which NCCL clamps (its log does not print chunks: the calls must run and the rule must apply). NCCL's TUNING
# log says which protocol and channels each call got (proto 2 Simple, 0 LL); the plugin's counters say how often
# NCCL consulted it and how many calls a rule applied to.
LIVE_SWITCH = """
import datetime, os, sys, torch, torch.distributed as dist
from lagom.nccl_tuner.live import LiveTable
rank = int(sys.argv[1])
os.environ["NCCL_HOSTID"] = f"lagom-suite-host-{rank}"
os.environ["NCCL_DEBUG_FILE"] = os.environ["LAGOM_SUITE_LOG"] + f".{rank}"
table = LiveTable.create(2)
dist.init_process_group("nccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.cuda.set_device(0)
t = torch.ones(1 << 22, device="cuda")
before = table.counters()
for proto, channels, chunk in (("simple", 2, 131072), ("ll", 1, 65536)):
    rules = "".join(f"allreduce 1048576 1099511627776 2 {n} ring {proto} {channels} {chunk}\\n" for n in (1, 2))
    table.stage(f"lagom-nccl-tuner 1\\nworld 2\\n{rules}")
    dist.barrier()
    table.publish()
    torch.cuda.synchronize()
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
calls = table.counters().since(before)
print(f"switched counters {calls.inits} {calls.coll_infos} {calls.applied}", flush=True)
table.close()
dist.destroy_process_group()
"""
PROTO_LINE = r"AllReduce: 16777216 Bytes -> Algo \w+ proto (\w+) channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}"
COUNTERS_LINE = r"switched counters (\d+) (\d+) (\d+)"


def _live_switch_reaches_nccl(out: Path) -> str:
    """The live table changed between steps, in two phases, reaches NCCL: the calls after the switch run the new
    protocol and channel count, and the plugin's counters saw NCCL consult it for each call."""
    import re

    log = out / "live_switch_nccl.log"
    env = {**_plugin_env(out / "live_start.lagom", "lagom-nccl-tuner 1\nworld 2\n"), "LAGOM_SUITE_LOG": str(log)}
    codes, outputs = _run_pair(LIVE_SWITCH, env, out / "rendezvous-live")
    text = Path(f"{log}.0").read_text() if Path(f"{log}.0").exists() else ""  # NCCL logs TUNING lines on rank 0
    names = {"0": "ll", "1": "ll128", "2": "simple"}  # NCCL releases that print the protocol's number
    calls = [(names.get(m.group(1), m.group(1).lower()), int(m.group(3)) - int(m.group(2)) + 1)
             for m in re.finditer(PROTO_LINE, text)]
    counters = [tuple(int(g) for g in m.groups()) for o in outputs for m in re.finditer(COUNTERS_LINE, o)]
    log.write_text("\n---\n".join(outputs) + f"\nrank 0 (protocol, channels) per call: {calls}\ncounters: {counters}")
    want = [("simple", 2)] * 3 + [("ll", 1)] * 3
    if codes != [0, 0] or calls != want:
        raise AssertionError(f"exit codes {codes}; rank 0's (protocol, channels) per call {calls}, want {want}; "
                             f"see {log.name}")
    if len(counters) != 2 or any(coll_infos < 6 or applied < 6 for _, coll_infos, applied in counters):
        raise AssertionError(f"the plugin's counters (inits, getCollInfo calls, applied) per rank: {counters}; want "
                             f"at least 6 calls and 6 applied rules on each rank")
    return f"rank 0: {calls} across the two-phase switch (LL at a 64 KiB chunk ran); counters {counters}"


def part_cuda(out: Path, budget_s: float) -> None:
    import torch
    import torch.distributed as dist

    rows: list[dict[str, Any]] = []
    rendezvous = out / "rendezvous-cuda"
    rendezvous.unlink(missing_ok=True)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        _check(rows, "recorder device events", _recorder_events)
        _check(rows, "ProcessGroupNCCL.Options read back", _options_read_back)
    finally:
        dist.destroy_process_group()
    _check(rows, "tuner plugin loaded by NCCL", lambda: _tuner_plugin_loaded(out))
    _check(rows, "live table switch reaches NCCL (two ranks on one GPU)", lambda: _live_switch_reaches_nccl(out))
    rows.append({"check": "Flash-Overlap exact on CUDA streams", "passed": False,
                 "detail": "needs two NCCL ranks: see two_ranks.csv for whether this GPU can host them"})
    write_csv(out / "cuda_paths.csv", rows)


# ---------------------------------------------------------------------------------------------
# Part 3: one compute-bound window, measured against the strategies' picks


def strategy_picks(profile: Path) -> dict[str, tuple[int, int]]:
    """(channels, chunk) of the parameter all-gather each strategy picks on the calibrated model."""
    from lagom.hardware import load_hardware, with_cluster
    from lagom.search import run_strategy
    from lagom.step.workload import load_workload
    from lagom.tune import problem_for

    wl = load_workload(WINDOW_WORKLOAD)
    hw = load_hardware(str(profile))
    hw = with_cluster(hw, hw.cluster.gpus_per_node, max(1, wl.world_size // hw.cluster.gpus_per_node))
    problem = problem_for(wl, hw)
    key = next(k for k, pts in problem.graph.keys().items() if pts[0].collective == "all_gather")
    picks = {}
    for name in ("nccl", "autoccl", "lagom"):
        cfg = run_strategy(name, problem).configs[key]
        picks[name] = (cfg.channels, cfg.chunk_bytes)
    return picks


def part_window(out: Path, budget_s: float) -> None:
    import torch

    from lagom.runtime.measure.comm_kernel import stream_chunks
    from lagom.step.workload import load_workload

    profile = profile_path(out)
    if not profile.is_file():
        raise RuntimeError(f"{profile} is missing: run the calibrate part first")
    wl = load_workload(WINDOW_WORKLOAD)
    m = wl.model
    tokens = wl.training.micro_batch * m.seq_len
    up = torch.randn(tokens, m.hidden, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(m.hidden, 2 * m.ffn, device="cuda", dtype=torch.bfloat16)
    mid = torch.empty(tokens, 2 * m.ffn, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(2 * m.ffn, m.hidden, device="cuda", dtype=torch.bfloat16)
    down = torch.empty(tokens, m.hidden, device="cuda", dtype=torch.bfloat16)
    layer_params = (m.hidden * (m.hidden + 2 * m.hidden * (m.kv_heads or m.heads) // m.heads + m.hidden)
                    + 3 * m.hidden * m.ffn)
    src = torch.randn(layer_params // 2, device="cuda", dtype=torch.bfloat16)  # one rank's half of two
    dst = torch.empty_like(src)
    compute, comm = torch.cuda.Stream(), torch.cuda.Stream()

    def makespan(channels: int, chunk: int) -> float:
        times = []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            start.record()
            compute.wait_event(start)
            comm.wait_event(start)
            with torch.cuda.stream(comm):
                stream_chunks(src, dst, ctas=channels, chunk_bytes=chunk)
                ends[0].record()
            with torch.cuda.stream(compute):
                torch.mm(up, w_up, out=mid)
                torch.mm(mid, w_down, out=down)
                ends[1].record()
            torch.cuda.synchronize()
            times.append(max(start.elapsed_time(e) for e in ends) / 1e3)
        return statistics.median(times)

    deadline = time.perf_counter() + budget_s
    makespan(8, 2097152)  # warm-up
    grid = {}
    for channels in WINDOW_CHANNELS:
        for chunk in WINDOW_CHUNKS:
            if time.perf_counter() > deadline:
                break
            grid[(channels, chunk)] = makespan(channels, chunk)
    picks = strategy_picks(profile)
    rows = [{"kind": "grid", "channels": c, "chunk_bytes": k, "makespan_s": t} for (c, k), t in grid.items()]
    for name, (channels, chunk) in picks.items():
        rows.append({"kind": name, "channels": channels, "chunk_bytes": chunk, "makespan_s": makespan(channels, chunk)})
    write_csv(out / "window.csv", rows)
    measured = {r["kind"]: r["makespan_s"] for r in rows if r["kind"] != "grid"}
    best = min(grid.values())
    summary = {"lagom_over_autoccl": measured["autoccl"] / measured["lagom"], "target_over_autoccl": 1.15,
               "lagom_over_best": measured["lagom"] / best, "target_over_best": 1.03,
               "picks": {k: list(v) for k, v in picks.items()}, "best": list(min(grid, key=grid.__getitem__))}
    (out / "window_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


# ---------------------------------------------------------------------------------------------
# Part 4: the profiler plugin inside the real NCCL, against the tuner's rules and CUDA events


# (bytes, algorithm, protocol, channels, chunk): one tuner rule per size, both sizes run by each rank
PROFILED_RULES = ((1 << 20, "ring", "simple", 2, 131072), (8 << 20, "ring", "ll", 1, 16384))
PROFILED_CALLS = 5  # timed calls per size, after one untimed
# Each rank: NCCL loads both plugins (the environment names them); one untimed call per size, then the timed ones
# with CUDA events on the current stream around each (the wait torch adds makes the end event follow the
# collective), then as many timed sends of the first size from rank 0 to rank 1 (a receive on rank 1); the records
# are drained once, after a pause for the proxy thread's last kernel-channel events.
PROFILER_CHECK = """
import dataclasses, datetime, json, os, sys, time, torch, torch.distributed as dist
from lagom.nccl_profiler.drain import ProfilerDrain
rank = int(sys.argv[1])
os.environ["NCCL_HOSTID"] = f"lagom-suite-host-{rank}"
os.environ["NCCL_DEBUG_FILE"] = os.environ["LAGOM_SUITE_LOG"] + f".{rank}"
sizes, calls = json.loads(os.environ["LAGOM_SUITE_SIZES"]), int(os.environ["LAGOM_SUITE_CALLS"])
reader = ProfilerDrain()
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
tensors = [torch.ones(n // 4, device="cuda") for n in sizes]
for t in tensors:
    dist.all_reduce(t)
torch.cuda.synchronize()
time.sleep(0.5)
reader.drain()
events = []
def timed(call):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    call()
    end.record()
    return begin, end
for t in tensors:
    events += [timed(lambda: dist.all_reduce(t)) for _ in range(calls)]
transfer = (lambda: dist.send(tensors[0], 1)) if rank == 0 else (lambda: dist.recv(tensors[0], 0))
p2p_events = [timed(transfer) for _ in range(calls)]
torch.cuda.synchronize()
time.sleep(0.5)
records = reader.drain().collectives()
print("profiled " + json.dumps({"rank": rank, "stats": dataclasses.asdict(reader.stats()), "events_us": [
    b.elapsed_time(e) * 1e3 for b, e in events], "p2p_events_us": [b.elapsed_time(e) * 1e3 for b, e in p2p_events],
    "records": [{"function": r.function, "bytes": r.bytes, "algorithm": r.algorithm, "protocol": r.protocol,
                 "channels": r.channels, "chunk": r.chunk_bytes, "peer": r.peer, "source": r.time_source,
                 "us": r.duration_ns / 1e3} for r in records]}), flush=True)
dist.destroy_process_group()
"""


def _profiled(out: Path) -> list[dict[str, Any]]:
    """Both ranks' profiled calls beside their CUDA-event times, one row per call."""
    from lagom import nccl_profiler

    library = nccl_profiler.path()
    if library is None:
        raise RuntimeError(nccl_profiler.UNAVAILABLE)
    rules = "".join(f"allreduce {int(n * 0.95)} {int(n * 1.05)} 2 {nodes} {a} {p} {c} {chunk}\n"
                    for n, a, p, c, chunk in PROFILED_RULES for nodes in (1, 2))
    log = out / "profiler_nccl.log"
    env = {**_plugin_env(out / "profiler_rules.lagom", f"lagom-nccl-tuner 1\nworld 2\n{rules}"),
           nccl_profiler.PLUGIN_ENV: str(library), "LAGOM_SUITE_LOG": str(log),
           "LAGOM_SUITE_SIZES": json.dumps([n for n, *_ in PROFILED_RULES]), "LAGOM_SUITE_CALLS": str(PROFILED_CALLS)}
    codes, outputs = _run_pair(PROFILER_CHECK, env, out / "rendezvous-profiler")
    log.write_text("\n---\n".join(outputs))
    reports = [json.loads(line[len("profiled "):]) for o in outputs for line in o.splitlines()
               if line.startswith("profiled ")]
    if codes != [0, 0] or len(reports) != 2:
        raise AssertionError(f"exit codes {codes}, {len(reports)} ranks reported; see {log.name}")
    rows = []
    for report in reports:
        rank = report["rank"]
        records = [r for r in report["records"] if r["function"] == "all_reduce"]
        transfers = [r for r in report["records"] if r["function"] in ("send", "recv")]
        if len(records) != len(report["events_us"]) or len(transfers) != len(report["p2p_events_us"]):
            raise AssertionError(f"rank {rank}: {len(records)} all-reduce records for {len(report['events_us'])} "
                                 f"calls, {len(transfers)} send/recv records for {len(report['p2p_events_us'])}; "
                                 f"stats {report['stats']}")
        for i, (record, events_us) in enumerate(zip(records, report["events_us"])):
            nbytes, algorithm, protocol, channels, chunk = PROFILED_RULES[i // PROFILED_CALLS]
            rows.append(_profiled_row(rank, nbytes, f"{algorithm}/{protocol} x{channels} c={chunk}",
                                      f"{record['algorithm']}/{record['protocol']} x{record['channels']} "
                                      f"c={record['chunk']}", record, events_us))
        function, peer = ("send", 1) if rank == 0 else ("recv", 0)
        for record, events_us in zip(transfers, report["p2p_events_us"]):
            # NCCL decides a transfer's channels and chunk: the row says what it chose, the check its peer and kind
            rows.append(_profiled_row(rank, PROFILED_RULES[0][0], f"{function} to/from {peer}",
                                      f"{record['function']} to/from {record['peer']}", record, events_us,
                                      f"x{record['channels']} c={record['chunk']}"))
    return rows


def _profiled_row(rank: int, nbytes: int, rule: str, ran: str, record: dict[str, Any], events_us: float,
                  chose: str = "") -> dict[str, Any]:
    return {"rank": rank, "bytes": nbytes, "rule": rule, "ran": ran, "nccl_chose": chose,
            "record_bytes": record["bytes"], "time_source": record["source"], "profiler_us": round(record["us"], 2),
            "events_us": round(events_us, 2), "ratio": round(record["us"] / events_us, 3) if events_us > 0 else None}


def part_profiler(out: Path, budget_s: float) -> None:
    """The profiler's account against the rules NCCL was given and against CUDA events (``profiler_vs_events.csv``).
    An all-reduce must run its size's rule, its chunk included (NCCL's network proxy reports it); a send or receive
    must name its peer and bytes; each must report GPU times no longer than the events around it, nor under a tenth
    of them (the events also cover the launch and torch's stream wait)."""
    rows = _profiled(out)
    write_csv(out / "profiler_vs_events.csv", rows)
    wrong = [r for r in rows if r["ran"] != r["rule"] or r["record_bytes"] != r["bytes"]]
    untimed = [r for r in rows if r["time_source"] != "gpu" or r["ratio"] is None or not 0.1 <= r["ratio"] <= 1.05]
    ratios = sorted(r["ratio"] for r in rows if r["ratio"] is not None)
    summary = (f"{len(rows)} calls; profiler/events time ratio median {ratios[len(ratios) // 2] if ratios else None}, "
               f"range {ratios[0] if ratios else None}..{ratios[-1] if ratios else None}")
    (out / "profiler_summary.txt").write_text(summary + "\n")
    if wrong or untimed:
        raise AssertionError(f"{summary}; {len(wrong)} calls not as their rule (e.g. {wrong[:1]}), {len(untimed)} "
                             f"without GPU times within the events' (e.g. {untimed[:1]})")


# ---------------------------------------------------------------------------------------------
# The driver


def run_part(name: str, out: Path, budget_s: float) -> None:
    """In this process: one part, its error written beside its outputs."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.error").unlink(missing_ok=True)
    try:
        {"calibrate": part_calibrate, "cuda": part_cuda, "window": part_window,
         "profiler": part_profiler}[name](out, budget_s)
    except Exception:
        (out / f"{name}.error").write_text(traceback.format_exc())
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the CSVs, logs and the fitted profile")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=240.0, help="measuring time per part (default 240)")
    parser.add_argument("--part-timeout-s", type=float, default=540.0, help="a part still running then is killed")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # the driver runs each part in a child process
    args = parser.parse_args()
    out = Path(args.out)
    if args.part:
        run_part(args.part, out, args.budget_s)
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (use {', '.join(PARTS)})")
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_suite: skipped, no CUDA device here (torch {torch.__version__}); every part ({', '.join(parts)}) "
              "runs NCCL or CUDA kernels on a GPU")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for part in parts:
        started = time.perf_counter()
        with (out / f"{part}.log").open("w") as log:
            try:
                done = subprocess.run([sys.executable, __file__, "--part", part, "--out", str(out),
                                       "--budget-s", str(args.budget_s)], stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.part_timeout_s, cwd=REPO)
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = -1
                (out / f"{part}.error").write_text(f"killed after {args.part_timeout_s:g} s\n")
        print(f"{part}: {'ok' if code == 0 else 'FAILED'} in {time.perf_counter() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(part)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
