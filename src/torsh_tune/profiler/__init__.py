"""Always-on probes that run inside each rank and the per-rank record writer."""

from ._clock import now
from .collectives import CollectiveCapture
from .comm import TimedCommHook, default_allreduce
from .steps import StepTracker
from .system import SystemSampler, open_nvml_device
from .writer import RecordWriter, SharedFields

__all__ = [
    "CollectiveCapture",
    "RecordWriter",
    "SharedFields",
    "StepTracker",
    "SystemSampler",
    "TimedCommHook",
    "default_allreduce",
    "now",
    "open_nvml_device",
]
