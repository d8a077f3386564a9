"""`lagom reproduce --real`: small GPT, BERT and T5 models trained through DeepSpeed ZeRO with Lagom on.

Each architecture is trained twice on 2 gloo CPU ranks from the same seed and batches: once by plain
``deepspeed.initialize`` and once by ``lagom_deepspeed.initialize`` with a ``"lagom"`` section (offline
plan for a 2-GPU profile, bucket knobs written into the engine config, every collective recorded,
Flash-Overlap decompositions where the plan chooses them). A job without a plan starts on the framework's
own settings while rank 0 searches one beside it, and what is fixed when communicators and buffers are
made (bucket sizes, NCCL's variables) waits for the next start; so, as a user would, each job is first
started without a plan until every rank has adopted the plan searched beside it (saved to the plan file),
and the measured run starts from that file, with all of the plan in force from its first step. The
report lists, per architecture, the overlap points of the plan the measured run ran with, the
configuration it applied, the collectives seen at run time, and whether the losses equal the run
without Lagom. The models are written here with torch.nn
(no Hugging Face): a decoder (causal self-attention), an encoder (bidirectional, masked-token loss) and an
encoder-decoder (cross-attention), each small enough for a CPU.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn

ARCHITECTURES = ("gpt", "bert", "t5")
WORLD = 2
VOCAB, HIDDEN, HEADS, FFN, SEQ, LAYERS = 96, 32, 2, 128, 16, 2
MICRO, STEPS, LR = 4, 4, 1e-3
MASK_ID = VOCAB - 1  # the encoder's [MASK] token
# The 2-rank job is planned as two A100s on one node: the plan has the job's shape; its numbers are A100s'.
HARDWARE_YAML = """\
# Written by `lagom reproduce --real`: the 2 gloo CPU ranks planned as two A100s on one node.
base: a100-8x-100g
name: a100-2x-cpu-real
description: 2x A100 (the shape of the 2-rank CPU runs of lagom reproduce --real)
cluster: {gpus_per_node: 2, nodes: 1}
"""


# ---------------------------------------------------------------------------------------------
# The three small models


class Block(nn.Module):
    """Pre-norm transformer block: self-attention (causal or not), optional cross-attention, MLP."""

    def __init__(self, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.lnx = nn.LayerNorm(HIDDEN) if cross else None
        self.xattn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True) if cross else None
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1) if self.causal else None
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if self.xattn is not None and self.lnx is not None:
            h = self.lnx(x)
            x = x + self.xattn(h, memory, memory, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    """Embedding with a learned position table, blocks, final norm."""

    def __init__(self, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(Block(causal, cross) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x, memory)
        return self.ln(x)


class TinyLM(nn.Module):
    """One stack and a head. Causal: a GPT decoder predicting the next token. Bidirectional: a BERT
    encoder predicting the masked tokens (targets are -100 where nothing is masked)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.tok = _embedding()
        self.stack = Stack(causal=causal)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _loss(self.head(self.stack(self.tok(tokens))), targets)


class TinyT5(nn.Module):
    """Encoder-decoder: the decoder (causal, cross-attending to the encoder) writes the reversed input."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = _embedding()  # shared by encoder, decoder and head, as in T5
        self.encoder = Stack(causal=False)
        self.decoder = Stack(causal=True, cross=True)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.tok(tokens))
        start = torch.zeros_like(targets[:, :1])
        out = self.decoder(self.tok(torch.cat([start, targets[:, :-1]], dim=1)), memory)
        return _loss(out @ self.tok.weight.t(), targets)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt": lambda: TinyLM(causal=True), "bert": lambda: TinyLM(causal=False),
                                              "t5": TinyT5}


def _embedding() -> nn.Embedding:
    """Token embedding initialised small (std 0.02, as GPT-2 and Megatron do), so tied output logits start
    near uniform."""
    emb = nn.Embedding(VOCAB, HIDDEN)
    nn.init.normal_(emb.weight, std=0.02)
    return emb


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def batch(arch: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per (architecture, step, rank)."""
    g = torch.Generator().manual_seed(10_000 * ARCHITECTURES.index(arch) + 100 * step + rank)
    if arch == "gpt":
        stream = torch.randint(0, MASK_ID, (MICRO, SEQ + 1), generator=g)
        return stream[:, :-1], stream[:, 1:]
    tokens = torch.randint(0, MASK_ID, (MICRO, SEQ), generator=g)
    if arch == "t5":
        return tokens, tokens.flip(1)
    masked = torch.rand(MICRO, SEQ, generator=g) < 0.25
    masked[:, 0] = True  # at least one target per sequence
    return tokens.masked_fill(masked, MASK_ID), tokens.masked_fill(~masked, -100)


