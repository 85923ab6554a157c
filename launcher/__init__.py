"""The ``tandem`` command: start a local cluster, run a demo."""
