"""The hierarchical all-reduce on a real 4-rank gloo process group, and its node layout.

One launch (`tests/data/scripts/train_hierarchical.py` under the torsh-tune bootstrap with
`collectives.hierarchical`, 2 ranks per node) checks the explicit states for 2 nodes x 2,
1 node x 4 and 4 nodes x 1 against gloo's all-reduce and plain DDP, and the configured hook
on the one model that registers none (zero code).
"""

from __future__ import annotations

import json
import math

import pytest

from torsh_tune.errors import ConfigError
from torsh_tune.rundir import RunDir
from torsh_tune.strategies.collectives import node_layout

from helpers import SCRIPTS, read_jsonl, torchrun_bootstrap

SCRIPT = SCRIPTS / "train_hierarchical.py"
NPROC = 4
LAYOUTS = ("2", "4", "1")  # ranks per node
SIZES = (1, 2, 3, 7, 64, 1001, 65537, 15)  # the script's --sizes and its 3x5 tensor
LAUNCH_TIMEOUT_S = 150


# -- node layout (pure) --------------------------------------------------------------------
def test_node_layout_groups_consecutive_ranks_into_nodes():
    assert node_layout(range(4), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert node_layout(range(4), 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    one = node_layout(range(4), 1)
    assert one.intra == [[0], [1], [2], [3]] and one.cross == [[0, 1, 2, 3]]
    assert (one.ranks_per_node, one.num_nodes) == (1, 4)
    # A subgroup spread over two nodes of 4: its ranks on each node form the node.
    assert node_layout([1, 2, 5, 6], 4) == ([[1, 2], [5, 6]], [[1, 5], [2, 6]])


@pytest.mark.parametrize(("ranks", "per_node", "message"), [
    (range(4), 3, "ranks_per_node must be a node size that splits the ranks [0, 1, 2, 3] into equal nodes, but got 3"),
    (range(4), 0, "ranks_per_node must be an integer >= 1, but got 0"),
])
def test_node_layout_rejects_unequal_nodes(ranks, per_node, message):
    with pytest.raises(ConfigError) as exc:
        node_layout(ranks, per_node)
    assert str(exc.value) == message


# -- 4 ranks, one launch --------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[RunDir, list[dict]]:
    tmp = tmp_path_factory.mktemp("hierarchical")
    run = RunDir(tmp / "run")
    out = str(tmp / "out")
    config = {"strategy": {"collectives": {"hierarchical": True, "ranks_per_node": 2}}}
    proc = torchrun_bootstrap(run.path, SCRIPT, "--out", out, "--layouts", ",".join(LAYOUTS), nproc=NPROC,
                              config=config, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, [json.loads(open(f"{out}.rank{r}.json").read()) for r in range(NPROC)]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("per_node", LAYOUTS)
def test_hierarchical_sum_equals_gloo_all_reduce(launched, per_node):
    _, results = launched
    for result in results:
        layout = result[per_node]
        assert layout["num_nodes"] == NPROC // int(per_node)
        errors = layout["allreduce_rel_err"]
        assert sorted(map(int, errors)) == sorted(SIZES)
        assert max(errors.values()) <= 1e-6, errors


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("per_node", LAYOUTS)
def test_chunked_hierarchical_sum_is_exact_and_one_call_per_buffer(launched, per_node):
    # chunk_bytes=4000: the 1001- and 65537-value buffers go in 2 and 66 pipelined chunks.
    _, results = launched
    for result in results:
        layout = result[per_node]
        assert layout["chunked_rel_err"] <= 1e-6
        assert layout["chunked_calls"] == len(SIZES)
        assert layout["chunked_grad_max_diff"] <= 1e-5
    assert len({r[per_node]["chunked_checksum"] for r in results}) == 1


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("per_node", LAYOUTS)
def test_hierarchical_sum_counts_intra_and_inter_node_bytes(launched, per_node):
    _, results = launched
    local, nodes = int(per_node), NPROC // int(per_node)
    shard = [math.ceil(n / local) for n in SIZES]
    expected = {
        "calls": len(SIZES),
        "bytes": 4 * sum(SIZES),
        # shard all-reduce across nodes; reduce-scatter input (padded) and all-gather input inside
        "inter_node_bytes": 4 * sum(shard) if nodes > 1 else 0,
        "intra_node_bytes": 4 * sum(local * s + s for s in shard) if local > 1 else 0,
    }
    for result in results:
        stats = result[per_node]["allreduce_stats"]
        assert {k: stats[k] for k in expected} == expected
        assert stats["wire_bytes"] == stats["inter_node_bytes"]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("per_node", [*LAYOUTS, "config"])
def test_ddp_with_the_hook_matches_plain_ddp_and_replicas_stay_identical(launched, per_node):
    _, results = launched
    assert len({r[per_node]["checksum"] for r in results}) == 1
    for result in results:
        assert result[per_node]["grad_max_diff"] <= 1e-5
    if per_node != "config":
        assert results[0][per_node]["stats"]["num_buckets"] == 3


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_configured_hierarchical_hook_is_timed_per_bucket_and_script_hooks_win(launched):
    run, _ = launched
    for rank in range(NPROC):
        meta = json.loads(run.rank_file(rank, "meta").read_text())
        hooks = [m["comm_hook"] for m in meta["ddp_models"]]
        # Per layout a whole-buffer and a chunked state register the script's hook; the last model none.
        assert hooks == ["plain_allreduce", *["hierarchical_hook"] * (2 * len(LAYOUTS)), "torsh_tune_hierarchical"]
        *replaced, configured = meta["hierarchical"]
        assert all(s["replaced_by_script_hook"] and s["calls"] == 0 for s in replaced)
        notes = [n for n in meta["notes"] if n.startswith("collectives.hierarchical=true has no effect")]
        assert len(notes) == 2 * len(LAYOUTS) + 1
        assert (configured["ranks_per_node"], configured["num_nodes"], configured["num_buckets"]) == (2, 2, 3)
        comm = read_jsonl(run.rank_file(rank, "comm"))
        # The c10d capture records each stage with its own process group; a bucket's first collective
        # carries the bucket's index, hook and gradient bytes.
        records = [c for c in comm if c.get("hook") == "torsh_tune_hierarchical" and c.get("grad_bytes")]
        assert len(records) == configured["calls"] > 3
        assert len({c["grad_bytes"] for c in records}) >= 3  # one size per bucket
        assert all(c["group_size"] == configured["ranks_per_node"] for c in records)  # starts inside the node
        # What crosses the node boundary: collectives over a group whose ranks sit on different nodes.
        nodes = lambda c: {r // configured["ranks_per_node"] for r in c["group_ranks"]}  # noqa: E731
        inter = [c for c in comm if c["group_ranks"] and len(nodes(c)) > 1 and c["group_size"] < NPROC]
        assert inter and all(c["group_size"] == configured["num_nodes"] for c in inter)
        # Half of each bucket crosses (the configured model's and the script hooks' models').
        assert sum(c["bytes"] for c in inter) >= configured["inter_node_bytes"] > 0
        script = [c for c in comm if c.get("hook") == "hierarchical_hook" and c.get("grad_bytes")]
        assert script  # the script's own hook is wrapped and its collectives recorded too
