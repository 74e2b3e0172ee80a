"""The quick benchmark scripts still run against the current records and trace analysis.

benchmarks/dashboard.py synthesises records as the profiler writes them: when a record type
gained fields, its synthesiser broke and nothing noticed until the numbers were wanted.
"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON line is the last


def test_dashboard_benchmark_renders_a_synthetic_run():
    out = _run("dashboard.py", "--steps", "300", "--ranks", "2", "--repeat", "1")
    assert out["benchmark"] == "dashboard_overview" and out["render_s_median"] > 0 and out["jsonl_bytes"] > 0


def test_gpu_steps_benchmark_adds_the_device_steps_up_to_the_window():
    out = _run("gpu_steps.py")
    assert out["device_spans_add_up"] is True and set(out["traces"]) == {
        "hta-nccl-2rank-rank0", "hta-sampled-2rank", "hta-16rank-rank0"}


def test_trace_warmup_benchmark_times_both_arms_in_fresh_processes():
    out = _run("trace_warmup.py", "--pairs", "1")
    assert out["benchmark"] == "trace_warmup" and out["cold"]["n"] == out["warm"]["n"] == 1
    assert out["cold"]["median"] > 0 and out["warm"]["median"] > 0


def test_trace_align_benchmark_reads_the_step_after_a_window_in_real_runs():
    out = _run("trace_align.py", "--runs", "1")
    assert out["benchmark"] == "trace_align" and out["current"]["n"] == 1 and out["current"]["median"] > 0
    assert all(v is not None and v >= 0 for v in out["current"]["end_align_s"][0].values())


def test_module_hooks_benchmark_compares_the_three_arms():
    out = _run("module_hooks.py", "--blocks", "3", "--forwards", "200")
    assert out["benchmark"] == "module_hooks" and out["bare_us"] > 0
    assert set(out["hooked_cost_us"]) == set(out["watched_cost_us"]) == {"median", "q1", "q3"}


def test_agent_rendezvous_benchmark_runs_both_arms_in_fresh_processes():
    out = _run("agent_rendezvous.py", "--pairs", "1")
    assert out["benchmark"] == "agent_rendezvous" and set(out["wall_s"]) == {"torchrun", "agent"}
    assert all(s["median"] > 0 for s in out["wall_s"].values())
