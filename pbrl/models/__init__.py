"""Models: loading (local folders, packaged models, LoRA), placement on devices, precision, and the agents' policies."""
