"""The loss lever's option: how the tokens are chunked (`Chunking`), its plan words (`SYNTAX`), and the chunkings worth
offering.
"""

import math
from dataclasses import dataclass
from typing import List, Optional

from .....plans import HEAD_LEVER, LeverOption, LeverPart, LeverSyntax

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
    hold no more than the final hidden states, the bare `Loss+:1:-1` (as few chunks as keep a chunk's rows within
    tokens x hidden / vocabulary, rounded down, and the tokens spread evenly over them: at 8,192 tokens of a Llama-3
    head, 32 chunks of 256 rows, the rows `@chunks32` makes)."""

    chunks: Optional[int] = None
    tokens: Optional[int] = None

    @classmethod
    def of(cls, option: LeverOption) -> "Chunking":
        """The chunking a policy's option asks for (one part: a model has one head; the grammar checked its word)."""
        (part,) = option.parts
        if part.word == "chunks":
            return cls(chunks=part.number)
        if part.word == "tokens":
            return cls(tokens=part.number)
        return cls()

    def rows(self, n_tokens: int, hidden: int, vocab: int) -> int:
        """The rows (tokens) of one chunk for a step of `n_tokens` tokens."""
        if self.tokens is not None:
            return max(1, self.tokens)
        if self.chunks is not None:
            return max(1, math.ceil(n_tokens / self.chunks))
        most = n_tokens * hidden // vocab  # the most rows whose logits hold no more than the hidden states
        if most < 1:
            return 1
        return math.ceil(n_tokens / math.ceil(n_tokens / most))  # within `most`: chunks >= n_tokens / most

    @property
    def option(self) -> LeverOption:
        """The chunking as a policy holds it (`Chunking.of`'s inverse)."""
        if self.tokens is not None:
            return LeverOption((LeverPart(word="tokens", number=self.tokens),))
        if self.chunks is not None:
            return LeverOption((LeverPart(word="chunks", number=self.chunks),))
        return LeverOption()

    def describe(self) -> str:
        if self.tokens is not None:
            return f"chunks of {self.tokens} tokens"
        if self.chunks is not None:
            return f"{self.chunks} chunk{'s' if self.chunks != 1 else ''}"
        return "chunks whose logits hold no more than the final hidden states"


def plan_of(chunking: Optional[Chunking]) -> str:
    """`Loss+:1:-1@chunks8` for a chunking, "" for the model's own head."""
    return SYNTAX.plan_of(None if chunking is None else chunking.option)


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
