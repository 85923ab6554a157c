# The two commands of the README. Both set everything up first (idempotent).
# demo and up pass ARGS on to tandem up: make up ARGS="--http-port 8001 --grpc-port 50051".
.PHONY: setup demo up test protos

setup:
	@bash scripts/setup.sh

# The main job: a local cluster (Redis, KV pool, prefill worker, decode worker, router) answering
# real prompts with the real model, then stopping.
demo: setup
	.venv/bin/tandem up --demo $(ARGS)

# Serve until Ctrl-C.
up: setup
	.venv/bin/tandem up $(ARGS)

# The whole suite; --durations=30 lists its slowest 30 tests (what CI's time goes to).
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_ARGS)

protos: setup
	.venv/bin/python proto/generate.py
