"""Lagom in a process that outlives its engines (test suites, sweeps, notebooks), and Lagom's own collectives.

One pair of gloo ranks builds, trains and destroys DeepSpeed engines one after another, through ZeRO 0
to 3, CPU optimizer offload on and off, fp32 and bf16, with and without a lagom section. After each
engine: its losses equal plain DeepSpeed's for the same configuration step for step, no Lagom hook is
left on any process group, nothing Lagom made outlives the engine (the engine itself is collected
wherever DeepSpeed alone lets it go), the thread count is back where it started and no file opened since
is still open. ``LAGOM_LONG_LIVED_ENGINES`` sets how many engines (``make test``: 16; CI's slow tier: 50).

Then Lagom's own collectives with a failure injected on one rank: the start plan, the online plan and
the agreement of an online step. No rank hangs, each logs one error, and training goes on with
DeepSpeed's own settings and the same losses.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "deepspeed"
ENGINES = int(os.environ.get("LAGOM_LONG_LIVED_ENGINES", "16"))
STEPS = 2
HW = "base: a100-8x-100g\ncluster: {gpus_per_node: 2, nodes: 1}\n"
# (ZeRO stage, CPU optimizer offload, bf16): every stage, offload where ZeRO has an optimizer to offload
VARIANTS = [(stage, offload, bf16) for bf16 in (False, True) for stage in (0, 1, 2, 3)
            for offload in ((False, True) if stage else (False,))]


def ds_config(stage: int, offload: bool, bf16: bool, lagom: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                           "steps_per_print": 10_000, "zero_force_ds_cpu_optimizer": False,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                                                 "allgather_bucket_size": 4000}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if lagom is not None:
        cfg["lagom"] = lagom
    return cfg


def open_files() -> set[tuple[str, str]]:
    """Every open descriptor with what it points at: a leak is one that was not open before, whereas a
    descriptor DeepSpeed or gloo held at the start and closes later (a retained ZeRO-3 engine collected) is not."""
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            files.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # closed between the listing and the read (listdir's own descriptor among them)
            continue
    return files


def lagom_hooks() -> int:
    """Process groups that still carry the torch tap's hooks (Lagom's hook id on either side)."""
    from lagom.runtime.apply import torch_tap
    tap = torch_tap.current_tap()
    return 0 if tap is None else len(tap._hooked)  # noqa: SLF001


def lagom_state() -> dict[str, Any]:
    """Everything Lagom can leave in a process, as it can be compared with the state before Lagom ran."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist

    from lagom.runtime.apply import runtime as apply
    from lagom.runtime.online import session
    from lagom_deepspeed import comm

    return {"torch_tap_hooks": lagom_hooks(), "backend_tap": comm.current_tap() is not None,
            "backend": dict(vars(ds_comm.cdb)), "runtimes": len(apply.open_runtimes()), "nccl_env": apply.exported(),
            "sessions": len(session._open_sessions),  # noqa: SLF001
            "new_group": (dist.new_group, dist.distributed_c10d.new_group),
            "environ": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "LAGOM_"))}}


def _train(engine: Any, rank: int) -> list[float]:
    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import train

    return train(engine, STEPS, rank)


def _model() -> Any:
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT()


def _one_engine(rank: int, config: dict[str, Any]) -> tuple[list[float], bool, weakref.ref]:
    import lagom_deepspeed

    model = _model()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = _train(engine, rank)
    had_session = hasattr(engine, "lagom")
    engine.destroy()
    return losses, had_session, weakref.ref(engine)