# ---------------------------------------------------------------------------------------------
# One training run on this rank


def ds_config(arch: str, lagom: dict[str, Any] | None) -> dict[str, Any]:
    """ZeRO-3 with small buckets, so every layer's parameters are gathered and its gradients reduce-scattered
    in calls of their own (the FSDP-like overlap points the paper tunes), fp32 on CPU."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 20_000, "stage3_prefetch_bucket_size": 10_000,
                              "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if lagom is not None:
        cfg["lagom"] = lagom
    return cfg


def lagom_section(arch: str, out: Path, hardware: Path) -> dict[str, Any]:
    """Offline, from the plan file (searched beside a first start where there is none yet: ``plan_first``); the
    architecture is stated (DeepSpeed models do not say it)."""
    workload: dict[str, Any] = {"name": f"real-{arch}", "model": {"architecture": arch, "seq_len": SEQ}}
    if arch == "t5":
        workload["model"] |= {"layers": LAYERS, "decoder_layers": LAYERS}
    return {"enabled": True, "mode": "offline", "hardware": str(hardware), "strategy": "lagom",
            "plan": str(out / f"{arch}-plan.json"), "report": str(out / f"{arch}-lagom"),
            "cache_dir": str(out / "cache"), "workload": workload}


def train(arch: str, rank: int, lagom: dict[str, Any] | None) -> tuple[list[float], Any]:
    """STEPS optimizer steps from seed 0; the losses, and the engine (for its lagom session)."""
    import deepspeed

    import lagom_deepspeed

    torch.manual_seed(0)
    model = MODELS[arch]()
    init = lagom_deepspeed.initialize if lagom is not None else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(arch, lagom))
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(arch, step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, engine


def searched_beside(session: Any, step: Callable[[int], None]) -> int:
    """A job's first start without a plan: ``step`` (one training step) until every rank has adopted the plan rank 0
    searched beside the steps (rank 0 waits between steps until its search is done, so that the plan is adopted at
    the next agreed step, whatever this machine's speed). Returns the steps run."""
    import torch.distributed as dist

    if session is None or session.plan is not None or not session.searching:
        raise RuntimeError("the first start was expected to search a plan beside the job "
                           f"({'no Lagom session' if session is None else session.plan_source})")
    steps = 0
    while session.plan is None:
        if session.off is not None or not session.searching:
            raise RuntimeError(f"the search beside the job ended without a plan: {session.off or session.events[-1]}")
        search = getattr(session, "_search", None)  # rank 0's thread (None on the other ranks)
        while search is not None and not search.done:
            time.sleep(0.01)
        step(steps)
        steps += 1
    dist.barrier()  # rank 0 has written the plan file
    return steps


def plan_first(arch: str, rank: int, section: dict[str, Any]) -> None:
    """DeepSpeed: the job's first start, without a plan file; the plan searched beside it is written to the
    section's plan file, which the measured run starts from."""
    import lagom_deepspeed

    torch.manual_seed(0)
    model = MODELS[arch]()
    first = {k: v for k, v in section.items() if k != "report"}  # the measured run's report is the one kept
    engine, *_ = lagom_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(arch, first))

    def step(i: int) -> None:
        engine.backward(engine(*batch(arch, i % STEPS, rank)))
        engine.step()

    searched_beside(engine.lagom, step)
    engine.lagom.close()


