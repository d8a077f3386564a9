"""The live loop on a null plant: 2 gloo ranks whose steps do not depend on the settings tried (as on gloo, where
NCCL's settings change nothing), with noise; the share of trials it accepts is its false-accept rate.

    .venv/bin/python benchmarks/live_null_plant.py [--trials 200] [--noise 0.02] [--step-ms 20]

Each round is a fresh online session (the real agreement, two-phase table switches and live search) on a small
planned job; every step reports one call per plan key and sleeps ``step-ms`` times (1 + Gaussian noise). Rounds
run until ``--trials`` trials were judged. Prints the trials, the accepted ones, the rate and the live search's
significance level (``lagom.runtime.online.live.ALPHA``); the target is a rate of at most 5%.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks  # noqa: E402


def rounds(rank: int, world: int, trials: int, noise: float, step_ms: float, tmp: str) -> dict[str, Any]:
    from lagom.runtime.online.live import ALPHA
    from lagom.runtime.online.session import TuningSession
    from lagom.runtime.online.state import SessionOptions
    from tests.test_live_safety import job

    rng = random.Random(1000 + rank)
    judged = accepted = refused = steps = sessions = 0
    started = time.perf_counter()
    while judged < trials:
        wl, hw = job(tmp)
        options = SessionOptions(mode="online", tune_steps=400, cache_dir=Path(tmp) / f"cache-{sessions}-{rank}",
                                 collective_timeout_s=60, drift_check_steps=10_000, tune_seconds=600)
        session = TuningSession(wl, hw, options, world_size=world)
        session.start()
        sessions += 1
        while session.steps_seen < 5 or session.tuning_underway:
            session.begin_step()
            start = time.perf_counter()
            for e in session.plan.entries if session.plan is not None else []:
                session.runtime.recorder.ended(e.group, e.collective, e.bytes, start, start + 1e-4)
            # the same noise on both ranks' clocks would be one job; each rank's own is the slowest rank's spread
            time.sleep(max(0.0, step_ms / 1e3 * (1 + rng.gauss(0, noise))))
            session.end_step()
            steps += 1
        round_trials = [t for t in session.trials if not t.note.startswith("final check")]
        judged += len([t for t in round_trials if t.decision != "refused"])
        refused += len([t for t in round_trials if t.decision == "refused"])
        accepted += session.live_summary.get("accepted", 0)
        session.close()
    return {"trials": judged, "accepted": accepted, "refused": refused, "steps": steps, "sessions": sessions,
            "alpha": ALPHA, "seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--noise", type=float, default=0.02, help="relative standard deviation of a step")
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(rounds, 2, args.trials, args.noise, args.step_ms, tmp)[0]
    rate = out["accepted"] / out["trials"] if out["trials"] else 0.0
    print(f"null plant, 2 gloo ranks, noise {args.noise:.1%} per step, {args.step_ms:g} ms steps: "
          f"{out['trials']} trials judged in {out['sessions']} sessions ({out['steps']} steps, {out['seconds']:.0f} s), "
          f"{out['accepted']} accepted: false-accept rate {rate:.1%} (the test's alpha {out['alpha']:.0%}; "
          f"target <= 5%); {out['refused']} refused unscored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
