# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv if missing and install the project with its dev extras.
# torch: PyPI's build of the torch/torchvision pair lerobot 0.6.1 accepts (torch<2.12, torchvision<0.27); it runs on
# the CPU here and on a GPU where there is one. Another pair: `make install TORCH_SPEC='torch==X torchvision==Y'`.
# Python: lerobot needs >= 3.12, so the first interpreter new enough is used (pyenv's included).
# pip runs as .venv/bin/pip, never `python -m pip`: from the repository root the latter would
# import ./operator/ in place of the standard library module before the venv is set up.

VENV       ?= .venv
PYTHON     ?= $(shell for p in python3.13 python3.12 $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3; do \
                $$p -P -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
TORCH_SPEC ?= torch==2.11.0 torchvision==0.26.0
# the robots' client, for the tests: pinned numpy<2 in its metadata, lerobot needs numpy>=2 (pyproject.toml says more)
OPENPI_CLIENT ?= openpi-client==0.1.2
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help install demo demo-cluster test test-fast test-process lint format docs crd bench images clean cluster-binary cluster-up \
        cluster-down

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found (lerobot needs it): make PYTHON=/path/to/python3.12"; exit 2; }
	@test -x $(PY) || $(PYTHON) -P -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e ".[dev,lerobot]"
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps $(OPENPI_CLIENT)
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its dev extras

demo: install  ## serve a tiny checkpoint on 1 and 2 ranks and compare
	$(VENV)/bin/policyserver demo

demo-cluster: install  ## the operator on the real control plane, with a sample PolicyServer
	$(PY) -m tests.support.demo_cluster

test: install lint cluster-binary  ## lint, every test, then the unit and slow tiers with --frontend process (CI)
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-process

# The unit and slow tiers again with every server a test starts running its front-end in a process of its own
# (tests/support/servers.py reads POLICY_TEST_FRONTEND): the two modes answer alike, and nothing else runs them both.
test-process: install  ## the unit and slow tiers with --frontend process servers, about 11 minutes on 2 cores
	POLICY_TEST_FRONTEND=process $(PY) -m pytest -n auto -m "not cluster" $(PYTEST_ARGS)

# The unit tier: no multi-process (slow) and no control-plane (cluster) test.  README, "Tests", says which tier a
# change needs.
test-fast: install  ## the unit tier (neither slow nor cluster), a few minutes
	$(PY) -m pytest -n auto -m "not slow and not cluster" $(PYTEST_ARGS)

# `make lint` (a prerequisite of `make test`): ruff over the tree, the formatter's check over FORMATTED; mypy and
# import-linter (the layers contracts in pyproject.toml) over the package as it is imported (policy_operator.runtime
# is runtime/, policy_operator.operator is operator/), laid out as links in .cache/typecheck; mypy also checks the
# tests (tests/, linked there too, as the package `tests` they import themselves as).
TYPECHECK := .cache/typecheck
# FORMATTED: the paths `ruff format` keeps (the whole tree).
FORMATTED ?= .
lint: install  ## ruff (check; format --check over FORMATTED), mypy, import-linter
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check $(FORMATTED)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	cp -rs $(CURDIR)/policy_operator $(TYPECHECK)/policy_operator
	ln -s $(CURDIR)/runtime $(TYPECHECK)/policy_operator/runtime
	ln -s $(CURDIR)/operator $(TYPECHECK)/policy_operator/operator
	ln -s $(CURDIR)/tests $(TYPECHECK)/tests
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
	    --cache-dir $(CURDIR)/.cache/mypy -p policy_operator -p tests
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/lint-imports --no-logo --cache-dir $(CURDIR)/.cache/import-linter \
	    $(CURDIR)/pyproject.toml

format: install  ## ruff format over FORMATTED
	$(VENV)/bin/ruff format $(FORMATTED)

# The module tables of docs/architecture.md and docs/operator.md, from the modules' docstrings
# (tests/test_architecture_doc.py fails while they are stale).
docs: install  ## regenerate the docs' module tables from the docstrings
	$(PY) tools/architecture.py --write

help:  ## this list
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# The real control plane (etcd, kube-apiserver, controller-manager, scheduler, kubectl)
# is one Go binary built from tests/cluster/ into .cache/cluster/bin/, rebuilt only when
# tests/cluster/{go.mod,go.sum,main.go} change (docs/testing.md).
# Needs no venv (tests/support/control_plane.py builds with the standard library alone), so .ci/run starts it
# before the install and the two overlap; -P keeps ./operator/ from shadowing the standard library's module.
cluster-binary:  ## build the control plane binary (Go) into .cache/cluster/bin/
	$(PYTHON) -P -c 'import sys; sys.path.append("."); from tests.support.control_plane import main; sys.exit(main(["build"]))'

cluster-up: cluster-binary  ## start the control plane
	$(PY) -m tests.support.control_plane up

cluster-down:  ## stop it
	$(PY) -m tests.support.control_plane down

# crds/policyservers.yaml and the tables of docs/crd.md, generated from the model in operator/spec.py
# (tests/test_crd.py fails while they are stale).
crd: install  ## regenerate crds/ and the tables of docs/crd.md from operator/spec.py
	$(PY) -m policy_operator.operator.crd

bench: install  ## the runtime benchmark (bench/runtime.py)
	$(PY) bench/runtime.py

images:  ## build the runtime and operator images
	docker build -f runtime/Dockerfile -t policy-operator-runtime:dev .
	docker build -f operator/Dockerfile -t policy-operator:dev .

clean:  ## remove .venv and the caches
	rm -rf $(VENV) .cache .pytest_cache
