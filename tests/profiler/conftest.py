"""A CollectiveCapture installed into torch.distributed for one test, torch's own functions given back after it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from torsh_tune.profiler import CollectiveCapture, StepTracker
from torsh_tune.profiler.collectives import _BINDINGS, _FUNCTIONAL, _SIZE_ARG


@pytest.fixture
def capture():
    """(capture, tracker): every c10d collective of the test recorded into `tracker.comm_done`.

    The test initialises its own process group; whatever is left of it is destroyed after the test.
    """
    names = [*_SIZE_ARG, *_BINDINGS, "destroy_process_group"]
    saved = {(module, name): getattr(module, name) for module in (c10d, dist) for name in names if hasattr(module, name)}
    saved.update({(funcol, name): getattr(funcol, name) for name in [*_FUNCTIONAL, "wait_tensor"]
                  if hasattr(funcol, name)})
    # Work's wait and every subclass's own (the capture times a subclass's at its first work: `_patch_wait`)
    work_type = torch._C._distributed_c10d.Work
    waits = {t: vars(t)["wait"] for t in (work_type, *work_type.__subclasses__()) if "wait" in vars(t)}
    tracker = StepTracker(rank=0, writer=None, warmup_steps=0, loss_every=1)
    cap = CollectiveCapture(tracker, rank=0)
    cap.install()
    try:
        yield cap, tracker
    finally:
        # Async collectives' future callbacks run on gloo's worker threads: give them time to finish
        # before the group is destroyed (its destructor joins them while holding the GIL).
        time.sleep(0.1)
        if dist.is_initialized():
            dist.destroy_process_group()
        for (module, name), original in saved.items():
            setattr(module, name, original)
        for t, original in waits.items():
            t.wait = original
