# lockstep — the two commands a new user needs are `make run` and `make test`.
# Only Python 3.11 and make are assumed; everything else comes from uv.lock into .venv/.

PYTHON ?= python3.11
UV_VERSION := 0.13.8
UV := .uv/bin/uv
VENV := .venv
STAMP := $(VENV)/.synced
export UV_PYTHON_DOWNLOADS := never
# Precompiled .pyc for every package: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# Python would otherwise recompile torch, MLflow and Prefect from source in every process (~3-5 s each).
export UV_COMPILE_BYTECODE := 1
export UV_PROJECT_ENVIRONMENT := $(VENV)
# so that `dvc repro` stage commands (`python -m tasks ...`) find the environment's python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test test-all lint bench gpu-check sweep repro plots predict serve ui mlflow-server stack stack-down stack-join reproduce mark-orphans env clean

# Servers listen on the loopback interface only, unless asked otherwise (e.g. `make mlflow-server
# MLFLOW_HOST=0.0.0.0` behind a firewall or a reverse proxy with authentication).
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_PORT ?= 5000
PREFECT_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200

run: $(STAMP)  ## run the whole pipeline (Prefect flow, local ephemeral mode) on the default dataset
	$(VENV)/bin/python -m flows.pipeline

# Tests run in a new random order each time (pytest-randomly; it prints the seed to repeat one with
# `-p randomly -p "randomly_seed=N"`), so a test that leans on another's leftovers fails. Two xdist
# workers, each taking whole modules (their fixtures are built once), longest first
# (tests/conftest.py): most tests spend their time in one single-threaded subprocess, which leaves
# the second core idle.
PYTEST := $(VENV)/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder
test: $(STAMP)  ## the fast tier, after each change (a few minutes): everything not marked slow
	$(PYTEST) -m "not slow"

test-all: $(STAMP)  ## every test: end-to-end pipelines, servers, faults (what CI runs)
	$(PYTEST)

lint: $(STAMP)  ## ruff: lint and formatting (what CI checks)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)  ## benchmarks vs the usual recipes: table + benchmarks/results/bench.json (minutes)
	$(VENV)/bin/python -m benchmarks

# On a bare CUDA machine without the venv, run `python -m tasks.gpu_check` itself (README "GPU check").
ARGS ?=
gpu-check: $(STAMP)  ## determinism, strict mode, cost of pinning, compress/export on the GPU: table + artifacts/gpu-check.json (no GPU: ARGS="--device cpu")
	$(VENV)/bin/python -m tasks.gpu_check $(ARGS)

# e.g. `make sweep ARGS=--apply` (the best trial's params into params.yaml), `ARGS="--address tcp://host:8786"`
sweep: $(STAMP)  ## hyperparameter search: params.yaml's sweep section, Optuna trials as Prefect tasks on Dask (README "Sweeps")
	$(VENV)/bin/python -m flows.sweep $(ARGS)

repro: $(STAMP)  ## the same pipeline through DVC (fetches data/ first on a fresh clone)
	test -d data || $(VENV)/bin/dvc repro download
	$(VENV)/bin/dvc repro

# One self-contained page that draws offline (Vega inlined: .dvc/plots/vendor/); compare runs with
# `dvc plots diff <rev or experiment> <rev or experiment>`, which writes the same page.
plots: $(STAMP)  ## DVC plots (accuracy, loss, lr, confusion matrix) of the outputs in artifacts/: dvc_plots/index.html
	$(VENV)/bin/dvc plots show
	@echo "open it in a browser: $(CURDIR)/dvc_plots/index.html (no network needed)"

# Runs started through the API may not override keys that reach the network or other machines
# (tasks/config.py REMOTE_KEYS) unless listed here, e.g. `make serve ALLOW_OVERRIDES="data.url data.sha256"`.
ALLOW_OVERRIDES ?=
serve: $(STAMP)  ## Prefect server on http://127.0.0.1:4200 (auth string in .prefect/api-auth) + the deployment 'lockstep-pipeline/nightly'
	$(VENV)/bin/python -m flows.deployments serve --host $(PREFECT_HOST) --port $(PREFECT_PORT) \
		$(foreach key,$(ALLOW_OVERRIDES),--allow-override $(key))

