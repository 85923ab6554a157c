"""Tandem's benchmark: real-trace load generation, goodput, roofline and plots (torch-free)."""
