"""A run that passes exits cleanly with Lagom on (issue 28, item 8).

A process-group hook still on a group when Python finalises is released by torch's C++ group registry
afterwards, taking the GIL of a finalised interpreter: SIGSEGV at exit after a run that trained fine
(Megatron's ``pretrain`` never destroys its groups). In-process: every way torch destroys a group
takes the tap's hooks off first, and the tap keeps working for groups made after. In subprocesses:
a megatron-core job that ends as ``pretrain_gpt.py`` does (groups left to torch at exit, session
never closed) and a DeepSpeed job left open both exit 0, with no signal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import free_port, run_ranks

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"


def destroy_paths(rank: int, world: int, store_path: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from lagom.runtime.apply import torch_tap
    from lagom.runtime.apply.recorder import Recorder

    torch_functions = {name: getattr(distributed_c10d, name) for name in
                       ("_register_pg_in_world", "_unregister_process_group", "_unregister_all_process_groups")}
    rec = Recorder(cuda=False)
    sub = torch_tap.subscribe(lambda group: "dp", rec)
    tap = torch_tap.current_tap()
    assert sub is not None and tap is not None
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    out: dict[str, Any] = {"hooked": [tap.hooked(g) for g in (dist.group.WORLD, first, second)]}
    dist.destroy_process_group(first)  # one group: its hooks go, the others keep theirs
    out["after_one"] = [tap.hooked(g) for g in (dist.group.WORLD, first, second)]
    world_group = dist.group.WORLD
    dist.destroy_process_group()  # the default group: every group loses its hooks, `second` still alive here
    out["after_world"] = [tap.hooked(g) for g in (world_group, second)]
    # the tap still follows groups made afterwards, and records on them
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    out["rehooked"] = tap.hooked(dist.group.WORLD)
    rec.begin_step(1)
    dist.all_reduce(torch.ones(4))
    out["recorded"] = [(r.group, r.collective, r.nbytes) for r in rec.end_step()]
    sub.close()
    sub.close()  # idempotent
    tap._uninstall()  # as atexit runs it after a close: idempotent too
    out["torch_restored"] = all(getattr(distributed_c10d, n) is f for n, f in torch_functions.items())
    out["unhooked_at_close"] = not tap.hooked(dist.group.WORLD)
    return out


def test_groups_torch_destroys_lose_the_taps_hooks_first(tmp_path: Path) -> None:
    for out in run_ranks(destroy_paths, 2, str(tmp_path / "store")):
        assert out["hooked"] == [True, True, True]
        assert out["after_one"] == [True, False, True]
        assert out["after_world"] == [False, False]
        assert out["rehooked"] and out["recorded"] == [("dp", "all_reduce", 16)]
        assert out["torch_restored"] and out["unhooked_at_close"]


# The CPU example's training, ended as Megatron-LM's pretrain_gpt.py ends: its groups are never destroyed
# (pretrain returns and the interpreter exits) and nothing closes Lagom's session.
MEGATRON_JOB = textwrap.dedent('''
    import runpy
    import torch.distributed as dist

    dist.destroy_process_group = lambda group=None: None  # pretrain_gpt.py leaves its groups to torch at exit
    runpy.run_path({train_tiny!r}, run_name="__main__")
''')
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "4",
    "--lr", "0.05", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "5000",
]


def _clean(run: subprocess.CompletedProcess) -> None:
    """Exit code 0 from the launcher and no rank killed by a signal (torchrun reports it as 'Signal N')."""
    output = run.stdout[-3000:] + run.stderr[-5000:]
    assert run.returncode == 0, output
    assert "Signal" not in run.stderr and "terminate called" not in run.stderr, output


@pytest.mark.slow  # torchrun with 2 ranks of megatron-core (about 14 s): CI's slower tier
def test_megatron_job_that_never_destroys_its_groups_exits_cleanly(tmp_path: Path) -> None:
    job = tmp_path / "pretrain_like.py"
    job.write_text(MEGATRON_JOB.format(train_tiny=str(ROOT / "examples/megatron/train_tiny.py")))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "lagom_megatron.run", str(job),
           *MEGATRON_ARGS, "--lagom", "--lagom-mode", "online", "--lagom-tune-steps", "2",
           "--lagom-hardware", str(ROOT / "examples/megatron/cpu-2ranks.yaml"), "--lagom-report", "report"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    _clean(run)
    assert len([line for line in run.stdout.splitlines() if line.startswith("iteration ")]) == 4
    report = json.loads((tmp_path / "report" / "lagom-report.json").read_text())  # written at exit
    assert report["mode"] == "online"


# The DeepSpeed example's model and loop, ended by falling off the script: no close, no destroy, no os._exit.
DEEPSPEED_JOB = textwrap.dedent('''
    import json, sys, time
    sys.path[:0] = [{example!r}, {root!r}]
    import deepspeed, torch
    import lagom_deepspeed, tiny_gpt

    config = json.loads(open({config!r}).read())
    config["lagom"] |= {{"hardware": {hardware!r}, "plan": "plan.json", "report": "report"}}
    torch.manual_seed(0)
    deepspeed.init_distributed()
    model = tiny_gpt.TinyGPT()
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print("losses", tiny_gpt.train(engine, 3, torch.distributed.get_rank()), flush=True)
    torch.distributed.barrier()
    # gloo's worker thread frees a finished work's tensors a moment after the caller returns; exiting in that
    # moment aborts torch with or without Lagom (the example's os._exit(0) works around it): let it finish
    time.sleep(0.5)
''')


@pytest.mark.slow  # DeepSpeed's start-up on two ranks: about 20 s on two cores
def test_deepspeed_job_left_open_exits_cleanly(tmp_path: Path) -> None:
    example = ROOT / "examples/deepspeed"
    job = tmp_path / "job.py"
    job.write_text(DEEPSPEED_JOB.format(example=str(example), root=str(ROOT), config=str(example / "ds_config_cpu.json"),
                                        hardware=str(example / "cpu-2ranks.yaml")))
    cmd = [str(TORCHRUN), "--master-port", str(free_port()), "--nproc-per-node", "2", str(job)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    _clean(run)
    assert run.stdout.count("losses") == 2
    assert json.loads((tmp_path / "report.json").read_text())["steps"]  # the session's report, written at exit