ui: $(STAMP)  ## MLflow UI on the results: http://127.0.0.1:5000
	MLFLOW_DISABLE_TELEMETRY=true $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db \
		--host $(MLFLOW_HOST) --port $(MLFLOW_PORT)

# A tracking server for several users or machines: runs and the registry in a database, artifacts
# served by the server itself (point MLFLOW_TRACKING_URI=http://<host>:5000 at it). Swap the
# sqlite URI for postgresql://... and the folder for s3://... in production (README).
MLFLOW_BACKEND ?= sqlite:///$(CURDIR)/mlflow-server.db
MLFLOW_ARTIFACTS ?= $(CURDIR)/mlflow-server-artifacts
# For a server others reach (MLFLOW_HOST=0.0.0.0): MLFLOW_AUTH_CONFIG=auth.ini turns on MLflow's
# basic-auth app (users, passwords and permissions; README "MLflow tracking server"; it also needs
# MLFLOW_FLASK_SERVER_SECRET_KEY in the environment), and MLFLOW_ALLOWED_HOSTS lists the Host headers
# it answers (DNS rebinding), e.g. mlflow.internal:5000.
MLFLOW_AUTH_CONFIG ?=
MLFLOW_ALLOWED_HOSTS ?=
mlflow-server: $(STAMP)  ## MLflow tracking server (database + artifact store) on http://127.0.0.1:5000
	$(if $(MLFLOW_AUTH_CONFIG),MLFLOW_AUTH_CONFIG_PATH=$(abspath $(MLFLOW_AUTH_CONFIG))) \
	MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow server \
		--backend-store-uri $(MLFLOW_BACKEND) --artifacts-destination $(MLFLOW_ARTIFACTS) \
		--host $(MLFLOW_HOST) --port $(MLFLOW_PORT) \
		$(if $(MLFLOW_AUTH_CONFIG),--app-name basic-auth) $(if $(MLFLOW_ALLOWED_HOSTS),--allowed-hosts $(MLFLOW_ALLOWED_HOSTS))

# The team's servers on this machine (stack/): PostgreSQL, SeaweedFS's S3, an MLflow server on both and a
# Prefect server on PostgreSQL, state in .stack/ (README "Running it for a team"). Then `source .stack/env`.
# STACK_HOST=0.0.0.0 on first use lets other machines in (behind a firewall: the servers check credentials).
STACK_HOST ?=
stack: $(STAMP)  ## start the team stack (made on first use), print the environment to source; its DVC remote becomes the default
	$(VENV)/bin/python -m stack up $(if $(STACK_HOST),--host $(STACK_HOST))

stack-down: $(STAMP)  ## stop the team stack (its data stays in .stack/)
	$(VENV)/bin/python -m stack down

stack-join: $(STAMP)  ## in another clone of the project: use the running stack's DVC remote (LOCKSTEP_STACK_DIR)
	$(VENV)/bin/python -m stack join

predict: $(STAMP)  ## score images with the registry's champion: make predict ARGS="photos/ [--version N] [--out f.csv]"
	$(VENV)/bin/python -m tasks.predict $(ARGS)

reproduce: $(STAMP)  ## re-run a past run's training and compare weights: make reproduce RUN=<mlflow run id>
	@test -n "$(RUN)" || { echo "usage: make reproduce RUN=<mlflow run id>" >&2; exit 2; }
	$(VENV)/bin/python -m tasks.reproduce $(RUN)

# Runs left RUNNING by a killed flow or stage are marked KILLED by the next pipeline run anyway; this
# does it now, over every experiment (tasks/orphans.py), e.g. `make mark-orphans ARGS="--dry-run"` or
# ARGS="--older-than 7d" for runs it cannot check from here (another host, an older lockstep's).
mark-orphans: $(STAMP)  ## mark KILLED (with the reason) the MLflow runs whose process is gone
	$(VENV)/bin/python -m tasks.orphans $(ARGS)

env: $(STAMP)  ## create or update .venv from uv.lock

# uv itself is bootstrapped into its own small venv, pinned, so nothing global is needed.
$(UV):
	$(PYTHON) -m venv .uv
	.uv/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP): pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --python $(PYTHON)
	touch $@

clean:  ## remove pipeline outputs and local tracking state (keeps .venv and data/)
	rm -rf artifacts mlflow.db mlartifacts .prefect mlflow-server.db mlflow-server-artifacts
