"""Measure: what step one kept per layer (`profile`, `graph`) and where the step's memory went (`watch`).
Imports nothing of apply or decide."""
