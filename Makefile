# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv if missing and install the project with its dev extras.
# CPU path (default): torch==2.13.0, a CPU wheel on this machine's disk.
# CUDA path: `make install TORCH_SPEC='torch'` (or use the image's torch) -- see docs/install.md.
# pip runs as .venv/bin/pip, never `python -m pip`: from the repository root the latter would
# import ./operator/ in place of the standard library module before the venv is set up.

VENV       ?= .venv
PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo demo-cluster test lint crd bench images clean cluster-binary cluster-up cluster-down

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/policyserver demo

demo-cluster: install
	$(PY) -m tests.support.demo_cluster

test: install lint cluster-binary
	$(PY) -m pytest $(PYTEST_ARGS)

# `make lint` (a prerequisite of `make test`): ruff over the tree; mypy over the package as it is imported (policy_operator.runtime is runtime/,
# policy_operator.operator is operator/), laid out as links in .cache/typecheck.
TYPECHECK := .cache/typecheck
lint: install
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	cp -rs $(CURDIR)/policy_operator $(TYPECHECK)/policy_operator
	ln -s $(CURDIR)/runtime $(TYPECHECK)/policy_operator/runtime
	ln -s $(CURDIR)/operator $(TYPECHECK)/policy_operator/operator
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
	    --cache-dir $(CURDIR)/.cache/mypy -p policy_operator

# The real control plane (etcd, kube-apiserver, controller-manager, scheduler, kubectl)
# is one Go binary built from tests/cluster/ into .cache/cluster/bin/, rebuilt only when
# tests/cluster/{go.mod,go.sum,main.go} change (docs/testing.md).
cluster-binary: install
	$(PY) -m tests.support.control_plane build

cluster-up: cluster-binary
	$(PY) -m tests.support.control_plane up

cluster-down:
	$(PY) -m tests.support.control_plane down

# crds/policyservers.yaml and the tables of docs/crd.md, generated from the model in operator/spec.py
# (tests/test_crd.py fails while they are stale).
crd: install
	$(PY) -m policy_operator.operator.crd

bench: install
	$(PY) bench/runtime.py

images:
	docker build -f runtime/Dockerfile -t policy-operator-runtime:dev .
	docker build -f operator/Dockerfile -t policy-operator:dev .

clean:
	rm -rf $(VENV) .cache .pytest_cache
