"""benchmarks/igmc_probe.py: the enclosing subgraphs and the R-GCN the probe's figures rest on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from training.data import Entries

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "igmc_probe.py"
_spec = importlib.util.spec_from_file_location("igmc_probe", SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def known_ratings() -> tuple[Entries, np.ndarray]:
    # users 0..3, items 0..3; levels are the value minus 1
    rows = np.array([0, 0, 1, 1, 2, 2, 3])
    cols = np.array([0, 1, 0, 2, 1, 2, 3])
    values = np.array([5.0, 3.0, 4.0, 2.0, 1.0, 5.0, 4.0])
    return Entries(rows, cols, values), (values - 1).astype(np.int64)


def edges_of(graph, users: list[int], items: list[int]) -> set[tuple[int, int, int]]:
    roles, src, dst, typ = graph
    n_users = int((roles == 0).sum() + (roles == 2).sum())
    return {(users[s], items[d - n_users], t) for s, d, t in zip(src, dst, typ, strict=True)}


def test_enclosing_subgraph_has_the_neighbours_and_their_ratings_but_not_the_target() -> None:
    known, labels = known_ratings()
    graphs = probe.Subgraphs(known, labels, n_users=4, n_items=4, cap=0)
    graph = graphs.extract(0, 0, np.random.default_rng(0))
    roles = graph[0]
    # users: target 0, then user 1 (rated item 0); items: target 0, then item 1 (rated by user 0)
    assert roles.tolist() == [0, 2, 1, 3]
    # every known rating among {users 0, 1} x {items 0, 1} except the target (0, 0) itself
    assert edges_of(graph, [0, 1], [0, 1]) == {(0, 1, 2), (1, 0, 3)}
    # a query that is not a known rating: users who rated item 2 and items user 3 rated
    graph = graphs.extract(3, 2, np.random.default_rng(0))
    assert graph[0].tolist() == [0, 2, 2, 1, 3]
    assert edges_of(graph, [3, 1, 2], [2, 3]) == {(3, 3, 3), (1, 2, 1), (2, 2, 4)}


def test_neighbours_are_capped() -> None:
    rows = np.zeros(10, dtype=np.int64)
    cols = np.arange(10)
    known = Entries(rows, cols, np.full(10, 3.0))
    graphs = probe.Subgraphs(known, np.full(10, 2), n_users=1, n_items=11, cap=4)
    roles = graphs.extract(0, 10, np.random.default_rng(0))[0]
    assert (roles == 3).sum() == 4


def test_rgcn_mean_aggregation_matches_a_hand_computation() -> None:
    torch.manual_seed(0)
    layer = probe.RGCNLayer(2, 3, n_relations=2, n_bases=2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # node 0 receives relation 0 from nodes 1 and 2, node 1 relation 1 from node 0
    src, dst, rel = torch.tensor([1, 2, 0]), torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1])
    norm = torch.tensor([0.5, 0.5, 1.0])
    out = layer(x, src, dst, rel, norm, 3)
    w = layer.relation_weights()
    expected = layer.root(x).clone()
    expected[0] += (x[1] @ w[0] + x[2] @ w[0]) / 2
    expected[1] += x[0] @ w[1]
    torch.testing.assert_close(out, expected)


def test_collate_normalises_per_relation_and_offsets_graphs() -> None:
    known, labels = known_ratings()
    graphs = probe.Subgraphs(known, labels, n_users=4, n_items=4, cap=0)
    rng = np.random.default_rng(0)
    a, b = graphs.extract(0, 0, rng), graphs.extract(3, 2, rng)
    _, src, dst, rel, norm, tu, ti, n = probe.collate([a, b], 5, 0.0, rng)
    assert n == len(a[0]) + len(b[0])
    assert tu.tolist() == [0, len(a[0])] and ti.tolist() == [2, len(a[0]) + 3]
    assert len(src) == 2 * (len(a[1]) + len(b[1]))  # both directions
    # the weights into each (node, relation) sum to 1
    sums = torch.zeros(n * 5).index_add_(0, dst * 5 + rel, norm)
    assert torch.allclose(sums[sums > 0], torch.ones(int((sums > 0).sum())))
