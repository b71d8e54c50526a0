"""A run folder's life: creating and opening it, preflight checks, each stage's record (manifest), a round's policy
checkpoint and the MARLHF parts update-policies builds, export and progress events; the Python trainers' arguments
and model objects, turned into a run's config."""
