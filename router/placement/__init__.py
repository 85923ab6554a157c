"""Where a request runs: the Placer, routing policies, prediction, admission, bookkeeping, prefix view."""
