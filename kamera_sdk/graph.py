"""Dependency graph of conditioning (core paper, appendix E "cascade").

Nodes are chunks and patches; edges run from an antecedent chunk to the patch (or materialised
conditioning) of a dependent chunk, and from that patch to the chunk. When an antecedent is recalled,
every chunk downstream that is in the window is marked stale and is re-materialised lazily, in window
order (each one after its antecedents), at the next use. An eviction marks nothing: the chunks that
absorbed the evicted one keep it as slide survivors do (paper §5); only its return would double it.
"""

from __future__ import annotations

import networkx as nx

from .chunks import Antecedent, ChunkId, antecedent_signature


class DependencyGraph:
    """A thin, typed layer over ``networkx.DiGraph``."""

    def __init__(self) -> None:
        self.g: nx.DiGraph = nx.DiGraph()

    def copy(self) -> DependencyGraph:
        other = DependencyGraph()
        other.g = self.g.copy()
        return other

    @staticmethod
    def chunk_node(chunk_id: ChunkId) -> tuple[str, str]:
        return ("chunk", chunk_id)

    @staticmethod
    def patch_node(chunk_id: ChunkId, antecedent: Antecedent) -> tuple[str, str, str]:
        return ("patch", chunk_id, antecedent_signature(antecedent))

    def add_chunk(self, chunk_id: ChunkId) -> None:
        self.g.add_node(self.chunk_node(chunk_id), kind="chunk", stale=False)

    def set_conditioning(self, chunk_id: ChunkId, antecedent: Antecedent, kind: str) -> None:
        """Record that ``chunk_id``'s live KV is conditioned on ``antecedent`` (replaces older edges)."""
        node = self.chunk_node(chunk_id)
        if node not in self.g:
            self.add_chunk(chunk_id)
        self.drop_conditioning(chunk_id)
        pnode = self.patch_node(chunk_id, antecedent)
        self.g.add_node(pnode, kind=kind, antecedent=antecedent)
        self.g.add_edge(pnode, node)
        for a in antecedent:
            anode = self.chunk_node(a)
            if anode not in self.g:
                self.add_chunk(a)
            self.g.add_edge(anode, pnode)
        self.g.nodes[node]["stale"] = False

    def drop_conditioning(self, chunk_id: ChunkId) -> None:
        """Forget what ``chunk_id``'s live KV was conditioned on (it was re-materialised, or left the
        window): the graph holds one conditioning node per live chunk, however long the session."""
        node = self.chunk_node(chunk_id)
        if node in self.g:
            self.g.remove_nodes_from([p for p in list(self.g.predecessors(node)) if p[0] == "patch"])

    def remove_unused(self, chunk_id: ChunkId) -> None:
        """Drop a forgotten chunk's node unless a live chunk's conditioning still names it."""
        self.drop_conditioning(chunk_id)
        node = self.chunk_node(chunk_id)
        if node in self.g and self.g.out_degree(node) == 0:
            self.g.remove_node(node)

    def dependents(self, chunk_id: ChunkId) -> list[ChunkId]:
        """Chunks whose live conditioning depends (transitively) on ``chunk_id``.

        The graph may hold cycles (after a reorder, A can have absorbed B and B, earlier, A), so no
        topological sort is taken here: the window re-materialises dependents in window order, which is
        the order in which each one's antecedents are rebuilt.
        """
        node = self.chunk_node(chunk_id)
        if node not in self.g:
            return []
        return sorted(ChunkId(n[1]) for n in nx.descendants(self.g, node) if n[0] == "chunk")

    def mark_stale(self, chunk_ids: list[ChunkId]) -> None:
        for c in chunk_ids:
            node = self.chunk_node(c)
            if node in self.g:
                self.g.nodes[node]["stale"] = True

    def is_stale(self, chunk_id: ChunkId) -> bool:
        node = self.chunk_node(chunk_id)
        return bool(node in self.g and self.g.nodes[node].get("stale", False))
