"""What the NCCL profiler plugin costs per event, in nanoseconds (C, -O2, no sanitizer).

    python benchmarks/profiler_overhead.py [--collectives 1000000] [--channels 4]

Builds the plugin and benchmarks/profiler_overhead.c into a temporary folder and runs the driver for
collectives and for sends: one thread, then four (one communicator each, sharing the process's ring). Per
operation NCCL makes 2 calls on the launching thread (Coll or P2p start and stop) and, between nodes, 4 per
channel on its proxy thread (a network ProxyOp start; a kernel channel's start, state and stop); the driver
reports the launching thread's cost per operation (the figure the 2 us target is about) and the mean per call.
The ring keeps its newest 8192 records; what the run pushed beyond that is dropped and counted, as in a
job that never drains (the worst case for the writers: every push overwrites).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from lagom.nccl_tuner import build

DRIVER = Path(__file__).with_name("profiler_overhead.c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=1_000_000)
    parser.add_argument("--channels", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        plugin = build.compile_profiler(out / "plugin.so")
        driver = build.compile_driver(DRIVER, out / "driver", [build.PROFILER.source_dir], ["-O2"])
        for kind, what in (("coll", "collectives"), ("p2p", "sends")):
            for threads in (1, 4):
                done = subprocess.run([str(driver), str(plugin), str(threads), str(args.collectives // threads),
                                       str(args.channels), kind], capture_output=True, text=True, check=True)
                words = done.stdout.split()
                fields = dict(zip(words[::2], words[1::2]))
                print(f"{threads} thread(s), {fields['operations']} {what} x {fields['channels']} channels: "
                      f"{fields['launch_ns_per_operation']} ns per operation on the launching thread, "
                      f"{fields['ns_per_event']} ns per plugin call ({fields['drained']} drained, "
                      f"{fields['overwritten']} overwritten)")


if __name__ == "__main__":
    main()
