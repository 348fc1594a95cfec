"""Stage 3's graph measures: sampled betweenness and its pivots, on real graphs."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pyarrow as pa
import pytest

from noderag_cli.graph import Graph
from noderag_cli.index.attributes import (
    anchored_entities,
    important_entities,
    pivot_nodes,
    sampled_betweenness,
)


def _graph(g: nx.Graph, types: dict[int, str] | None = None) -> Graph:
    name = {i: f"N_{i:04d}" for i in sorted(g.nodes)}
    nodes = pa.table({"id": list(name.values()), "type": [(types or {}).get(i, "N") for i in name]})
    edges = pa.table({"source": [name[u] for u, v in g.edges], "target": [name[v] for u, v in g.edges],
                      "weight": pa.array(np.ones(g.number_of_edges()), pa.float32())})
    return Graph.from_tables(nodes, edges)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_betweenness_from_every_source_is_brandes(seed):
    g = nx.gnm_random_graph(60, 120, seed=seed)
    g.add_edges_from([(60, 61)])  # a second component
    expected = nx.betweenness_centrality(g, normalized=False)  # networkx halves undirected pair counts
    got = sampled_betweenness(_graph(g), list(range(g.number_of_nodes())))
    assert np.allclose(got, [2 * expected[i] for i in sorted(g.nodes)])


def test_betweenness_from_some_sources_sums_their_dependencies():
    g = nx.gnm_random_graph(40, 90, seed=7)
    graph = _graph(g)
    sources = [3, 11, 29]
    expected = nx.betweenness_centrality_subset(g, sources=sources, targets=list(g.nodes), normalized=False)
    got = sampled_betweenness(graph, sources)
    # networkx counts each (source, target) pair once and halves it for undirected graphs
    assert np.allclose(got, [2 * expected[i] for i in sorted(g.nodes)])


def test_pivots_are_kept_when_other_nodes_come_and_go():
    ids = np.array([f"N_{i:05d}" for i in range(2000)], dtype=object)
    pivots = set(ids[pivot_nodes(ids.tolist(), 10, seed=42)].tolist())
    assert len(pivots) == 10
    grown = np.array(sorted([*ids.tolist(), *[f"S_{i:05d}" for i in range(100)]]), dtype=object)
    after = set(grown[pivot_nodes(grown.tolist(), 10, seed=42)].tolist())
    assert after <= pivots | {f"S_{i:05d}" for i in range(100)}
    assert len(after & pivots) >= 5  # 100 new nodes among 2,100 displace about half a pivot on average
    others = [i for i in ids.tolist() if i not in pivots]
    shrunk = np.array(others[:1000] + sorted(pivots), dtype=object)  # half the other nodes deleted
    assert set(shrunk[pivot_nodes(shrunk.tolist(), 10, seed=42)].tolist()) == pivots
    assert set(ids[pivot_nodes(ids.tolist(), 10, seed=43)].tolist()) != pivots
    assert sorted(pivot_nodes(ids[:4].tolist(), 10, seed=42)) == [0, 1, 2, 3]


def test_important_entities_are_hubs_and_bridges():
    # two dense clusters of statements joined only through entity 100; entity 101 hangs off one leaf
    g = nx.Graph()
    for base in (0, 50):
        g.add_edges_from((base + i, base + j) for i in range(20) for j in range(i + 1, 20) if (i + j) % 3 == 0)
        g.add_edge(100, base)
    g.add_edge(101, 5)
    types = {i: "S" for i in g.nodes} | {100: "N", 101: "N"}
    graph = _graph(g, types)
    chosen = set(graph.ids[important_entities(graph, pivots=len(graph.ids), seed=42)].tolist())
    assert chosen == {"N_0100"}


def test_an_update_keeps_the_anchors_entities_and_adds_the_hubs_without_sampling_bridges():
    """Anchored (an incremental update): the hubs of the graph now, and the entities the anchor
    named that the graph still holds as entities; no betweenness: a bridge the anchor did not name
    waits for the next full build."""
    g = nx.Graph()
    g.add_edges_from((0, i) for i in range(1, 40))  # entity 0: a hub of 39 statements
    for base in (50, 80):
        g.add_edges_from((base + i, base + j) for i in range(10) for j in range(i + 1, 10) if (i + j) % 3 == 0)
        g.add_edge(100, base)  # entity 100 bridges the two clusters
    g.add_edges_from([(101, 1), (102, 2)])
    types = {i: "S" for i in g.nodes} | {0: "N", 100: "N", 101: "N", 102: "N"}
    graph = _graph(g, types)
    assert set(graph.ids[important_entities(graph, pivots=len(graph.ids), seed=42)].tolist()) == {"N_0000", "N_0100"}
    named = pa.array(["N_0101", "N_0003", "N_0999"], pa.string())  # an entity, a statement, a node gone
    assert set(graph.ids[anchored_entities(graph, named)].tolist()) == {"N_0000", "N_0101"}


def test_an_attribute_is_written_from_statements_first_then_stubs_by_id_within_its_budget():
    """Each chosen entity's texts, all entities at once: its S neighbours before its R neighbours,
    each kind by id (whatever the table's order), as many as fit the token budget, and the first
    alone when even it does not fit; an entity without any gets none."""
    from noderag_cli.index.attributes import _picked_texts

    rows = [("N_a", "N", 0), ("N_b", "N", 0), ("N_c", "N", 0), ("N_d", "N", 0), ("S_3", "S", 40), ("R_1", "R", 10),
            ("S_1", "S", 30), ("T_1", "T", 5), ("S_2", "S", 200), ("R_0", "R", 20)]
    nodes = pa.table({"id": [r[0] for r in rows], "type": [r[1] for r in rows],
                      "tokens": pa.array([r[2] for r in rows], pa.int32())})
    links = [("N_a", "S_3"), ("N_a", "R_1"), ("N_a", "S_1"), ("N_a", "T_1"), ("N_a", "R_0"), ("N_b", "S_2"),
             ("N_b", "S_1"), ("N_c", "N_a"), ("N_d", "S_2")]
    edges = pa.table({"source": [a for a, _ in links], "target": [b for _, b in links],
                      "weight": pa.array(np.ones(len(links)), pa.float32())})
    graph = Graph.from_tables(nodes, edges)
    row = {r[0]: i for i, r in enumerate(rows)}
    chosen = np.array([row["N_a"], row["N_b"], row["N_c"], row["N_d"]])
    named = [[rows[j][0] for j in picked] for picked in _picked_texts(graph, nodes, chosen, 80)]
    assert named == [["S_1", "S_3"], ["S_1"], [], ["S_2"]]  # 30 + 40 fit 80; R_0 would make 90
    named = [[rows[j][0] for j in picked] for picked in _picked_texts(graph, nodes, chosen, 1000)]
    assert named == [["S_1", "S_3", "R_0", "R_1"], ["S_1", "S_2"], [], ["S_2"]]
