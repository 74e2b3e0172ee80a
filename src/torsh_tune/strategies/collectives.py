"""Hierarchical all-reduce: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather.

With `l` ranks per node, only 1/l of every buffer crosses the slow inter-node link (each
rank all-reduces its reduce-scattered shard with the ranks of the same local index on the
other nodes), the rest moves inside the node. Degenerate layouts stay correct: one node is
reduce-scatter + all-gather, one rank per node is a plain all-reduce among the nodes.

Like the compression hooks, nothing blocks: the three dependent collectives run on three
different process groups, the first is issued by the caller (DDP's hook thread, in bucket
order) and the later ones from completion callbacks, each through an ordered issuer that
keeps the call order on every rank (see `compression._base`).

Example:
    >>> state = HierarchicalState(ranks_per_node=8)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, hierarchical_hook)  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..config import DistEnv, dist_env
from ..errors import invalid
from .compression._base import _OrderedIssuer, all_gather_flat, reduce_scatter_flat

__all__ = ["HierarchicalState", "NodeLayout", "hierarchical_all_reduce", "hierarchical_hook", "node_layout"]


class NodeLayout(NamedTuple):
    """Process-group ranks (global numbering) grouped by node."""

    intra: list[list[int]]
    """One sorted list per node, nodes in ascending order."""
    cross: list[list[int]]
    """One list per local index j: the j-th rank of every node."""

    @property
    def ranks_per_node(self) -> int:
        return len(self.intra[0])

    @property
    def num_nodes(self) -> int:
        return len(self.intra)


def node_layout(ranks: Sequence[int], ranks_per_node: int) -> NodeLayout:
    """Group `ranks` into nodes of `ranks_per_node` consecutive global ranks (node of r = r // ranks_per_node).

    Raises:
        ConfigError: ranks_per_node < 1, or nodes that would hold different numbers of ranks.

    Example:
        >>> node_layout(range(4), 2)
        NodeLayout(intra=[[0, 1], [2, 3]], cross=[[0, 2], [1, 3]])
    """
    if ranks_per_node < 1:
        raise invalid("ranks_per_node", "an integer >= 1", ranks_per_node)
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // ranks_per_node, []).append(r)
    intra = [sorted(nodes[k]) for k in sorted(nodes)]
    if len({len(g) for g in intra}) != 1:
        raise invalid("ranks_per_node", f"a node size that splits the ranks {list(ranks)} into equal nodes",
                      ranks_per_node)
    cross = [[g[j] for g in intra] for j in range(len(intra[0]))]
    return NodeLayout(intra, cross)


class HierarchicalState:
    """Subgroups, ordered issuers and byte counters of the hierarchical all-reduce.

    Must be constructed on every rank of `process_group` in the same order: it creates the
    intra-node, cross-node and (second) intra-node process groups, every rank calling
    `new_group` for every group in one fixed order.

    Args:
        process_group: the group to all-reduce over (None: the default group).
        ranks_per_node: node size in ranks; default: `env.local_world_size`.
        env: the rank's `DistEnv` (the runtime passes its own; default: parsed from torchrun's
            variables); without one the whole group is one node.
        chunk_bytes: CPU buffers above this size are reduced in chunks of it, pipelining the
            three stages (None: never). CUDA buffers are never chunked (NCCL pipelines itself).

    Attributes:
        layout: the `NodeLayout`; `ranks_per_node`, `num_nodes` its sizes.
        stats: running totals (JSON-serialisable, updated in place): calls, bytes (buffer
            sizes), wire_bytes (= inter_node_bytes), intra_node_bytes, inter_node_bytes,
            num_buckets (DDP buckets seen in one iteration). A rank's bytes are the sizes of
            its inputs to the collectives: reduce-scatter and all-gather inside the node,
            the shard all-reduce across nodes.
    """

    method = "hierarchical"

    def __init__(self, process_group: Any = None, *, ranks_per_node: int | None = None, env: DistEnv | None = None,
                 chunk_bytes: int | None = 4 << 20) -> None:
        self.process_group = process_group
        self.chunk_bytes = chunk_bytes
        pg = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(process_group)
        ranks = dist.get_process_group_ranks(pg)
        if ranks_per_node is None:
            env = env or dist_env()
            ranks_per_node = env.local_world_size if env is not None else len(ranks)
        self.layout = node_layout(ranks, ranks_per_node)
        self.ranks_per_node, self.num_nodes = self.layout.ranks_per_node, self.layout.num_nodes
        me = dist.get_rank()
        backend = dist.get_backend(process_group)

        def new_group(members: list[int], what: str) -> Any:
            # Every rank calls it for every group; only members join (the model may live on a subgroup).
            group = dist.new_group(members, backend=backend, use_local_synchronization=True,
                                   group_desc=f"torsh_tune_hierarchical_{what}")
            return group if me in members else None

        self.intra_group: Any = None  # reduce-scatter, issued by the caller
        self.cross_group: Any = None  # shard all-reduce, issued from callbacks
        self.gather_group: Any = None  # all-gather, issued from callbacks
        if self.ranks_per_node == 1:
            self.cross_group = process_group  # the caller issues it: the model's own group will do
        elif self.num_nodes == 1:
            self.intra_group = process_group
            self.gather_group = new_group(self.layout.intra[0], "gather")
        else:
            for what, groups, attr in (("intra", self.layout.intra, "intra_group"),
                                       ("cross", self.layout.cross, "cross_group"),
                                       ("gather", self.layout.intra, "gather_group")):
                for members in groups:
                    group = new_group(members, what)
                    if group is not None:
                        setattr(self, attr, group)
        # Only NCCL's reduce-scatter is known to hand out a future; elsewhere it is emulated.
        self.native_reduce_scatter = "nccl" in str(backend).lower()
        self._cross_issuer = _OrderedIssuer()
        self._gather_issuer = _OrderedIssuer()
        self.stats: dict[str, Any] = {"method": self.method, "ranks_per_node": self.ranks_per_node,
                                      "num_nodes": self.num_nodes, "calls": 0, "bytes": 0, "wire_bytes": 0,
                                      "intra_node_bytes": 0, "inter_node_bytes": 0, "num_buckets": 0}
        self._stats_lock = threading.Lock()

    def _count(self, nbytes: int, intra_bytes: int, inter_bytes: int) -> None:
        with self._stats_lock:
            s = self.stats
            s["calls"] += 1
            s["bytes"] += nbytes
            s["wire_bytes"] += inter_bytes
            s["inter_node_bytes"] += inter_bytes
            s["intra_node_bytes"] += intra_bytes


_Stage = tuple[_OrderedIssuer, int, Callable[[], torch.futures.Future]]


def _chain(first: torch.futures.Future, stages: list[_Stage], finish: Callable[[], torch.Tensor],
           result: torch.futures.Future) -> torch.futures.Future:
    """first → each stage's issue() in its issuer's ticket order → finish(); never waits."""

    def release(i: int) -> None:
        for issuer, ticket, _ in stages[i:]:
            issuer.submit(ticket, None)  # later tickets must not wait for a failed call

    def after(i: int) -> Callable[[torch.futures.Future], None]:
        def callback(fut: torch.futures.Future) -> None:
            try:
                fut.value()  # re-raises a failed collective
                if i == len(stages):
                    result.set_result(finish())
                    return
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                release(i)
                result.set_exception(exc)
                return
            issuer, ticket, issue = stages[i]

            def run() -> None:
                try:
                    issue().then(after(i + 1))
                except BaseException as exc:  # noqa: BLE001
                    release(i + 1)
                    result.set_exception(exc)

            issuer.submit(ticket, run)

        return callback

    first.then(after(0))
    return result


def _reduce_scatter(shard: torch.Tensor, full: torch.Tensor, state: HierarchicalState) -> torch.futures.Future:
    """Start the intra-node reduce-scatter of `full` into `shard`; a future completed once `shard` holds the sum."""
    if state.native_reduce_scatter and full.is_cuda:
        return reduce_scatter_flat(shard, full, group=state.intra_group, async_op=True).get_future()
    # gloo's reduce-scatter Work has no future ("Work::getFuture not implemented.", torch 2.13):
    # all-to-all the shards (the same bytes as a direct reduce-scatter) and sum the received
    # ones here, in local-rank order.
    received = full.new_empty(full.numel())
    fut = dist.all_to_all_single(received, full, group=state.intra_group, async_op=True).get_future()

    def reduce(f: torch.futures.Future) -> torch.Tensor:
        f.value()  # re-raises a failed collective
        return torch.sum(received.view(state.ranks_per_node, -1), dim=0, out=shard)

    return fut.then(reduce)


def hierarchical_all_reduce(tensor: torch.Tensor, state: HierarchicalState) -> torch.futures.Future:
    """Sum `tensor` in place over `state`'s process group, hierarchically; Future[Tensor] of `tensor`.

    Returns at once. Calls must come in the same order on every rank, from one thread at a
    time (as DDP calls its hooks, or a benchmark loop). A buffer whose size does not divide
    by the node size is padded with zeros for the reduce-scatter and all-gather. A CPU buffer
    larger than `state.chunk_bytes` goes in chunks, so the three stages pipeline: while one
    chunk crosses the slow link the next is reduce-scattered and the previous all-gathered
    (each stage has its own process group, hence its own gloo worker). Without that, a single
    64 MiB all-reduce on the emulated 2 x 2 cluster paid the intra-node stages (~230 ms of
    gloo copies) on top of the inter-node transfer and was no faster than the flat ring.

    Example:
        >>> state = HierarchicalState(ranks_per_node=2)  # doctest: +SKIP
        >>> hierarchical_all_reduce(torch.ones(10), state).wait()  # doctest: +SKIP
        tensor([4., 4., 4., 4., 4., 4., 4., 4., 4., 4.])
    """
    if not tensor.is_contiguous():
        raise invalid("hierarchical_all_reduce(tensor)", "a contiguous tensor", tuple(tensor.stride()))
    flat = tensor.view(-1)
    n, es = flat.numel(), flat.element_size()
    if n == 0 or state.world_size == 1:
        state._count(n * es, 0, 0)
        done = torch.futures.Future()
        done.set_result(tensor)
        return done
    step = n
    if state.chunk_bytes and not tensor.is_cuda and state.ranks_per_node > 1:
        step = max(state.chunk_bytes // es, state.ranks_per_node)
    futures, intra, inter = [], 0, 0
    for start in range(0, n, step):
        fut, chunk_intra, chunk_inter = _all_reduce_flat(flat[start:start + step], state)
        futures.append(fut)
        intra, inter = intra + chunk_intra, inter + chunk_inter
    state._count(n * es, intra, inter)

    def done_tensor(f: torch.futures.Future) -> torch.Tensor:
        for part in (f.value() if len(futures) > 1 else [f]):
            part.value()  # re-raises a failed collective
        return tensor

    joined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
    return joined.then(done_tensor)


def _all_reduce_flat(flat: torch.Tensor, state: HierarchicalState) -> tuple[torch.futures.Future, int, int]:
    """Start the hierarchical sum of the 1-D `flat` in place: (future, intra-node bytes, inter-node bytes)."""
    n, es = flat.numel(), flat.element_size()
    per_node = state.ranks_per_node
    if per_node == 1:
        fut = dist.all_reduce(flat, group=state.cross_group, async_op=True).get_future()
        return fut, 0, n * es
    shard_numel = -(-n // per_node)
    padded = shard_numel * per_node
    if padded == n:
        full = flat  # reduce-scatter input and all-gather output: no copy
    else:
        full = flat.new_zeros(padded)
        full[:n].copy_(flat)
    shard = flat.new_empty(shard_numel)
    inter = shard_numel * es if state.num_nodes > 1 else 0
    stages: list[_Stage] = []
    # Tickets now, in call order: the order every rank issues the later collectives in.
    if state.num_nodes > 1:
        stages.append((state._cross_issuer, state._cross_issuer.reserve(),
                       lambda: dist.all_reduce(shard, group=state.cross_group, async_op=True).get_future()))
    stages.append((state._gather_issuer, state._gather_issuer.reserve(),
                   lambda: all_gather_flat(full, shard, group=state.gather_group, async_op=True).get_future()))
    try:
        first = _reduce_scatter(shard, full, state)
    except BaseException:
        for issuer, ticket, _ in stages:
            issuer.submit(ticket, None)
        raise

    def finish() -> torch.Tensor:
        if full is not flat:
            flat.copy_(full[:n])
        return flat

    result = torch.futures.Future(devices=[flat.device]) if flat.is_cuda else torch.futures.Future()
    return _chain(first, stages, finish, result), (padded + shard_numel) * es, inter


# No annotations on hooks: DDP's _check_comm_hook compares them by identity.
def hierarchical_hook(state, bucket):  # noqa: ANN001, ANN201
    """Average a DDP bucket with the hierarchical all-reduce (DDP comm hook); Future[Tensor].

    Example:
        >>> ddp_model.register_comm_hook(HierarchicalState(ranks_per_node=8), hierarchical_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    with state._stats_lock:
        state.stats["num_buckets"] = max(state.stats["num_buckets"], bucket.index() + 1)
    return hierarchical_all_reduce(buf.div_(state.world_size), state)
