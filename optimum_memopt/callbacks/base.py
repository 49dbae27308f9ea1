"""What the plugin's callbacks share: a buffer of numeric metrics that `MemoptTrainerMixin.log` merges
into the trainer's logs (so every reporter sees them), and report files that never stop training."""

import contextlib
import csv
import logging
import os
from typing import Callable, Dict, List, Optional, Sequence

from transformers import TrainerCallback

logger = logging.getLogger("optimum_memopt")


class MetricsCallback(TrainerCallback):
    def __init__(self):
        self._pending: Dict[str, float] = {}
        self._write_failures = set()

    def pop_metrics(self) -> Dict[str, float]:
        out, self._pending = self._pending, {}
        return out

    def write_report(self, path: str, write: Callable[[str], None]) -> bool:
        """Run ``write(path)``; a failure (full disk, a directory in the way) is logged once per file and
        training goes on. Returns whether it worked."""
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write(path)
            return True
        except Exception as e:  # a report must never cost the run
            if path not in self._write_failures:
                self._write_failures.add(path)
                logger.error(
                    "could not write %s (%s: %s); training goes on without this report", path, type(e).__name__, e
                )
            return False


class CsvReport:
    """A CSV file a run adds rows to, which is whole or absent: the header first, then every row since the run began
    (on resume from step N, the rows of the steps before N that the interrupted run wrote, then this run's).

    Its rows are kept, so a write that fails (a full disk) never leaves an empty or half-written file: the file is
    removed and that is said; at each later write it is written whole again, through a temporary file, and once that
    works it is said too. A run that ends with it absent says so."""

    def __init__(self, owner: MetricsCallback, path: str, header: Sequence[str]):
        self.owner, self.path, self.header = owner, path, list(header)
        self.rows: List[List[str]] = []
        self.whole = False  # the file holds the header and every row
        self.failed: Optional[str] = None  # why the file is absent, since the write that failed

    def start(self, resume_step: int) -> None:
        kept: List[List[str]] = []
        if resume_step > 0 and os.path.exists(self.path):
            try:
                with open(self.path, newline="") as f:
                    rows = list(csv.reader(f))
            except (OSError, UnicodeDecodeError, csv.Error) as e:
                logger.warning("could not read %s to continue it (%s); it starts anew", self.path, e)
                rows = []
            if rows and rows[0] == self.header:
                kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < resume_step]
        self.rows = kept
        self._write_whole()

    def append(self, rows: Sequence[Sequence]) -> None:
        new = [[_cell(v) for v in r] for r in rows]
        self.rows.extend(new)
        if not self.whole:
            self._write_whole()
            return
        try:
            with open(self.path, "a", newline="") as f:
                csv.writer(f).writerows(new)
        except Exception as e:  # a report must never cost the run
            self._lost(e)

    def finish(self) -> None:
        """At the end of training: one more try where the file is absent, and a word if it stays absent."""
        if not self.whole:
            self._write_whole()
        if not self.whole:
            logger.error(
                "%s is absent: it could not be written since %s (%d rows not written)",
                self.path,
                self.failed,
                len(self.rows),
            )

    def _write_whole(self) -> None:
        def write(path):
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(self.header)
                w.writerows(self.rows)

        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            atomic_write(self.path, write)
        except Exception as e:
            self._lost(e)
            return
        self.whole = True
        if self.failed is not None:
            logger.warning(
                "%s is written whole again (the header and its %d rows) after it could not be written (%s)",
                self.path,
                len(self.rows),
                self.failed,
            )
            self.failed = None

    def _lost(self, error: Exception) -> None:
        """A write failed: the file may be cut short, so it goes (a stale one from an earlier run too)."""
        self.whole = False
        if os.path.isfile(self.path):
            with contextlib.suppress(OSError):
                os.remove(self.path)
        if self.failed is None:
            self.failed = f"{type(error).__name__}: {error}"
            logger.error(
                "could not write %s (%s); %s, and it is written whole (header and every row) once a write "
                "works again; training goes on",
                self.path,
                self.failed,
                "the file could not be removed either"
                if os.path.isfile(self.path)
                else "no file is left there, rather than one cut short",
            )


