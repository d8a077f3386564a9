"""Engines built, trained and destroyed one after another in one pair of gloo ranks, with Lagom on.

    .venv/bin/python benchmarks/long_lived.py [--engines 50]

Prints, after the last engine: the wall time, the engines still alive that plain DeepSpeed lets go,
the process groups still carrying Lagom's torch.distributed hooks, whether DeepSpeed's comm backend
is still wrapped, and the change in Python threads, open files and resident memory since the first
Lagom engine. Uses only what every Lagom version has, so it measures a checkout before and after a
change alike.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.distributed import run_ranks  # noqa: E402
from tests.test_long_lived import HW, VARIANTS, _model, _train, ds_config  # noqa: E402


def _engine(rank: int, config: dict[str, Any]) -> weakref.ref:
    import lagom_deepspeed

    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _train(engine, rank)
    engine.destroy()
    return weakref.ref(engine)


def loop(rank: int, world: int, tmp: str, engines: int) -> dict[str, Any]:
    from lagom.runtime.apply import torch_tap
    from lagom_deepspeed import comm

    lets_go = {}
    for variant in VARIANTS:
        ref = _engine(rank, ds_config(*variant))
        gc.collect()
        lets_go[variant] = ref() is None
    threads, files = threading.active_count(), len(os.listdir("/proc/self/fd"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kept = []
    start = time.perf_counter()
    for i in range(engines):
        variant = VARIANTS[i % len(VARIANTS)]
        ref = _engine(rank, ds_config(*variant, lagom={"enabled": True, "hardware": f"{tmp}/hw.yaml",
                                                       "cache_dir": f"{tmp}/cache"}))
        gc.collect()
        if ref() is not None and lets_go[variant]:
            kept.append(ref)
    tap = torch_tap.current_tap()
    return {"seconds": time.perf_counter() - start, "engines_kept": len(kept),
            "hooked_groups": 0 if tap is None else len(tap._hooked),  # noqa: SLF001
            "backend_wrapped": comm.current_tap() is not None,
            "threads": threading.active_count() - threads, "files": len(os.listdir("/proc/self/fd")) - files,
            "max_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "hw.yaml").write_text(HW)
        for rank, out in enumerate(run_ranks(loop, 2, tmp, args.engines)):
            print(f"rank {rank}: {args.engines} Lagom engines in {out['seconds']:.1f} s; engines kept alive {out['engines_kept']}; "
                  f"groups with Lagom hooks {out['hooked_groups']}; deepspeed.comm wrapped {out['backend_wrapped']}; "
                  f"threads {out['threads']:+d}; open files {out['files']:+d}; max RSS {out['max_rss_mb']:+.0f} MB")


if __name__ == "__main__":
    main()
