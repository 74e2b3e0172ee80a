"""Strategies applied to the user's training, on gloo and NCCL.

Modules: `ddp` (DDP constructor arguments and comm hook from a StrategyConfig), `fsdp`
(FSDP2 `fully_shard` on 1-D and 2-D meshes: FSDP and HSDP), `pipeline`
(`torch.distributed.pipelining` stages, schedules and bubble measurement), `compression`
(gradient-compression DDP comm hooks), `collectives` (hierarchical all-reduce), `advisor`
(the ToRSh guide's rules from model size, memory, world size and bandwidth to ranked
strategies; pure Python). `torsh_tune.parallelize` applies them in API mode.
"""
