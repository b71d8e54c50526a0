"""Producing responses: seeded batched sampling, comparators (checkpoints, models, APIs), centralized collaboration."""
