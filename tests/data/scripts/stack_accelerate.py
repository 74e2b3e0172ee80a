"""An accelerate training loop: Accelerator(gradient_accumulation_steps=2) around a tiny GPT-2.

Knows nothing about torsh-tune. Nothing is downloaded (no from_pretrained, no hub access;
run with HF_HUB_OFFLINE=1): GPT2LMHeadModel comes from a 2-layer GPT2Config (vocab 1000,
hidden 64) and the data are synthetic token sequences in memory. The process group is
created here first (gloo on CPU, nccl on CUDA) and accelerate reuses it; prepare() wraps
the model in DDP and shards the DataLoader. `--steps` counts optimizer steps, i.e.
2 x steps micro-batches (gradients are synchronised on every second one).

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 stack_accelerate.py --steps 30
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
p.add_argument("--batch-size", type=int, default=8, help="per-device micro-batch")
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
set_seed(0)

accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=not cuda)

VOCAB = 1000
config = GPT2Config(vocab_size=VOCAB, n_positions=max(64, args.seq_len), n_embd=64, n_layer=2, n_head=2,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
g = torch.Generator().manual_seed(0)
# A learnable pattern: each sequence counts up (mod VOCAB) from a random start.
starts = torch.randint(0, VOCAB, (2048, 1), generator=g)
ids = (starts + torch.arange(args.seq_len)) % VOCAB
loader = DataLoader(TensorDataset(ids), batch_size=args.batch_size, shuffle=True, drop_last=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

model.train()
opt_steps, epoch, loss = 0, 0, None
while opt_steps < args.steps:
    loader.set_epoch(epoch) if hasattr(loader, "set_epoch") else None
    for (batch,) in loader:
        with accelerator.accumulate(model):
            out = model(input_ids=batch, labels=batch)
            loss = out.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            opt_steps += 1
            if opt_steps >= args.steps:
                break
    epoch += 1

final = accelerator.reduce(loss.detach(), reduction="mean")
if accelerator.is_main_process:
    print(f"accelerate done, {opt_steps} optimizer steps, loss {final.item():.4f}, world {accelerator.num_processes}")
accelerator.end_training()  # accelerate >= 1.x destroys the process group here itself
if dist.is_initialized():
    dist.destroy_process_group()
