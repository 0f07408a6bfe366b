"""A cheap induced-subgraph view of a networkx DiGraph, for the painter's rules."""

from __future__ import annotations

from collections.abc import Hashable

import networkx as nx


class Adjacency:
    """The subgraph of ``graph`` induced by ``keep`` (what ``graph.subgraph(keep)`` shows).

    Neighbours come in ``graph``'s order, read from its adjacency dicts on demand: networkx's
    filtered subgraph views cost several times more per step on large graphs.
    """

    def __init__(self, graph: nx.DiGraph, keep: dict | set):
        self.graph = graph
        self.keep = keep
        self._succ = graph._succ  # adjacency dicts: node -> {neighbour: edge data}
        self._pred = graph._pred

    def __contains__(self, v: Hashable) -> bool:
        return v in self.keep

    def successors(self, v: Hashable) -> list:
        keep = self.keep
        return [w for w in self._succ[v] if w in keep]

    def predecessors(self, v: Hashable) -> list:
        keep = self.keep
        return [u for u in self._pred[v] if u in keep]

    def topological_order(self, among: set) -> list:
        """The vertices of ``among`` (all kept) in an order where each comes after its
        predecessors in ``among`` (Kahn's algorithm over the edges between them, starting
        in graph order); raises like ``nx.topological_sort`` if they form a cycle."""
        succ, pred = self._succ, self._pred
        nodes = [v for v in self.graph if v in among]
        seen: set = set()
        for v in nodes:  # graph order, when it already puts producers first (the usual case)
            for u in pred[v]:
                if u in among and u not in seen:
                    break
            else:
                seen.add(v)
                continue
            break
        else:
            return nodes
        indegree = {v: sum(1 for u in pred[v] if u in among) for v in nodes}
        order = [v for v in nodes if not indegree[v]]
        for v in order:  # grows while iterating
            for w in succ[v]:
                if w in among:
                    indegree[w] -= 1
                    if not indegree[w]:
                        order.append(w)
        if len(order) != len(nodes):
            raise nx.NetworkXUnfeasible("Graph contains a cycle or graph changed during iteration")
        return order


__all__ = ["Adjacency"]
