"""Parallelism applied from outside the model: meshes, FSDP2 units, loading (import the submodules)."""
