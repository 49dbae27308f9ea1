"""Measured advice: which plans to enable, what they save and cost, and what batch size then fits.

Every figure comes from running the user's own training script in a fresh process (see `measure`).
"""

from .measure import MeasureCallback, Measurement, memory_flags, run_child
from .probe import ProbeReport, format_table, probe, write_reports
from .select import Choice, NoFit, choose, max_batch_size, verify

__all__ = ["Choice", "MeasureCallback", "Measurement", "NoFit", "ProbeReport", "choose", "format_table",
           "max_batch_size", "memory_flags", "probe", "run_child", "verify", "write_reports"]
