"""Where the data-parallel ranks run: N ranks per node, M nodes, and the per-hop subgroups.

DP rank ``r = m * N + n`` runs on node ``m`` as local index ``n`` (docs/design.md §4). The
intra-node group of rank ``r`` holds the N DP ranks of node ``m`` (group rank = ``n``); its
inter-node group holds the M DP ranks with local index ``n`` (group rank = ``m``).

[Note: creating subgroups collectively]
``torch.distributed.new_group`` must be called by *every* rank of the default group, in the
same order, even for groups it is not a member of. A DP group is usually a subgroup of the
world (e.g. TP=2 x DP=2: DP groups {0, 2} and {1, 3}), and different ranks pass different DP
groups. So :func:`build_topology` first all-gathers, over the whole world, each rank's DP group
(as global ranks), its :func:`node_id` and its ranks-per-node override; then every rank validates
every DP group's layout and creates the subgroups of all DP groups in one global order. The
result is cached per (DP group ranks, override), so a second call runs no collective.
Validation runs on the gathered data, identical everywhere: a bad placement raises the same
``ValueError`` on every rank instead of leaving some ranks waiting in ``new_group``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class DPTopology:
    """The data-parallel layout seen from one rank, with the process groups of both hops."""

    group: ProcessGroup
    """The DP group itself (the default group when ``build_topology`` got None)."""
    world: int
    """W = N * M, the DP size."""
    ranks_per_node: int
    """N, DP ranks per node."""
    nodes: int
    """M, nodes."""
    rank: int
    """This rank's DP rank r = node * N + local."""
    node: int
    """m."""
    local: int
    """n."""
    intra_group: ProcessGroup | None
    """The N DP ranks of this node (None when N == 1: there is no intra hop)."""
    inter_group: ProcessGroup | None
    """The M DP ranks with this local index (None when M == 1: there is no inter hop)."""


# (this rank's DP group as global ranks, override) -> (N, intra group, inter group). Only this
# rank's own key is stored: a call is collective-free exactly when this rank made it before.
_CACHE: dict[tuple[tuple[int, ...], int | None, str | None],
             tuple[int, ProcessGroup | None, ProcessGroup | None]] = {}


def _layout_error(ranks: tuple[int, ...], hosts: list[str]) -> str | None:
    """Why the DP group ``ranks`` (in DP order) on ``hosts`` cannot be served, or None."""
    blocks: list[tuple[str, int]] = []  # (host, count) runs in DP-rank order
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    seen = [host for host, _ in blocks]
    if len(set(seen)) != len(seen):
        return (f"the DP ranks of one node are not one contiguous block (DP group {list(ranks)} "
                f"runs on hosts {hosts}): place each node's ranks in one block so that DP rank "
                "r = node*N + local (e.g. srun --distribution=block), or pass ranks_per_node=1 "
                "(every hop inter-node)")
    counts = {count for _, count in blocks}
    if len(counts) != 1:
        return (f"nodes hold different numbers of DP ranks (DP group {list(ranks)}: "
                f"{dict(blocks)}): every node must hold the same number N of DP ranks")
    return None


def node_id() -> str:
    """Where this rank runs: the host name, plus torchrun's node rank when there is one.

    ``GROUP_RANK`` (set by torchrun's agent) tells apart two torchrun agents on one host, i.e.
    a multi-node launch simulated on one machine; without torchrun it is the host alone.
    """
    host = socket.gethostname()
    agent = os.environ.get("GROUP_RANK")
    return host if agent is None else f"{host}/node{agent}"


def _override_error(ranks: tuple[int, ...], hosts: list[str], n: int) -> str | None:
    """Why ``n`` DP ranks per node cannot serve the DP group ``ranks`` on ``hosts``, or None.

    An override may cut a real node into several (simulating nodes on one machine) but never
    join ranks of different nodes into one: the intra-node hop, at 8 bits, would then cross
    nodes (e.g. ``srun --distribution=cyclic`` places consecutive ranks on different nodes).
    """
    for start in range(0, len(ranks), n):
        where = sorted(set(hosts[start:start + n]))
        if len(where) > 1:
            return (f"ranks_per_node={n} (--dp-ranks-per-node) makes global ranks "
                    f"{list(ranks[start:start + n])} of DP group {list(ranks)} one node, but "
                    f"they run on different nodes {where}: place each node's ranks in one "
                    "contiguous block (e.g. srun --distribution=block), or use "
                    "ranks_per_node=1 (every hop inter-node)")
    return None


