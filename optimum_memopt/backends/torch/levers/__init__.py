"""Levers beyond a layer's recompute, one module each: its mechanism (what it changes in a running step), what it
would do to a measured step (its what-if model) and the configurations it offers the solver.

The layers' own levers (planned ops recomputed from recipes, a layer checkpointed whole) are the backend's core and
live across `apply/`, `measure/` and `decide/`. A lever here may use all three; none of them imports a lever.

- `loss`: a causal LM's head and cross-entropy run over chunks of tokens, each chunk's logits recomputed in backward
  (`Loss+`).
"""
