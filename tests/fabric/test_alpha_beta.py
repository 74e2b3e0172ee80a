"""The alpha-beta fit and the all-reduce predictions, on synthetic data (pure, no torch)."""

from __future__ import annotations

import math
import random

import pytest

from torsh_tune.errors import ConfigError
from torsh_tune.fabric import (
    CommModel,
    bus_factor,
    fit_alpha_beta,
    fit_model,
    load_model,
    predict_allreduce_s,
    reference_busbw_gbps,
    save_model,
)

SIZES = tuple((4 << 10) * 4**i for i in range(9))  # 4 KiB -> 256 MiB, the bench's default sweep


def _times(collective_factor: float, alpha_s: float, beta: float, noise: float = 0.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [(alpha_s + collective_factor * s * beta) * (1 + rng.uniform(-noise, noise)) for s in SIZES]


def test_exact_data_recovers_parameters_and_zero_heldout_error():
    alpha, beta = 50e-6, 1 / 2e9  # 50 us, 2 GB/s links
    fit = fit_alpha_beta("all_reduce", SIZES, _times(1.0, alpha, beta), group_size=2)  # 2(n-1)/n = 1 at n=2
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert fit.busbw_gbps == pytest.approx(2.0, rel=1e-6)
    assert fit.heldout_median_rel_err == pytest.approx(0.0, abs=1e-9)
    assert fit.num_points == len(SIZES)


@pytest.mark.parametrize("collective,n,factor", [("all_reduce", 4, 1.5), ("all_gather", 4, 0.75),
                                                 ("reduce_scatter", 8, 7 / 8), ("broadcast", 4, 1.0),
                                                 ("all_to_all", 2, 0.5)])
def test_noisy_data_recovers_parameters_with_the_bus_factor(collective, n, factor):
    alpha, beta = 200e-6, 1 / 0.5e9
    fit = fit_alpha_beta(collective, SIZES, _times(factor, alpha, beta, noise=0.05, seed=n), group_size=n)
    assert fit.factor == pytest.approx(factor)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.15)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.10)
    assert fit.heldout_median_rel_err < 0.06  # the noise is +-5 %


def test_a_model_that_does_not_fit_reports_a_large_heldout_error():
    # Time quadratic in size is not alpha-beta: the held-out error must say so.
    fit = fit_alpha_beta("all_reduce", SIZES, [1e-5 + (s / 1e6) ** 2 for s in SIZES], group_size=2)
    assert fit.heldout_median_rel_err > 0.3


def test_parameters_stay_non_negative():
    # Pure bandwidth (no latency) with a hint of negative intercept from noise.
    times = [s / 1e9 * (1 - 0.01 * (i % 2)) for i, s in enumerate(SIZES)]
    fit = fit_alpha_beta("broadcast", SIZES, times, group_size=2)
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte > 0
    flat = fit_alpha_beta("broadcast", SIZES[:4], [1e-3] * 4, group_size=2)  # pure latency
    assert flat.beta_s_per_byte == 0 and flat.alpha_s == pytest.approx(1e-3)
    assert flat.busbw_gbps is None


def test_too_few_points_is_a_config_error():
    with pytest.raises(ConfigError, match="at least two"):
        fit_alpha_beta("all_reduce", [4096], [1e-4], group_size=2)


def _bench_doc(world=4, nnodes=2, per_node=2):
    rows = []
    # Fast intra-node links (10 GB/s), a slow inter-node network (0.1 GB/s).
    for level, n, alpha, beta in (("inter", world, 400e-6, 1 / 0.1e9), ("intra", per_node, 20e-6, 1 / 10e9)):
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            for s in SIZES:
                t = alpha + bus_factor(name, n) * s * beta
                rows.append({"collective": name, "level": level, "group_size": n, "size_bytes": s, "status": "ok",
                             "time_s": t, "busbw_gbps": bus_factor(name, n) * s / t / 1e9})
    rows.append({"collective": "all_to_all", "level": "inter", "group_size": world, "size_bytes": 4096,
                 "status": "unsupported", "time_s": None, "busbw_gbps": None})
    return {"world_size": world, "nnodes": nnodes, "nproc_per_node": per_node, "backend": "gloo", "rows": rows}


def test_fit_model_per_level_and_allreduce_algorithms():
    model = fit_model(_bench_doc())
    assert {(f.collective, f.level) for f in model.fits} == {
        (c, lvl) for c in ("all_reduce", "all_gather", "reduce_scatter") for lvl in ("inter", "intra")}
    assert model.get("all_reduce", "intra").busbw_gbps == pytest.approx(10.0, rel=1e-6)
    assert model.get("all_reduce").level == "inter"  # the widest group by default
    s = 64 << 20
    ring = predict_allreduce_s(model, s, algorithm="ring")
    assert ring == pytest.approx(model.get("all_reduce", "inter").predict_s(s))
    # rs+ag from their own fits: each moves (n-1)/n S, together the ring's bytes.
    assert predict_allreduce_s(model, s, algorithm="rs_ag") == pytest.approx(ring, rel=0.01)
    hier = predict_allreduce_s(model, s, algorithm="hierarchical")
    assert hier < ring / 1.5  # only S/2 crosses the slow network
    # One link per node (an emulated node's veth): both ranks' S/2 shards cross it at once, so
    # the link carries S per direction instead of the ring's 1.5 S.
    shared = predict_allreduce_s(model, s, algorithm="hierarchical", node_links=1)
    intra = 2 * (20e-6 / 2 + s / 2 / 10e9)
    assert shared - intra == pytest.approx(2 * (hier - intra), rel=0.01)
    assert ring / 1.6 < shared < ring / 1.4
    tree = predict_allreduce_s(model, s, algorithm="tree")
    assert tree == pytest.approx(2 * math.ceil(math.log2(4)) * (400e-6 / 6 + s / 0.1e9))
    with pytest.raises(ConfigError, match="algorithm"):
        predict_allreduce_s(model, s, algorithm="butterfly")


def test_reference_busbw_from_rows_and_model(tmp_path):
    doc = _bench_doc()
    from_rows = reference_busbw_gbps(doc)
    model = fit_model(doc)
    from_model = reference_busbw_gbps(model, 256 << 20)
    assert from_rows == pytest.approx(from_model, rel=0.01)
    assert from_model < 0.1 * 1.5  # near the inter-node 1/beta (factor 1.5 at n=4 counted in busbw)
    assert reference_busbw_gbps({"rows": []}) is None
    path = save_model(model, tmp_path)
    assert path.name == "bench_model.json"
    assert load_model(tmp_path) == model
    assert isinstance(load_model(path), CommModel)
    with pytest.raises(ConfigError):
        load_model(tmp_path / "nope")

