"""Tensor parallel with sequence parallel (megatron-core Column/RowParallelLinear) and pipeline send/recv
(P2PCommunicator) on 2 gloo ranks: each intercepted collective is recorded with its group and size,
outputs and gradients equal the uninstrumented run, and the points a plan decomposes run as
Flash-Overlap with the same results up to summation order."""

from __future__ import annotations

import torch

from lagom.plan.comm_config import CommConfig
from lagom.plan.plan import Plan, PlanEntry
from tests.distributed import run_ranks

SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 32  # full sequence; each of the 2 ranks holds SEQ / 2 rows
ACT = SEQ * BATCH * HIDDEN * 4  # bytes of the full-sequence activation (fp32)


def cpu_megatron() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None


def tp_plan(decompose: bool) -> Plan:
    """The two TP points of a column -> row MLP under sequence parallel, decomposed or not."""
    cfg = CommConfig(decomposition="p2p", num_chunks=2) if decompose else CommConfig()
    entries = [PlanEntry(key=f"tp/{c}/{ACT}", group="tp", group_size=2, group_nodes=1, collective=c, bytes=ACT,
                         count=2, points=[f"L0.mlp.{c}"], config=cfg) for c in ("all_gather", "reduce_scatter")]
    return Plan(workload="test", workload_fingerprint="-", hardware="-", hardware_fingerprint="-", world_size=2,
                strategy="test", entries=entries, predicted_step_s={"nccl": 1.0, "test": 1.0})


def mlp_step(config, x_full: torch.Tensor, rank: int):
    """Forward and backward of column(SP) -> gelu -> row(SP) from seed 0; returns output and gradients."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
                               gather_output=False)
    fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    x = x_full[rank * SEQ // 2:(rank + 1) * SEQ // 2].clone().requires_grad_()
    out, _ = fc2(torch.nn.functional.gelu(fc1(x)[0]))
    out.pow(2).sum().backward()
    return [t.detach().clone() for t in (out, x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad)]


def tp_pp_rank(rank: int, world: int) -> dict:
    cpu_megatron()
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.transformer import TransformerConfig

    from lagom.runtime import Recorder
    from lagom.runtime.online.state import FlashRouter
    from lagom_megatron.intercept import Interceptor

    out: dict = {}
    parallel_state.initialize_model_parallel(2, 1)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, sequence_parallel=True, tensor_model_parallel_size=2)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    reference = mlp_step(config, x_full, rank)
    for mode in ("recorded", "flash"):
        recorder = Recorder(cuda=False)
        router = FlashRouter(enabled=True, plan=tp_plan(decompose=mode == "flash"))
        interceptor = Interceptor(recorder, router).install()
        recorder.begin_step(0)
        got = mlp_step(config, x_full, rank)
        records = recorder.end_step()
        interceptor.uninstall()
        out[mode] = {"calls": [(r.group, r.collective, r.nbytes) for r in records],
                     "exact": all(torch.equal(a, b) for a, b in zip(got, reference)),
                     "close": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, reference)),
                     "decomposed": dict(router.calls)}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 2)
    for batched in (False, True):
        pp = ModelParallelConfig(pipeline_dtype=torch.float32, pipeline_model_parallel_size=2, batch_p2p_comm=batched,
                                 batch_p2p_sync=False)  # the sync is a torch.cuda.synchronize()
        comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), pp)
        recorder = Recorder(cuda=False)
        interceptor = Interceptor(recorder).install()
        recorder.begin_step(0)
        sent = torch.arange(SEQ * BATCH * HIDDEN, dtype=torch.float32).reshape(SEQ, BATCH, HIDDEN)
        if rank == 0:
            comm.send_forward(sent, is_last_stage=False)
            grad = comm.recv_backward([SEQ, BATCH, HIDDEN], is_last_stage=False)
            ok = torch.equal(grad, -sent)
        else:
            got = comm.recv_forward([SEQ, BATCH, HIDDEN], is_first_stage=False)
            comm.send_backward(-got, is_first_stage=False)
            ok = torch.equal(got, sent)
        records = recorder.end_step()
        interceptor.uninstall()
        out[f"pp_batched_{batched}"] = {"ok": ok, "calls": [(r.group, r.collective, r.nbytes) for r in records]}
    parallel_state.destroy_model_parallel()
    return out


def test_tensor_and_pipeline_parallel_points() -> None:
    for rank, out in enumerate(run_ranks(tp_pp_rank, 2)):
        recorded = out["recorded"]
        assert recorded["exact"], f"rank {rank}: recording changed the results"
        # forward: fc1 all-gathers the sequence, fc2 reduce-scatters its output; backward: fc2's output
        # gradient is all-gathered, fc1 re-gathers its input for wgrad and reduce-scatters the input gradient
        assert recorded["calls"] == [("tp", "all_gather", ACT), ("tp", "reduce_scatter", SEQ * BATCH * HIDDEN * 4),
                                     ("tp", "all_gather", ACT), ("tp", "all_gather", ACT), ("tp", "reduce_scatter", ACT)]
        assert recorded["decomposed"] == {}
        flash = out["flash"]
        assert flash["close"], f"rank {rank}: Flash-Overlap results differ beyond summation order"
        assert flash["decomposed"] == {f"tp/all_gather/{ACT}": 1, f"tp/reduce_scatter/{ACT}": 1}
        assert flash["calls"] == [("tp", "all_gather", ACT), ("tp", "reduce_scatter", ACT)]  # backward is inside them
        for batched in (False, True):
            pp = out[f"pp_batched_{batched}"]
            assert pp["ok"]
            assert pp["calls"] == [("pp", "send_recv", ACT), ("pp", "send_recv", ACT)]
