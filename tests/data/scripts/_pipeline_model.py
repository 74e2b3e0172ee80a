"""The pipeline tests' model: a chain of children (embed, DEPTH Linear+Tanh blocks, head).

Shared by the launch script (`strategy_pipeline.py`) and the in-process tests.
"""

import torch.nn as nn

DEPTH = 8


class Net(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(DEPTH))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