def deepspeed_run(arch: str, rank: int, out: Path, hardware: Path) -> dict[str, Any]:
    """Plain DeepSpeed; the plan searched beside a first start with the lagom section; then DeepSpeed with the
    lagom section, started from that plan; what Lagom found, applied and saw."""
    plain, _ = train(arch, rank, None)
    section = lagom_section(arch, out, hardware)
    if not Path(section["plan"]).exists():
        plan_first(arch, rank, section)
    tuned, engine = train(arch, rank, section)
    session = engine.lagom
    found = _found(session)
    session.close()
    return {"plain": plain, "lagom": tuned, **found}


def _found(session: Any) -> dict[str, Any]:
    """What a run's session (either adapter: one report schema) planned, applied and measured."""
    data = session.report()
    steps = max(1, data["measured"]["tuned_steps"])
    seen = {p["key"]: p["measured_calls_per_step"] for p in data["points"] if p["measured_calls_per_step"]}
    seen |= {k: n / steps for k, n in data["unplanned_calls"].items()}
    applied = [f"{c['key']}: {c['before']} -> {c['after']} ({c['why']})" for c in data["applied_at_start"]]
    return {"points": _points(session.plan), "applied": applied + data["applied_now"], "seen": seen,
            "decomposed": {p["key"]: p["flash_overlap_calls"] for p in data["points"] if p["flash_overlap_calls"]},
            "predicted": dict(session.plan.predicted_step_s), "plan_source": session.plan_source,
            "report": str(session.options.report_files[1]),
            "notes": data["details"].get("inferred") or [f"workload {session.workload.name}"]}


def _points(plan: Any) -> list[dict[str, Any]]:
    return [{"key": e.key, "count": e.count, "config": e.config.describe(), "why": e.note, "points": e.points[:4]}
            for e in plan.entries]


# ---------------------------------------------------------------------------------------------
# The same three architectures from megatron-core tensor-parallel parts, through lagom_megatron


class TPAttention(nn.Module):
    """Self- or cross-attention with megatron-core's column-parallel projections in and row-parallel out:
    each tensor-parallel rank holds HEADS / tp heads; the row-parallel output all-reduces over tp."""

    def __init__(self, config: Any, causal: bool, cross: bool) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = nn.init.xavier_normal_
        self.causal, self.cross = causal, cross
        self.heads = HEADS // config.tensor_model_parallel_size
        self.q = ColumnParallelLinear(HIDDEN, HIDDEN, config=config, init_method=init, bias=True, gather_output=False)
        self.kv = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, config=config, init_method=init, bias=True,
                                       gather_output=False)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, config=config, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, heads*d] -> [b, heads, s, d]
        s, b, _ = x.shape
        return x.reshape(s, b, self.heads, -1).permute(1, 2, 0, 3)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        q, _ = self.q(x)
        kv, _ = self.kv(memory if self.cross else x)
        k, v = kv.chunk(2, dim=-1)
        h = nn.functional.scaled_dot_product_attention(self._split(q), self._split(k), self._split(v),
                                                       is_causal=self.causal and not self.cross)
        out, _ = self.proj(h.permute(2, 0, 1, 3).flatten(2))
        return out


class TPBlock(nn.Module):
    """Block with megatron-core tensor-parallel attention and MLP (inputs [s, b, h], as megatron lays them)."""

    def __init__(self, config: Any, causal: bool, cross: bool = False) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = nn.init.xavier_normal_
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = TPAttention(config, causal, cross=False)
        self.lnx = nn.LayerNorm(HIDDEN) if cross else None
        self.xattn = TPAttention(config, causal=False, cross=True) if cross else None
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.xattn is not None and self.lnx is not None:
            x = x + self.xattn(self.lnx(x), memory)
        h, _ = self.fc1(self.ln2(x))
        out, _ = self.fc2(nn.functional.gelu(h))
        return x + out


