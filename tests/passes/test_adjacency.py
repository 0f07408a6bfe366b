"""passes.adjacency.Adjacency: the painter's induced-subgraph view."""

from __future__ import annotations

import networkx as nx
import pytest

from passes.adjacency import Adjacency


def graph():
    g = nx.DiGraph()
    g.add_edges_from([("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("x", "c")])
    return g


def test_neighbours_are_those_of_the_induced_subgraph_in_graph_order():
    g = graph()
    view = Adjacency(g, {"a", "b", "c", "d"})
    sub = g.subgraph({"a", "b", "c", "d"})
    for v in "abcd":
        assert view.successors(v) == list(sub.successors(v))
        assert view.predecessors(v) == list(sub.predecessors(v))
    assert "x" not in view and "c" in view
    assert view.predecessors("c") == ["b", "a"]  # x is left out


def test_topological_order_of_a_subset_puts_producers_first():
    g = nx.DiGraph()
    g.add_nodes_from(["d", "c", "b", "a"])  # graph order is not producer-first
    g.add_edges_from([("a", "b"), ("b", "c"), ("c", "d")])
    view = Adjacency(g, set(g))
    assert view.topological_order({"b", "c", "d"}) == ["b", "c", "d"]
    assert view.topological_order({"d", "a"}) == ["d", "a"]  # no edge between them


def test_a_cycle_raises_like_networkx():
    g = nx.DiGraph([("a", "b"), ("b", "a")])
    with pytest.raises(nx.NetworkXUnfeasible):
        Adjacency(g, set(g)).topological_order({"a", "b"})
