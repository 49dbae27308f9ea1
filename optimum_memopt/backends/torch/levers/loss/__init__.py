"""The loss lever (`Loss+`): a causal LM's head and its cross-entropy run over chunks of tokens.

Once the layers are recomputed, a decoder's step peaks at its head and loss: the whole logits (tokens x vocabulary,
upcast to fp32 by transformers' causal-LM loss) and their gradient. With this lever the whole logits never exist in
training. The model's own forward runs with the head given no position to project (`logits_to_keep`, an empty index:
the backbone, and all the family does around it, run as they are); the final hidden states are taken from the
backbone's output; and the loss is summed chunk by chunk: each chunk's logits are made by the head module, their
cross-entropy summed, and the logits let go. Backward makes each chunk's logits again from the hidden states
(`torch.utils.checkpoint`, RNG state kept: one more head matmul a step, the lever's price). The sum is divided as
transformers divides it: by `num_items_in_batch` where the Trainer passes it, else by the tokens whose label is not
`ignore_index`.

Kept from transformers' loss: the shift (or the caller's `shift_labels`), `ignore_index`, the fp32 upcast,
`num_items_in_batch`, and the head as the model's forward runs it, with what it does to the logits before the loss
(a soft cap, a scale, `.float()`) and adds to the loss after (an MoE's aux loss, with its gradient): both read from
the forward's own source (`head_form`), so any causal LM whose forward has that form is chunked, whatever its family.
The head module sees the same calls (tied embeddings, a LoRA on `lm_head`, ZeRO-3's and FSDP's gathering hooks and
autocast); the Trainer's label smoothing is `LabelSmoother`'s formula, chunk by chunk (`smoothing`, set by the
trainer), with no aux loss added (the Trainer's smoother adds none).

A training output carries no logits (`None`), said once; evaluation, `predict`, generation, and any forward without
labels or without grad run the model's forward untouched. A model whose forward this lever does not know is refused
by name (`loss_problem`), never left whole silently.

The package, by job: `option` (the plan words and how the tokens are chunked), `head_form` (the forward's head and
loss read from its source), `chunks` (the loss summed chunk by chunk), `lever` (`ChunkedLoss`: the models it takes,
its forward, installed and removed), `measure` (each way measured after step one on the shared harness, and what
that gives the solver and the table).
"""

from .chunks import chunk_losses
from .head_form import HeadForm, head_form
from .lever import ChunkedLoss, causal_lm, fused_by_trl, fused_onto, loss_problem
from .measure import BOUND_MARGIN, OWN_HEAD, REPEATS, HeadMeasure, HeadOption, choices, how_measured, measure, rows
from .option import SYNTAX, Chunking, candidate_chunks, plan_of

LEVER = ChunkedLoss

__all__ = [
    "BOUND_MARGIN",
    "Chunking",
    "ChunkedLoss",
    "HeadForm",
    "HeadMeasure",
    "HeadOption",
    "LEVER",
    "OWN_HEAD",
    "REPEATS",
    "SYNTAX",
    "candidate_chunks",
    "causal_lm",
    "choices",
    "chunk_losses",
    "fused_by_trl",
    "fused_onto",
    "head_form",
    "how_measured",
    "loss_problem",
    "measure",
    "plan_of",
    "rows",
]
