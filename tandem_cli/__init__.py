"""The ``tandem`` command: the top of the tree. It imports the libraries below it (launcher,
bench, sim, chaos, autoscaler); nothing imports it.

``launcher`` first: it switches grpcio's fork handlers off before grpc is imported (see its
docstring), which every command that starts processes needs.
"""

import launcher  # noqa: F401
