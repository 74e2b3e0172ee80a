"""Strategies applied to the user's training: DDP knobs, gradient compression hooks, ...

Subpackages: `compression` (DDP comm hooks that run on gloo and NCCL).
"""
