"""The recompute rule, in one place: when a planned op's output can be given back at backward by a recipe.

The engine asks it as a layer runs (`hooks`, on the live storages the tracker records), and the what-if model asks
it on step one's graph of the layer, for any set of plans (`graph`): the two see a node and its inputs differently
(`RecomputeRule`'s three methods), and decide by the same rule, so what the table and the solver predict is what a
run frees (`tests/test_torch_graph.py` holds them equal on every plan set). Pure: no torch.
"""

from typing import Dict, Hashable, Iterable, Optional

KEPT = "kept"  # an input there at backward as it is: a parameter, or a tensor autograd keeps as it is


class RecomputeRule:
    """A node's output can be recomputed at backward when it has a recipe already, or its op is planned here and
    each of its inputs is there as it is, or is a planned output, read as it was made, that can be recomputed in
    turn (a chain, down to tensors kept anyway)."""

    def has_recipe(self, node) -> bool:
        raise NotImplementedError

    def planned(self, node) -> bool:
        raise NotImplementedError

    def sources(self, node) -> Iterable[Optional[object]]:
        """For each input of `node`'s op: `KEPT`, the node that made it (read unchanged: recomputable in turn if
        that node is), or None (neither: it is not there at backward)."""
        raise NotImplementedError

    def key(self, node) -> Hashable:
        return node

    def recomputable(self, node, memo: Optional[Dict] = None) -> bool:
        if self.has_recipe(node):
            return True
        if not self.planned(node):
            return False
        memo = {} if memo is None else memo
        key = self.key(node)
        if key not in memo:
            memo[key] = False  # a layer's ops form no cycle; this only stops a repeated walk
            memo[key] = all(
                source is KEPT or (source is not None and self.recomputable(source, memo))
                for source in self.sources(node)
            )
        return memo[key]