def engines_in_a_row(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import deepspeed  # noqa: F401 - its import starts threads of its own: count from after it

    hw = f"{tmp}/hw.yaml"
    plain: dict[tuple, list[float]] = {}
    collected: dict[tuple, bool] = {}  # whether DeepSpeed alone lets the engine go (its ZeRO-3 keeps it)
    for variant in VARIANTS:  # each configuration once without Lagom: the reference, and DeepSpeed's own state
        plain[variant], _, ref = _one_engine(rank, ds_config(*variant))
        gc.collect()
        collected[variant] = ref() is None
    threads, files, before = threading.active_count(), open_files(), lagom_state()
    rows = []
    for i in range(ENGINES):
        variant = VARIANTS[i % len(VARIANTS)]
        section = {"enabled": True, "hardware": hw, "cache_dir": f"{tmp}/cache"} if i % 4 != 3 else None
        losses, had_session, ref = _one_engine(rank, ds_config(*variant, lagom=section))
        gc.collect()
        rows.append({"variant": variant, "lagom": section is not None, "had_session": had_session,
                     "same_losses": losses == plain[variant],
                     "engine_kept": ref() is not None and collected[variant],  # alive only because of Lagom
                     "left": {k: v for k, v in lagom_state().items() if v != before[k]},
                     "threads": threading.active_count() - threads,
                     "files": sorted(target for _, target in open_files() - files)})
    return {"rows": rows}


@pytest.fixture(scope="module")
def long_lived(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("long")
    (tmp / "hw.yaml").write_text(HW)
    return run_ranks(engines_in_a_row, 2, str(tmp))


@pytest.mark.slow  # engines in a row: CI's slower tier runs it at full length (make test-slow)
def test_every_engine_trains_as_plain_deepspeed(long_lived: list) -> None:
    for rank_out in long_lived:
        rows = rank_out["rows"]
        assert len(rows) == ENGINES
        assert [r["variant"] for r in rows if not r["same_losses"]] == []
        assert all(r["had_session"] == r["lagom"] for r in rows)


@pytest.mark.slow  # engines in a row: CI's slower tier runs it at full length (make test-slow)
def test_nothing_of_lagom_outlives_its_engine(long_lived: list) -> None:
    for rank_out in long_lived:
        for i, row in enumerate(rank_out["rows"]):
            assert not row["engine_kept"], f"engine {i} ({row['variant']}) is still alive after destroy()"
            assert row["left"] == {}, f"after engine {i}: {row['left']}"


@pytest.mark.slow  # engines in a row: CI's slower tier runs it at full length (make test-slow)
def test_threads_and_files_come_back(long_lived: list) -> None:
    for rank_out in long_lived:
        assert [(r["threads"], r["files"]) for r in rank_out["rows"]] == [(0, [])] * ENGINES


# -- a failure on one rank inside Lagom ------------------------------------------------------------
TIMEOUT_S = 3.0  # Lagom's collective timeout in these runs: a rank that does not arrive costs this long
FAILURES = {  # case -> (mode, where rank 1 fails)
    "start_plan": ("offline", "the plan file"),  # rank 0 reads it for every rank inside deepspeed.initialize
    "start_search": ("offline", "the start-up plan"),  # rank 0's search beside the job, adopted at an agreed step
    "online_plan": ("online", "the online plan"),
    "agreement": ("online", "the agreement of step"),
    "hook": ("online", None),  # rank 1's own step bookkeeping raises; no collective is missed
}


@contextmanager
def _injected(rank: int, what: str | None) -> Iterator[None]:
    """Rank 1 raises inside Lagom: before issuing the collective ``what``, or in its online bookkeeping."""
    from lagom.runtime.apply.control import Control
    from lagom.runtime.online.tuner import OnlineTuner

    originals = (Control._run, OnlineTuner.add)  # noqa: SLF001
    if rank == 1 and what is None:
        def add(self: Any, step_s: float, records: Any) -> None:
            raise RuntimeError("injected failure in the online tuner's bookkeeping")

        OnlineTuner.add = add  # type: ignore[method-assign]
    elif rank == 1:
        def _run(self: Any, name: str, call: Any) -> Any:
            if name.startswith(what):
                raise RuntimeError(f"injected failure before {name}")
            return originals[0](self, name, call)

        Control._run = _run  # type: ignore[method-assign]
    try:
        yield
    finally:
        Control._run, OnlineTuner.add = originals  # type: ignore[method-assign]


def one_rank_fails(rank: int, tmp: str, case: str, plain: list[float]) -> dict[str, Any]:
    import logging

    import lagom_deepspeed

    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR and "switched itself off" in record.getMessage():
                errors.append(record.getMessage())

    handler = Errors()
    logging.getLogger("lagom").addHandler(handler)
    mode, what = FAILURES[case]
    section = {"enabled": True, "hardware": f"{tmp}/hw.yaml", "cache_dir": f"{tmp}/cache-{case}", "mode": mode,
               "tune_steps": 2, "monitor_interval": 2, "collective_timeout_s": TIMEOUT_S}
    with _injected(rank, what):
        model = _model()
        engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=ds_config(1, False, False, lagom=section))
        sys.path.insert(0, str(EXAMPLES))
        from tiny_gpt import train

        from tests.test_deepspeed import searched_by_rank0

        session = getattr(engine, "lagom", None)
        losses = []
        for step in range(6):  # rank 0's search beside the steps is let finish before the next step, so the
            if session is not None:  # online plan is adopted (and its failure met) however loaded this machine is
                searched_by_rank0(session)
            losses += train(engine, 1, rank, first=step)
    out = {"same_losses": losses == plain, "errors": errors, "session": session is not None,
           "off_at": session.off_at if session is not None else None}
    engine.destroy()
    logging.getLogger("lagom").removeHandler(handler)
    return out


def _train_fresh(rank: int, config: dict[str, Any]) -> list[float]:
    import deepspeed

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import train

    losses = train(engine, 6, rank)
    engine.destroy()
    return losses


def failures_then_two_engines(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every failure case in turn on one pair of ranks (each case's injection undone before the next),
    then two engines alive at once: spawning and importing DeepSpeed once for all of them."""
    watchdog = threading.Timer(300, os._exit, args=(3,))  # a hang fails the test instead of stalling it
    watchdog.daemon = True
    watchdog.start()
    plain = _train_fresh(rank, ds_config(1, False, False))
    out: dict[str, Any] = {case: one_rank_fails(rank, tmp, case, plain) for case in FAILURES}
    out["two_engines"] = two_engines_at_once(rank, tmp)
    watchdog.cancel()
    return out


@pytest.fixture(scope="module")
def after_failures(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("failures")
    (tmp / "hw.yaml").write_text(HW)
    return run_ranks(failures_then_two_engines, 2, str(tmp))


@pytest.mark.parametrize("case", list(FAILURES))
def test_one_rank_failing_inside_lagom_never_hangs_the_job(after_failures: list, case: str) -> None:
    ranks = [out[case] for out in after_failures]
    for rank, out in enumerate(ranks):
        assert out["same_losses"], f"rank {rank}: training did not go on as plain DeepSpeed"
        assert len(out["errors"]) == 1, f"rank {rank}: {out['errors']}"
    if case == "start_plan":  # no plan was agreed: DeepSpeed was built without Lagom on both ranks
        assert [out["session"] for out in ranks] == [False, False]
    else:  # both switched off at the same agreed step: the end of the 2 tuning steps (2), or, for a plan searched
        # beside the job, the step at which rank 0's search was ready (online: 3 or later; at start-up: 1 or later)
        offs = [out["off_at"] for out in ranks]
        least = {"online_plan": 3, "start_search": 1}.get(case)
        assert offs[0] == offs[1] and (offs[0] >= least if least else offs[0] == 2), offs


# -- two engines alive at once ---------------------------------------------------------------------
def two_engines_at_once(rank: int, tmp: str) -> dict[str, Any]:
    """Engines A and B alive together, each with its own section, trained in turn; then each destroyed."""
    import deepspeed

    import lagom_deepspeed

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import batch

    def steps(engine: Any, first: int, count: int) -> list[float]:
        out = []
        for step in range(first, first + count):
            loss = engine(*batch(step, rank, 2))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    configs = {"a": ds_config(1, False, False), "b": ds_config(2, True, False)}
    plain = {}
    for name, config in configs.items():
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        plain[name] = steps(engine, 0, 4)
        engine.destroy()
    gc.collect()
    before = lagom_state()
    sections = {"a": {"enabled": True, "hardware": f"{tmp}/hw.yaml", "cache_dir": f"{tmp}/cache-a"},
                "b": {"enabled": True, "hardware": f"{tmp}/hw.yaml", "cache_dir": f"{tmp}/cache-b",
                      "mode": "online", "tune_steps": 2}}
    engines = {}
    for name, config in configs.items():
        model = _model()
        engines[name], *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config={**config, "lagom": sections[name]})
    losses: dict[str, list[float]] = {"a": [], "b": []}
    for first in (0, 2):  # interleaved: each engine's calls go to its own session
        for name, engine in engines.items():
            losses[name] += steps(engine, first, 2)
    out = {"same": {name: losses[name] == plain[name] for name in engines},
           "steps": {name: len(engine.lagom.steps) for name, engine in engines.items()},
           "modes": {name: engine.lagom.options.mode for name, engine in engines.items()}}
    engines.pop("a").destroy()  # B goes on alone after A is gone
    out["b_after_a"] = steps(engines["b"], 4, 1)[0] == steps_plain_b5(configs["b"], rank)
    engines.pop("b").destroy()
    gc.collect()
    out["left"] = {k: v for k, v in lagom_state().items() if v != before[k]}
    return out


def steps_plain_b5(config: dict[str, Any], rank: int) -> float:
    """Plain DeepSpeed's loss at step 4 for configuration b, five steps in."""
    import deepspeed

    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import batch

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = 0.0
    for step in range(5):
        out = engine(*batch(step, rank, 2))
        engine.backward(out)
        engine.step()
        loss = out.item()
    engine.destroy()
    return loss


def test_two_engines_alive_at_once_each_with_its_own_section(after_failures: list) -> None:
    for out in (rank_out["two_engines"] for rank_out in after_failures):
        assert out["same"] == {"a": True, "b": True}, out
        assert out["steps"] == {"a": 4, "b": 4} and out["modes"] == {"a": "offline", "b": "online"}
        assert out["b_after_a"] and out["left"] == {}, out
