"""A Hugging Face `Trainer` run: a tiny BertForSequenceClassification built from a config.

Knows nothing about torsh-tune. Nothing is downloaded (no from_pretrained, no tokenizer, no
hub access; run with HF_HUB_OFFLINE=1): the model comes from a 2-layer BertConfig (vocab
1000, hidden 64) and the data set is synthetic token ids held in memory. The Trainer wraps
the model in DDP through accelerate; the process group is created here first (gloo on
CPU, nccl on CUDA) and the Trainer reuses it.

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 stack_hf_trainer.py --steps 30

With `--eval-steps N` the Trainer evaluates on a held-out set every N steps (its evaluation loop runs
the unwrapped model under `torch.no_grad()`, in eval mode).
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, set_seed

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--batch-size", type=int, default=8, help="per-device train batch size")
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--output-dir", default=None, help="Trainer output_dir (default: a temporary directory)")
p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps on a held-out set (0: never)")
p.add_argument("--eval-samples", type=int, default=256, help="samples in the held-out set")
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
set_seed(0)

VOCAB, LABELS = 1000, 4


class SyntheticText(Dataset):
    """Token ids with a learnable label (the first token's bucket); padded tails of random length."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, VOCAB, (n, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        self.mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask  # pad id 0
        self.labels = self.ids[:, 0] * LABELS // VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


config = BertConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=max(64, args.seq_len),
    num_labels=LABELS,
)
model = BertForSequenceClassification(config)
train_ds = SyntheticText(1024, args.seq_len)

tmp = None
output_dir = args.output_dir
if output_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="stack_hf_trainer-")
    output_dir = tmp.name

training_args = TrainingArguments(
    output_dir=output_dir,
    max_steps=args.steps,
    per_device_train_batch_size=args.batch_size,
    learning_rate=5e-4,
    warmup_steps=2,
    weight_decay=0.01,
    report_to=[],
    save_strategy="no",
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    per_device_eval_batch_size=args.batch_size,
    logging_strategy="no",
    disable_tqdm=True,
    use_cpu=not cuda,
    ddp_backend="nccl" if cuda else "gloo",
    ddp_find_unused_parameters=False,  # every parameter (pooler included) gets a gradient
    dataloader_num_workers=0,
    seed=0,
)
eval_ds = SyntheticText(args.eval_samples, args.seq_len, seed=1) if args.eval_steps else None
trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds)
result = trainer.train()
if rank == 0:
    print(f"hf_trainer done, {result.global_step} steps, loss {result.training_loss:.4f}, world {world}")
if tmp is not None:
    tmp.cleanup()
dist.destroy_process_group()