def _resolve_n(ranks: tuple[int, ...], hosts: list[str], override: int | None) -> int:
    if override is not None:
        if override < 1 or len(ranks) % override:
            raise ValueError(f"ranks_per_node={override} does not divide the DP size "
                             f"{len(ranks)} of DP group {list(ranks)}: pick a divisor")
        error = _override_error(ranks, hosts, override)
        if error is not None:
            raise ValueError(error)
        return override
    error = _layout_error(ranks, hosts)
    if error is not None:
        raise ValueError(error)
    return len(ranks) // len(set(hosts))


def build_topology(group: ProcessGroup | None = None,
                   ranks_per_node: int | None = None, *, node: str | None = None) -> DPTopology:
    """The :class:`DPTopology` of DP group ``group`` (None = the default group).

    Collective over the *default* group (see [Note: creating subgroups collectively]): every
    rank of the world calls it at the same point, each with its own DP group and the same
    ``ranks_per_node``. Without it, N comes from where the ranks run (:func:`node_id`);
    ``ranks_per_node`` overrides that (tests, simulations): the ranks are then taken as
    placed as DP rank ``r = m * N + n``, and each block of N consecutive DP ranks must run on
    one node (an override may split a real node, never join two). A repeated
    call with the same arguments returns the cached subgroups without any collective, so
    either every rank repeats an earlier call or none does.

    ``node``: where this rank runs, in place of :func:`node_id` (ranks with the same
    string share a node); for a group whose nodes follow from another group's simulated
    layout (the expert data-parallel group under ``--dp-ranks-per-node``). Pass it on every
    rank or on none.
    """
    if not dist.is_initialized():
        raise ValueError("build_topology needs an initialized torch.distributed process group")
    pg = group if group is not None else dist.group.WORLD
    my_ranks = tuple(dist.get_process_group_ranks(pg))
    key = (my_ranks, ranks_per_node, node)
    if key not in _CACHE:
        _create(key)
    n_per_node, intra, inter = _CACHE[key]
    world = len(my_ranks)
    rank = dist.get_rank(pg)
    topo = DPTopology(group=pg, world=world, ranks_per_node=n_per_node,
                      nodes=world // n_per_node, rank=rank, node=rank // n_per_node,
                      local=rank % n_per_node, intra_group=intra, inter_group=inter)
    # new_group sorts ranks, so group ranks follow DP ranks; check it rather than assume it.
    assert intra is None or dist.get_rank(intra) == topo.local
    assert inter is None or dist.get_rank(inter) == topo.node
    return topo


def _create(key: tuple[tuple[int, ...], int | None, str | None]) -> None:
    """Gather every rank's DP group, validate all of them, create all subgroups in order."""
    my_ranks, override, node = key
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (my_ranks, override, node or node_id()))
    host_of = {g: entry[2] for g, entry in enumerate(gathered)}
    overrides = {entry[1] for entry in gathered}
    if len(overrides) != 1:
        raise ValueError(f"ranks_per_node differs between ranks ({sorted(map(str, overrides))}): "
                         "pass the same value on every rank")
    dp_groups = sorted({entry[0] for entry in gathered})
    for ranks in dp_groups:
        if list(ranks) != sorted(ranks):
            raise ValueError(f"DP group {list(ranks)} does not list its ranks in increasing "
                             "order: create it with new_group(ranks) (sort_ranks=True)")
    # Validate everything before creating anything, so that errors are raised on every rank.
    layouts = [(ranks, _resolve_n(ranks, [host_of[g] for g in ranks], override))
               for ranks in dp_groups]
    me = dist.get_rank()
    mine: tuple[int, ProcessGroup | None, ProcessGroup | None] | None = None
    for ranks, n_per_node in layouts:
        m_nodes = len(ranks) // n_per_node
        intra = inter = None
        if n_per_node > 1:
            for m in range(m_nodes):
                members = list(ranks[m * n_per_node:(m + 1) * n_per_node])
                pg = dist.new_group(members)
                intra = pg if me in members and ranks == my_ranks else intra
        if m_nodes > 1:
            for n in range(n_per_node):
                members = list(ranks[n::n_per_node])
                pg = dist.new_group(members)
                inter = pg if me in members and ranks == my_ranks else inter
        if ranks == my_ranks:
            mine = (n_per_node, intra, inter)
    assert mine is not None
    _CACHE[key] = mine
