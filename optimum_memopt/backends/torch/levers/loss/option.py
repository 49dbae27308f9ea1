"""The loss lever's option: how the tokens are chunked (`Chunking`), its plan words (`SYNTAX`), and the chunkings worth
offering.
"""

import math
from dataclasses import dataclass
from typing import List, Optional

from .....plans import HEAD_LEVER, LeverSyntax

SYNTAX = LeverSyntax(
    name=HEAD_LEVER,
    plan="Loss+",
    what="the head and loss",
    layers=False,
    parameter="chunking",
    parameters=(("chunks", "N chunks"), ("tokens", "N tokens a chunk")),
    default="chunks whose logits hold no more than the final hidden states",
    examples=("Loss+:1:-1", "Loss+:1:-1@chunks8", "Loss+:1:-1@tokens1024"),
    once="a model has one head",
)


@dataclass(frozen=True)
class Chunking:
    """How the tokens are chunked: `chunks` of equal rows, or `tokens` rows a chunk; neither: chunks whose logits
    hold no more than the final hidden states (rows = tokens x hidden / vocabulary), the bare `Loss+:1:-1`."""

    chunks: Optional[int] = None
    tokens: Optional[int] = None

    @classmethod
    def from_selector(cls, selector: str) -> "Chunking":
        """`chunks8`, `tokens1024` or "" (the plan grammar has checked the form)."""
        if selector.startswith("chunks"):
            return cls(chunks=int(selector[len("chunks") :]))
        if selector.startswith("tokens"):
            return cls(tokens=int(selector[len("tokens") :]))
        return cls()

    def rows(self, n_tokens: int, hidden: int, vocab: int) -> int:
        """The rows (tokens) of one chunk for a step of `n_tokens` tokens."""
        if self.tokens is not None:
            return max(1, self.tokens)
        if self.chunks is not None:
            return max(1, math.ceil(n_tokens / self.chunks))
        return max(1, math.ceil(n_tokens * hidden / vocab))

    @property
    def selector(self) -> str:
        """The chunking as the policy holds it (`chunks8`, `tokens1024`; "" the default)."""
        if self.tokens is not None:
            return f"tokens{self.tokens}"
        return f"chunks{self.chunks}" if self.chunks is not None else ""

    def describe(self) -> str:
        if self.tokens is not None:
            return f"chunks of {self.tokens} tokens"
        if self.chunks is not None:
            return f"{self.chunks} chunk{'s' if self.chunks != 1 else ''}"
        return "chunks whose logits hold no more than the final hidden states"


def plan_of(chunking: Optional[Chunking]) -> str:
    """`Loss+:1:-1@chunks8` for a chunking, "" for the model's own head."""
    if chunking is None:
        return ""
    if chunking.tokens is not None:
        return f"Loss+:1:-1@tokens{chunking.tokens}"
    return f"Loss+:1:-1@chunks{chunking.chunks}" if chunking.chunks is not None else "Loss+:1:-1"


def candidate_chunks(tokens: int, hidden: int, vocab: int) -> List[int]:
    """Chunk counts worth offering: doubling from 2 up to where a chunk's logits hold no more than the final hidden
    states (vocabulary / hidden chunks); none where the logits are no bigger than the hidden states."""
    most = min(tokens, math.ceil(vocab / hidden))
    out, c = [], 2
    while c <= most:
        out.append(c)
        c *= 2
    if out and out[-1] < most:
        out.append(most)
    return out
