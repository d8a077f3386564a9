"""Online mode's live loop end to end: real DeepSpeed engines on 2 and 4 gloo ranks, and a test plant.

gloo ignores NCCL's settings, so the plant makes them matter: after each step's compute it sleeps by a
known function of the channels that the tuner plugin's live table gives the job's collectives, read
through the plugin's own C reader (``LiveTable.lookup``), plus noise. The loop must find the plant's
optimum within the noise, never end slower than it started, switch every rank at the same steps, and
leave the losses as plain DeepSpeed's (settings change nothing but reduction order, and gloo ignores them).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lagom import nccl_tuner
from tests.distributed import run_ranks
from tests.test_long_lived import EXAMPLES, HW, _model, ds_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytestmark = pytest.mark.skipif(nccl_tuner.path() is None, reason="needs the tuner plugin built (a C compiler)")
STEPS = 70
PLANT_MS = 6.0  # the plant's cost of one collective at the worst channel count
NOISE_MS = 0.3


def plant_seconds(session: Any) -> tuple[float, tuple]:
    """The plant's delay for the settings in force: per planned collective, PLANT_MS x log2(channels) / 5
    (so one channel is cheapest, 32 dearest: a compute-bound job); NCCL's own choice (no rule) counts as
    8 channels. Also what the table said, to compare ranks."""
    seen = []
    total = 0.0
    for e in session.live_reference.entries if session.live_reference is not None else session.plan.entries:
        choice = session.live_table.lookup(e.collective, e.bytes, e.group_size, e.group_nodes)
        channels = choice.channels if choice is not None and choice.channels > 0 else 8
        seen.append(channels)
        total += PLANT_MS * math.log2(channels) / 5 / 1e3
    return total, tuple(seen)


def live_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import deepspeed

    import lagom_deepspeed

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import batch

    def run(engine: Any, steps: int, plant: bool) -> tuple[list[float], list[tuple]]:
        rng = random.Random(rank)
        losses, seen = [], []
        for step in range(steps):
            loss = engine(*batch(step, rank, 2))
            engine.backward(loss)
            if plant:
                delay, table = plant_seconds(engine.lagom)
                seen.append(table)
                time.sleep(delay + abs(rng.gauss(0, NOISE_MS)) / 1e3)
            engine.step()
            losses.append(loss.item())
        return losses, seen

    model = _model()
    plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2, False, False))
    reference, _ = run(plain, STEPS, plant=False)
    plain.destroy()
    section = {"enabled": True, "hardware": f"{tmp}/hw.yaml", "cache_dir": f"{tmp}/cache", "mode": "online",
               "tune_steps": STEPS - 5, "report": f"{tmp}/report-{rank}", "collective_timeout_s": 60}
    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(2, False, False, lagom=section))
    losses, seen = run(engine, STEPS, plant=True)
    session = engine.lagom
    out = {"same_losses": losses == reference, "seen": seen, "live_on": session.live_on, "off": session.off,
           "trials": len(session.trials)}
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_live_search_finds_the_plants_optimum_and_every_rank_switches_together(tmp_path: Path, world: int) -> None:
    (tmp_path / "hw.yaml").write_text(HW.replace("gpus_per_node: 2", f"gpus_per_node: {world}"))
    ranks = run_ranks(live_rank, world, str(tmp_path))
    for rank, out in enumerate(ranks):
        assert out["same_losses"], f"rank {rank}: losses differ from plain DeepSpeed's"
        assert out["off"] is None and not out["live_on"], f"rank {rank}: {out['off'] or 'still tuning at the end'}"
        assert out["seen"] == ranks[0]["seen"], f"rank {rank} ran other settings than rank 0 at some step"
    report = json.loads((tmp_path / "report-0.json").read_text())
    trials = report["trials"]
    assert trials and report["live"]["steps"] <= STEPS - 5
    seen = ranks[0]["seen"]
    start, end = sum(math.log2(c) for c in seen[0]), sum(math.log2(c) for c in seen[-1])
    assert end <= start  # never ends slower than the baseline
    best = min(sum(math.log2(c) for c in s) for s in seen)
    assert end == best  # the cheapest setting any step ran is where it ends: its gain was beyond the noise
    assert end < start, "the plant rewards fewer channels; the search found nothing"