def _cell(value) -> str:
    """A value as `csv.writer` writes it (None as an empty cell)."""
    return "" if value is None else str(value)


def _shown(level: int) -> bool:
    """Whether a record of `level` from the plugin's logger reaches a handler (Python's last-resort handler, which
    shows warnings when no handler is set up, does not count: it drops INFO)."""
    if not logger.isEnabledFor(level):
        return False
    current = logger
    while current is not None:
        if any(h.level <= level for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def show(text: str) -> None:
    """A table the user should see, from rank 0 (callers run there only): logged at INFO where a handler shows INFO
    (scripts written like transformers' examples, with `--log_level info`), else printed to stdout, the way the
    Trainer prints its own progress, so a script that set up no logging (TRL's `sft.py`) still shows it."""
    if _shown(logging.INFO):
        logger.info("%s", text)
    else:
        print(text, flush=True)


def verbose() -> bool:
    """Whether the plugin's DEBUG records are shown (`--log_level debug`): the full plan table and the solver's
    figures in words are logged then, not only written to a file. (INFO is not verbose: transformers' example
    scripts show INFO by default.)"""
    return _shown(logging.DEBUG)


class PlanLog:
    """What a run says of its plans, on rank 0: a few lines by default (`say`: what runs, the predicted and measured
    peak against the budget, where the step peaks), and the rest (`detail`: the plan table and its notes, the
    solver's figures in words) in `<output_dir>/memory_plans.txt`, and in the log too at `--log_level debug`. Each
    `train()` starts the file anew (`start`); a write that fails is said once and training goes on."""

    FILE = "memory_plans.txt"

    def __init__(self, output_dir: Optional[str]):
        self.path = os.path.join(output_dir, self.FILE) if output_dir else None
        self._fresh = True  # the next write starts the file anew
        self._failed = False

    def start(self) -> None:
        self._fresh = True

    def say(self, text: str) -> None:
        show(text)
        self._keep(text)

    def detail(self, text: str) -> None:
        logger.debug("%s", text)
        self._keep(text)

    def pointer(self) -> str:
        """Where the rest is, said after the short lines ('' where it is already shown here and kept nowhere)."""
        shown = "shown above" if verbose() else "in the log too with `--log_level debug`"
        if self.path is None:
            return "" if verbose() else f"the rest is {shown}"
        if self._failed:
            return f"the rest is {shown} ({self.path} could not be written)"
        return f"the rest in {self.path} ({shown})"

    def _keep(self, text: str) -> None:
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "w" if self._fresh else "a", encoding="utf-8") as f:
                f.write(text.rstrip("\n") + "\n\n")
            self._fresh = False
        except OSError as e:  # a report must never cost the run
            if not self._failed:
                self._failed = True
                logger.error("could not write %s (%s); training goes on without it", self.path, e)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write`` to a temporary file beside `path`, then move it into place: a failure (a full disk) leaves no
    empty or half-written report behind, and the temporary file is removed."""
    tmp = f"{path}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def current_model(trainer, model):
    """The model being trained: the trainer's own when the callback knows the trainer (transformers 4.49 hands
    callbacks the model given at `__init__`, not the wrapped one), else the `model` the event passed."""
    return trainer.model if trainer is not None and getattr(trainer, "model", None) is not None else model


def hookable(trainer, model) -> Optional[object]:
    """The module whose forward runs once per training micro-batch: the backend's wrapper, or the plain model
    (DDP / DeepSpeed wrappers call it from their own forward)."""
    model = current_model(trainer, model)
    if trainer is not None and trainer.memopt_backend is not None:
        found = trainer.memopt_backend.find(model)
        if found is not None:
            return found
    if trainer is not None:
        return trainer.plain_model
    for _ in range(8):
        inner = getattr(model, "module", None)
        if inner is None:
            return model
        model = inner
    return model
