"""Decide: what any policy would do to the step (the what-if model over step one's figures), the solver, the
budget, the planner that runs `auto`, and the plan table. Imports measure, never apply: it runs no layer."""