class TPModel(nn.Module):
    """GPT (causal decoder), BERT (encoder) or T5 (encoder + cross-attending decoder) from TPBlocks; the
    embedding and the output layer are replicated on the tensor-parallel ranks, which see the same batch."""

    def __init__(self, config: Any, arch: str) -> None:
        super().__init__()
        self.arch = arch
        self.tok = _embedding()
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.encoder = nn.ModuleList(TPBlock(config, causal=False) for _ in range(LAYERS)) if arch != "gpt" else None
        self.decoder = nn.ModuleList(TPBlock(config, causal=True, cross=arch == "t5")
                                     for _ in range(LAYERS)) if arch != "bert" else None
        self.ln = nn.LayerNorm(HIDDEN)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] -> [s, b, h]
        return (self.tok(tokens) + self.pos[: tokens.shape[1]]).transpose(0, 1)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        memory = None
        if self.encoder is not None:
            memory = self._embed(tokens)
            for block in self.encoder:
                memory = block(memory)
        if self.decoder is None:
            out = memory
        else:
            inputs = tokens if self.arch == "gpt" else torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], 1)
            out = self._embed(inputs)
            for block in self.decoder:
                out = block(out, memory)
        logits = self.ln(out).transpose(0, 1) @ self.tok.weight.t()
        return _loss(logits, targets)


def cpu_megatron() -> None:
    """What megatron asks of a GPU, answered for the host: the device it allocates on, and the GPU generation
    its argument checks read (pre-Blackwell, so tensor parallel wants CUDA_DEVICE_MAX_CONNECTIONS=1, as on A100)."""
    from megatron.training import arguments

    torch.cuda.current_device = lambda: "cpu"
    arguments.get_device_arch_version = lambda: 8
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def megatron_plan(arch: str, out: Path) -> Path:
    """The plan the first start with ``--lagom`` writes (``--lagom-out``), which the measured run starts from."""
    from lagom_megatron.arguments import PLAN_FILE

    return out / f"megatron-{arch}" / PLAN_FILE


def megatron_argv(arch: str, out: Path, hardware: Path, lagom: bool, plan: Path | None = None) -> list[str]:
    """Megatron's own flags for the job; the script name says the architecture, as pretrain_<arch>.py does.
    ``plan``: the plan file to start from (without one, Lagom searches one beside the job)."""
    argv = [f"pretrain_{arch}.py", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
            "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(MICRO),
            "--train-iters", str(STEPS), "--lr", str(LR), "--vocab-size", str(VOCAB),
            "--make-vocab-size-divisible-by", "16", "--tokenizer-type", "NullTokenizer",
            "--distributed-backend", "gloo", "--tensor-model-parallel-size", str(WORLD)]
    if arch == "t5":  # --num-layers sets the encoder's depth (megatron refuses both spellings)
        argv += ["--decoder-num-layers", str(LAYERS), "--decoder-seq-length", str(SEQ)]
    if lagom:
        argv += ["--lagom", "--lagom-mode", "offline", "--lagom-hardware", str(hardware),
                 "--lagom-out", str(out / f"megatron-{arch}"), "--lagom-cache-dir", str(out / "cache")]
        argv += ["--lagom-plan", str(plan), "--lagom-report", str(out / f"megatron-{arch}-lagom.json")] if plan else []
    return argv


def megatron_train(arch: str, rank: int, argv: list[str], first_start: bool = False) -> tuple[list[float], Any]:
    """Parse megatron's arguments (Lagom starts there when --lagom is given), build the model, train STEPS steps
    (``first_start``: until every rank has adopted the plan searched beside the job, ``searched_beside``)."""
    import sys

    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from lagom_megatron.hooks import current

    unset_global_variables()  # one process runs several jobs one after another
    sys.argv = argv
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    session = current()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               tensor_model_parallel_size=args.tensor_model_parallel_size)
    model = TPModel(config, arch)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []

    def step(i: int) -> None:
        if session:
            session.step_begin(i)
        optimizer.zero_grad()
        loss = model(*batch(arch, i % STEPS, 0))  # every rank is in one tensor-parallel group: the same batch
        loss.backward()
        optimizer.step()
        if session:
            session.step_end()
        losses.append(float(loss.detach()))

    if first_start:
        searched_beside(session, step)
    else:
        for i in range(STEPS):
            step(i)
    return losses, session


def megatron_run(arch: str, rank: int, out: Path, hardware: Path) -> dict[str, Any]:
    """With --lagom: a first start that searches the plan beside the job, then the measured run from that plan
    (each session is closed when the next run parses its arguments); then without."""
    plan = megatron_plan(arch, out)
    if not plan.exists():
        megatron_train(arch, rank, megatron_argv(arch, out, hardware, lagom=True), first_start=True)
    tuned, session = megatron_train(arch, rank, megatron_argv(arch, out, hardware, lagom=True, plan=plan))
    session.write_report()
    found = _found(session)
    plain, _ = megatron_train(arch, rank, megatron_argv(arch, out, hardware, lagom=False))
    return {"plain": plain, "lagom": tuned, **found}


