"""Which checkpoint `resume_from_checkpoint` resumes from, when some were cut short.

The Trainer writes a checkpoint's `trainer_state.json` last (after the model, optimizer, scheduler and RNG state),
so a save killed part way leaves a `checkpoint-N/` without it (or with half of it). transformers'
`get_last_checkpoint` picks the highest N whatever it holds, and the resume then fails inside the Trainer with
`FileNotFoundError`. Here `resume_from_checkpoint=True` resumes from the newest complete checkpoint, naming the ones
it skipped; a path given explicitly that is incomplete is refused with the one to pass instead.
"""

import json
import os
import re
from typing import List, Optional, Tuple

STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME, written last
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def why_incomplete(path: str) -> Optional[str]:
    """Why the checkpoint at `path` cannot be resumed from (a save cut short), or None when it is complete."""
    state = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state):
        return f"no {STATE_FILE}: its save was cut short"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} cannot be read ({type(e).__name__}): its save was cut short"
    return None


def checkpoints(output_dir: str) -> List[str]:
    """The `checkpoint-N` directories of `output_dir`, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def newest_complete(output_dir: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """The newest complete checkpoint of `output_dir` (or None), and the newer ones skipped, each with why."""
    skipped = []
    for path in checkpoints(output_dir):
        why = why_incomplete(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def resolve(resume_from_checkpoint, output_dir: str) -> Tuple[object, List[str]]:
    """What to hand the Trainer for `resume_from_checkpoint`, and lines to log. Raises ValueError for a checkpoint
    that cannot be resumed from, naming the one that can."""
    if resume_from_checkpoint is True:
        chosen, skipped = newest_complete(output_dir)
        if chosen is None:
            if not skipped:
                return True, []  # no checkpoint at all: the Trainer says so itself
            raise ValueError(
                f"`resume_from_checkpoint=True`: no complete checkpoint in {output_dir!r} "
                f"({'; '.join(f'{os.path.basename(p)}: {why}' for p, why in skipped)}); train from the start "
                f"(remove those directories), or pass a complete checkpoint's path"
            )
        name = os.path.basename(chosen)
        return chosen, [f"resume: skipping {os.path.basename(p)} ({why}); resuming from {name}" for p, why in skipped]
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
        why = why_incomplete(os.fspath(resume_from_checkpoint))
        if why is not None:
            parent = os.path.dirname(os.path.abspath(resume_from_checkpoint))
            chosen, _ = newest_complete(parent)
            instead = f"pass {chosen!r} instead" if chosen else "no complete checkpoint is beside it"
            raise ValueError(f"`resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r}`: {why}; {instead}")
    return resume_from_checkpoint, []
