"""The planner: memory per rank in each phase of a step, and a step-time estimate, before launch (docs/planner.md)."""
