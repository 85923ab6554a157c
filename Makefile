# The two commands of the README. Both set everything up first (idempotent).
# demo and up pass ARGS on to tandem up: make up ARGS="--http-port 8001 --grpc-port 50051".
.PHONY: setup setup-test demo up test protos

# What tandem up needs (torch's CUDA build where an NVIDIA GPU answers, else its CPU build).
setup:
	@bash scripts/setup.sh

# ... and what the tests need (the dev, ray, gpu and nixl extras).
setup-test:
	@bash scripts/setup.sh --test

# The main job: a local cluster (Redis, KV pool, prefill worker, decode worker, router) answering
# real prompts with the real model, then stopping.
demo: setup
	.venv/bin/tandem up --demo $(ARGS)

# Serve until Ctrl-C.
up: setup
	.venv/bin/tandem up $(ARGS)

test: setup-test
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

protos: setup-test
	.venv/bin/python proto/generate.py