# ---------------------------------------------------------------------------------------------
# Spawning the ranks


FRAMEWORKS: dict[str, Callable[[str, int, Path, Path], dict[str, Any]]] = {
    "deepspeed": deepspeed_run, "megatron": megatron_run}
SETUPS = {"deepspeed": "DeepSpeed ZeRO-3 (dp=2)", "megatron": "megatron-core tensor parallel (tp=2)"}


@dataclass
class ArchResult:
    """One architecture on one framework: both runs' losses (every rank) and what Lagom did (rank 0)."""

    framework: str
    architecture: str
    losses_plain: list[list[float]]  # per rank
    losses_lagom: list[list[float]]
    equal: bool
    points: list[dict[str, Any]]  # the plan's entries: key, count, config, why, point names
    applied: list[str]  # what Lagom changed at start-up
    seen: dict[str, float]  # collectives recorded at run time: key -> calls per step
    decomposed: dict[str, int]
    predicted: dict[str, float]  # strategy -> predicted step seconds on the profile
    plan_source: str
    report: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _rank_main(rank: int, framework: str, rendezvous: str, out: str, hardware: str, archs: tuple[str, ...],
               results: Any) -> None:
    """A spawned rank: output to a log file of its own, join the gloo group, run every architecture."""
    log_file = open(Path(out) / f"{framework}-rank{rank}.log", "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(WORLD))
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lagom").setLevel(logging.INFO)  # what Lagom tuned and applied, in the rank's log
    try:
        import torch.distributed as dist

        # a rendezvous file, not a port: nothing to race for on a shared host
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
        if framework == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")  # adopts the group made above
        else:
            from lagom_megatron.hooks import install_launcher_hooks

            cpu_megatron()
            install_launcher_hooks()
        done = []
        for arch in archs:
            start = time.perf_counter()
            done.append(FRAMEWORKS[framework](arch, rank, Path(out), Path(hardware)) | {
                "seconds": time.perf_counter() - start})
        results[rank] = ("ok", done)
    except BaseException:  # noqa: BLE001 - carried back to the parent and re-raised there
        results[rank] = ("error", traceback.format_exc())


def run_real(out: Path, frameworks: tuple[str, ...] = tuple(FRAMEWORKS),
             archs: tuple[str, ...] = ARCHITECTURES) -> list[ArchResult]:
    """Train every architecture with and without Lagom on 2 gloo ranks per framework; a failing rank's
    traceback is raised here."""
    out.mkdir(parents=True, exist_ok=True)
    hardware = out / "hardware-2x-cpu.yaml"
    hardware.write_text(HARDWARE_YAML)
    found = []
    for framework in frameworks:
        results = mp.Manager().dict()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank_main, args=(framework, f"{tmp}/rendezvous", str(out), str(hardware), archs, results),
                     nprocs=WORLD, join=True)
        per_rank = []
        for rank in range(WORLD):
            status, value = results.get(rank, ("error", "no result (the process died)"))
            if status == "error":
                raise RuntimeError(f"--real ({framework}): rank {rank} failed:\n{value}")
            per_rank.append(value)
        for i, arch in enumerate(archs):
            r0 = per_rank[0][i]
            plain = [per_rank[r][i]["plain"] for r in range(WORLD)]
            tuned = [per_rank[r][i]["lagom"] for r in range(WORLD)]
            found.append(ArchResult(framework, arch, plain, tuned, plain == tuned, r0["points"], r0["applied"],
                                    r0["seen"], r0["decomposed"], r0["predicted"], r0["plan_source"], r0["report"],
                                    r0["notes"], r0["seconds"]))
    (out / "real.json").write_text(json.dumps([asdict(r) for r in found], indent=2, default=str) + "\n")
    return found


# ---------------------------------------------------------------------------------------------
# Reporting


