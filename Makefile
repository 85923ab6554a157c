# The two commands of the README. Both set everything up first (idempotent).
# demo and up pass ARGS on to tandem up: make up ARGS="--http-port 8001 --grpc-port 50051".
.PHONY: setup setup-test demo up test protos k8s-up k8s-node k8s-images k8s-release k8s-test k8s-status k8s-down

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

# The whole suite; --durations=30 lists its slowest 30 tests (what CI's time goes to). Two xdist
# workers: the model and cluster tests one after another in one, the rest in the other
# (tests/conftest.py); PYTEST_ARGS="-n 0" runs everything in one process.
test: setup-test
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n 2 $(PYTEST_ARGS)

protos: setup-test
	.venv/bin/python proto/generate.py

# A real single-node Kubernetes 1.20 on this machine, the images built here without a registry and
# the chart installed on it (root; docs/deploy.md#a-real-node-on-this-machine). Every step is
# idempotent. TANDEM_K8S_BINARIES=<tarball or folder of the 1.20 binaries> skips building them from
# Debian's source (~10 minutes); deploy/tools/k8s-local/lib.sh lists the other settings.
K8S_LOCAL := deploy/tools/k8s-local

k8s-up: k8s-release

k8s-node:
	$(K8S_LOCAL)/node.sh up

k8s-images: k8s-node
	$(K8S_LOCAL)/images.sh all

k8s-release: k8s-images
	$(K8S_LOCAL)/release.sh install

# The proofs on the real node (tests/k8s, marker k8s; skipped by `make test`).
k8s-test: setup-test
	TANDEM_K8S_TEST=1 .venv/bin/python -m pytest -q -p no:cacheprovider -m k8s tests/k8s $(PYTEST_ARGS)

k8s-status:
	$(K8S_LOCAL)/node.sh status

# Stops everything k8s-up started and checks the machine is as it was; ARGS=--purge also deletes
# the node's state (images, etcd, certificates, binaries).
k8s-down:
	$(K8S_LOCAL)/node.sh down $(ARGS)
