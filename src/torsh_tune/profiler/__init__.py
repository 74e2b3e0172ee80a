"""Always-on probes that run inside each rank and the per-rank record writer."""

from ._clock import now
from .comm import TimedCommHook, default_allreduce
from .steps import StepTracker
from .system import SystemSampler, open_nvml_device
from .writer import RecordWriter

__all__ = [
    "RecordWriter",
    "StepTracker",
    "SystemSampler",
    "TimedCommHook",
    "default_allreduce",
    "now",
    "open_nvml_device",
]
