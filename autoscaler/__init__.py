"""The autoscaler: scales prefill and decode workers separately from their heartbeats (docs/autoscaling.md)."""
