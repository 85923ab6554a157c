"""Torch-free vocabulary shared by every Tandem service (DESIGN.md §3)."""
