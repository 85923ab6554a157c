"""The ``tandem`` command: start a local cluster, run a demo.

The launcher spawns services with ``subprocess.Popen`` from a process that also talks gRPC (health
checks). grpcio's fork handlers then run in the child between ``fork`` and ``exec``; with
``close_fds`` they find gRPC's epoll descriptor closed and abort the child before it execs
("epoll_wait error: Bad file descriptor", exit -6; grpc/grpc#43055). The launcher only forks to
exec, so it needs no fork support: turn it off before grpc is first imported (a value the user
set wins).
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