def real_table(results: list[ArchResult]) -> Table:
    table = Table(title="Real runs on 2 gloo CPU ranks (measured): with and without Lagom")
    for col in ("framework", "architecture", "tuning keys", "collectives seen/step", "decomposed calls",
                "losses with Lagom (rank 0)", "equal to without", "s"):
        table.add_column(col, justify="right" if col in ("tuning keys", "collectives seen/step", "decomposed calls",
                                                           "s") else "left")
    for r in results:
        table.add_row(SETUPS[r.framework], r.architecture, str(len(r.points)), f"{sum(r.seen.values()):.0f}",
                      str(sum(r.decomposed.values())), " ".join(f"{x:.4f}" for x in r.losses_lagom[0]),
                      "[green]yes[/]" if r.equal else "[red]NO[/]", f"{r.seconds:.0f}")
    return table


def real_markdown(results: list[ArchResult]) -> str:
    lines = ["## Real runs (measured on CPU, 2 gloo ranks)", "",
             f"Small models written with torch.nn and megatron-core parts (hidden {HIDDEN}, {LAYERS} layers per stack, "
             f"{HEADS} heads, ffn {FFN}, sequence {SEQ}, micro-batch {MICRO}), {STEPS} steps each, trained from the same "
             "seed and batches without and with Lagom: DeepSpeed ZeRO-3 (data parallel over the 2 ranks) through "
             "`deepspeed.initialize` vs `lagom_deepspeed.initialize` with a `lagom` section; megatron-core "
             "tensor-parallel layers (tp=2) with Megatron's argument parsing, without and with `--lagom` "
             "(lagom_megatron's launcher hooks). Plans are made for two A100s (the jobs' shape), so predicted times "
             "describe A100s, not this CPU. Losses are compared for exact equality on every rank. Each rank's output "
             "(DeepSpeed's and Megatron's logs) is in `real/<framework>-rank<r>.log`.", ""]
    lines += ["| framework | architecture | tuning keys | collectives seen/step | losses equal |", "|---|---|---:|---:|---|"]
    lines += [f"| {SETUPS[r.framework]} | {r.architecture} | {len(r.points)} | {sum(r.seen.values()):.0f} | "
              f"{'yes' if r.equal else '**no**'} |" for r in results]
    for r in results:
        lines += ["", f"### {r.architecture} on {SETUPS[r.framework]}", "",
                  f"- losses without Lagom (rank 0): {' '.join(f'{x:.6f}' for x in r.losses_plain[0])}",
                  f"- losses with Lagom (rank 0): {' '.join(f'{x:.6f}' for x in r.losses_lagom[0])}",
                  f"- equal on every rank: **{'yes' if r.equal else 'no'}**",
                  f"- plan: {r.plan_source}; predicted step on the profile: "
                  + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in r.predicted.items()),
                  f"- session report: `{r.report}`"]
        lines += [f"- {n}" for n in r.notes]
        lines += ["", "Overlap points the plan found, and the configuration applied:", "",
                  "| tuning key | calls/step | config | why | points (first 4) |", "|---|---:|---|---|---|"]
        lines += [f"| `{p['key']}` | {p['count']} | {p['config']} | {p['why']} | {', '.join(p['points'])} |"
                  for p in r.points]
        lines += ["", "Applied at start-up:", ""] + ([f"- {a}" for a in r.applied] or ["- nothing"])
        lines += ["", "Collectives seen at run time:", "", "| key | calls/step |", "|---|---:|"]
        lines += [f"| `{k}` | {n:.2f} |" for k, n in r.seen.items()]
        if r.decomposed:
            lines += ["", "Flash-Overlap decompositions: " + ", ".join(f"`{k}` {n} calls" for k, n in r.decomposed.items())]
    return "\n".join(lines) + "\n"


def real_runs(out: Path, console: Console) -> str:
    """Run, print the table, and return the report's section (Markdown)."""
    console.print("[bold]--real[/]: GPT, BERT and T5 through DeepSpeed ZeRO-3 and megatron-core tensor parallel "
                  "on 2 gloo ranks, with and without Lagom")
    results = run_real(out / "real")
    console.print(real_table(results))
    return real_markdown(results)
