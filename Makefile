# The two commands of the README. Both set everything up first (idempotent).
.PHONY: setup demo up test protos

setup:
	@bash scripts/setup.sh

# The main job: a local cluster (Redis, KV pool, prefill worker, decode worker, router) answering
# real prompts with the real model, then stopping.
demo: setup
	.venv/bin/tandem up --demo

# Serve until Ctrl-C.
up: setup
	.venv/bin/tandem up

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

protos: setup
	.venv/bin/python proto/generate.py
