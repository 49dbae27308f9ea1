"""The budget solver: from a step-one `ModelProfile` and a memory budget, the `RecomputePolicy` that fits with the
least recompute time. Empty until the budget issue lands it (an exact choice over layers x candidate policies);
kept here so that the module layout it lands in exists and stays pure (no torch state)."""
