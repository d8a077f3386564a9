"""A stock Hugging Face causal LM (GPT-2 built from its config) trained by Trainer under DeepSpeed ZeRO-2 on CPU.

Trainer and Accelerate call ``deepspeed.initialize`` themselves, so the ``"lagom"`` section of the DeepSpeed config
is read only when Lagom patched it first; the launcher does, without a change to this script:

    torchrun --standalone --nproc-per-node 2 -m lagom_deepspeed.run examples/deepspeed/hf_trainer.py OUT HW.yaml
    torchrun --standalone --nproc-per-node 2 examples/deepspeed/hf_trainer.py OUT HW.yaml   # the section is ignored

Each rank writes ``OUT/result-<rank>.json``: whether its engine carries a Lagom session, and its losses.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


def main(out: str, hardware: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    data = [{"input_ids": torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i)),
             "labels": torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))} for i in range(64)]
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000, "overlap_comm": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                 "zero_force_ds_cpu_optimizer": False,
                 "lagom": {"enabled": True, "hardware": hardware, "report": f"{out}/report", "cache_dir": f"{out}/cache"}}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
                             report_to=[], learning_rate=1e-3, deepspeed=ds_config, use_cpu=True, save_strategy="no",
                             ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    result = {"session": getattr(trainer.model_wrapped, "lagom", None) is not None,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    with open(f"{out}/result-{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
