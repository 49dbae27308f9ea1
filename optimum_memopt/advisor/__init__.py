"""Measured advice: which plans to enable, what they save and cost, and what batch size then fits.

Every figure comes from running the user's own training script in a fresh process (see `measure`);
`pipeline.advise` is the one path from probe to report.
"""

from .measure import MeasureCallback, Measurement, memory_flags, run_child
from .pipeline import Advice, advise, write_reports
from .probe import ProbeReport, ProbeRow, format_table, probe
from .select import Choice, NoFit, choose, max_batch_size, verify

__all__ = [
    "Advice",
    "Choice",
    "MeasureCallback",
    "Measurement",
    "NoFit",
    "ProbeReport",
    "ProbeRow",
    "advise",
    "choose",
    "format_table",
    "max_batch_size",
    "memory_flags",
    "probe",
    "run_child",
    "verify",
    "write_reports",
]
