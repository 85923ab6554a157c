"""``tandem chaos``: fault campaigns on a local cluster (docs/failover.md)."""
