"""Trailing-metadata keys a worker sets on a gRPC error that is the request's or the pool's
fault, not the worker's, so the router neither marks the worker down nor retries it as broken.

    KV_LOAD_FAILURE_KEY  the worker's KV load from the pool failed under --kv-load-failure-policy
                         fail (value: the reason, engine.kv_connector.load_failure): the request's
                         503 kv_load_failed
    KV_SAVE_FAILURE_KEY  a prefill worker could not write the prompt's KV to the pool (value:
                         pool_write_failed): the router prefills on the decode worker instead
"""

KV_LOAD_FAILURE_KEY = "tandem-kv-load-failure"
KV_SAVE_FAILURE_KEY = "tandem-kv-save-failure"
