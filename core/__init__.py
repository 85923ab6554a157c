"""Torch-free vocabulary shared by every Tandem service (docs/design.md §3)."""
