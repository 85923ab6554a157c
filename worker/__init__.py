"""The worker process both ``prefill_worker`` and ``decode_worker`` run: its settings
(:mod:`.config`), command line (:mod:`.cli`), serve loop (:mod:`.runtime`: model load and
calibration on the engine thread, gRPC server, Redis heartbeat, drain on SIGTERM), the load it
publishes (:mod:`.stats`) and its Prometheus metrics (:mod:`.metrics`). The step loop and the
model are ``engine``'s; the RPCs are the two worker packages' servicers."""
