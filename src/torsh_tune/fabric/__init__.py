"""What the interconnect is: bus-bandwidth factors, the alpha-beta model, topology detection.

Pure Python, no torch and no pandas at import: analysis, autotune, reports, the bench and
the in-rank runtime all build on it, and it builds only on `config` and below. Measuring
the fabric (launching ranks) is `torsh_tune.bench`'s job; this package says what the
measurements mean.

Example:
    >>> from torsh_tune.fabric import bus_factor, fit_alpha_beta
    >>> bus_factor("all_reduce", 4)
    1.5
    >>> sizes = [1e3, 1e4, 1e5, 1e6]
    >>> fit = fit_alpha_beta("all_reduce", sizes, [1e-5 + 1.5e-9 * s for s in sizes], group_size=4)
    >>> round(fit.alpha_s * 1e6, 3), round(fit.busbw_gbps, 3)
    (10.0, 1.0)
"""

from __future__ import annotations

from ._alpha_beta import (
    ALLREDUCE_ALGORITHMS,
    MODEL_FILE,
    AlphaBeta,
    CommModel,
    fit_alpha_beta,
    fit_model,
    load_model,
    predict_allreduce_s,
    reference_busbw_gbps,
    save_model,
)
from ._busbw import bus_factor
from ._topology import Fact, Topology, detect_node, parse_nvidia_smi_topo, topology_from_hosts

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "AlphaBeta",
    "CommModel",
    "Fact",
    "MODEL_FILE",
    "Topology",
    "bus_factor",
    "detect_node",
    "fit_alpha_beta",
    "fit_model",
    "load_model",
    "parse_nvidia_smi_topo",
    "predict_allreduce_s",
    "reference_busbw_gbps",
    "save_model",
    "topology_from_hosts",
]
