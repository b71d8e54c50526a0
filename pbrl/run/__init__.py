"""A run folder's life: creating and opening it, preflight checks, each stage's record (manifest), export and
progress events."""
