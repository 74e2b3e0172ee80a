"""A Lightning run: Trainer(strategy="ddp") over a tiny LightningModule, launched by torchrun.

Knows nothing about torsh-tune. Lightning detects torchrun's environment (TorchElastic
cluster environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and
does not spawn processes itself; `devices` and `num_nodes` are read from that environment
so they always match what torchrun started. The process group is created here first
(gloo on CPU, nccl on CUDA) and Lightning reuses it.

    torchrun --standalone --nproc-per-node 2 stack_lightning.py --steps 30
"""

import argparse
import os
import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=256)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--val-every", type=int, default=0, help="validate every N steps on 64 held-out batches (0: never)")
p.add_argument("--sigterm-every", type=int, default=1,
               help="broadcast Lightning's SIGTERM flag every N batches instead of every batch (the workaround "
                    "torsh-tune recommends: Lightning-AI/pytorch-lightning#21487)")
args = p.parse_args()

# Tiny synthetic data on CPU: Lightning's advice about loader workers is noise here.
warnings.filterwarnings("ignore", message=".*does not have many workers.*")

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
L.seed_everything(0, verbose=False)

local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
num_nodes = max(1, int(os.environ.get("WORLD_SIZE", local_world)) // local_world)


class TinyClassifier(L.LightningModule):
    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.LayerNorm(width), nn.Linear(width, 8))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=False, sync_dist=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
y = (x[:, :8].argmax(dim=1))  # learnable labels
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, num_workers=0)
val = DataLoader(TensorDataset(x[:64 * args.batch_size], y[:64 * args.batch_size]), batch_size=args.batch_size)

trainer = L.Trainer(
    strategy="ddp",
    accelerator="gpu" if cuda else "cpu",
    devices=local_world,
    num_nodes=num_nodes,
    max_steps=args.steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    **({"val_check_interval": args.val_every, "check_val_every_n_epoch": None} if args.val_every
       else {"limit_val_batches": 0}),
)
if args.sigterm_every > 1:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    orig = _TrainingEpochLoop._broadcast_sigterm_tensor

    def _broadcast_sigterm_every(self):
        if self.total_batch_idx % args.sigterm_every == 0:  # the same batches on every rank
            orig(self)

    _TrainingEpochLoop._broadcast_sigterm_tensor = _broadcast_sigterm_every
model = TinyClassifier(args.width)
trainer.fit(model, loader, val if args.val_every else None)
if trainer.global_rank == 0:
    loss = trainer.callback_metrics.get("train_loss")
    print(f"lightning done, {trainer.global_step} steps, loss {float(loss):.4f}, world {trainer.world_size}")
if dist.is_initialized():
    dist.destroy_process_group()
