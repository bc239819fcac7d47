"""Export's model registration (tasks/tracking/registry.py) in a helper process that a flow run starts
as it begins, so that MLflow's client has loaded by the time export needs it.

Everything else a flow run records goes into the project's sqlite store without MLflow's client
(tasks/tracking/sqlite_record.py); logging the models and registering one needs it: MLflow's flavours
write the models' files and rows, its registry numbers the versions. Its client costs a process ~3.5
CPU-seconds before its first call (`import mlflow` ~2.4 s, the first query of its SQLAlchemy stores
~1 s, on 2 cores), a tenth of a whole digits run, paid after export, when nothing else is left to do.
The flow starts this helper while it loads Prefect and torch itself, one core busy and the other idle on
2 cores; the helper loads MLflow there and waits. Export hands it the run and the shipped model and
waits for the verdict.

The helper logs into the export stage's own run, which the flow writes directly: resumed as MLflow's
active run (its flavours log into the active run and take no run id), and ended FINISHED before the
helper answers; the flow then ends it with the stage's outcome. A failure in the helper is raised in the
flow as one line (a bug's traceback goes to stderr first). Where no helper runs (a stage process of `dvc
repro`, a tracking server, an experiment MLflow has not made yet), export registers in its own process.

    python -m tasks.tracking.registrar   # the helper: one request on stdin, one answer on stdout
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import IO, Any

from tasks.core.cli import configure_logging
from tasks.core.config.params import Params
from tasks.core.config.service import TrackingConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.layout import project_root
from tasks.core.processes import die_with_parent
from tasks.determinism.bootstrap import prepare
from tasks.tracking import registry, sqlite_record
from tasks.tracking.registry import Shipped, register_shipped
from tasks.tracking.store import tracking_uri
from tasks.tracking.writers import ClientWriter, StageRun

log = logging.getLogger(__name__)

MAX_ANSWER = 1 << 20  # bytes of the helper's one-line answer read at most
EXIT_WAIT_S = 10.0  # for a helper that has answered to end by itself (its exit handlers), before it is killed


class RegistrationFailed(ExpectedFailure):
    """The helper could not register the model: its one line, with the exit code it would have given."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Registrar:
    """The helper process: started loading MLflow's client, then given one model to register."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=project_root(),
            text=True,
            # Ctrl-C at the terminal reaches the flow, which stops the helper (`helping`), not the helper in
            # the middle of its imports; and the helper ends when the flow does, even if SIGKILLed
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._answered = False

    def register(self, params: Params, run_id: str, shipped: Shipped) -> str:
        """The promotion verdict for `shipped`, registered under the export run `run_id`; raises what failed."""
        request = {"params": params.model_dump(mode="json"), "run_id": run_id, "shipped": asdict(shipped)}
        stdin, stdout = self._pipes()
        self._answered = True  # (or gone: nothing more is asked of it)
        try:
            stdin.write(json.dumps(request) + "\n")
            stdin.close()
        except BrokenPipeError:
            pass  # it ended before the request: said below, with its exit code
        line = stdout.readline(MAX_ANSWER)
        if not line:
            self.stop()
            raise RegistrationFailed(
                f"the model registration's helper process ({__name__}) exited with code "
                f"{self._process.returncode} without an answer (its output is above)"
            )
        answer = json.loads(line)
        if "verdict" in answer:
            return str(answer["verdict"])
        raise RegistrationFailed(str(answer["error"]), int(answer.get("exit_code", 1)))

    def stop(self) -> None:
        """End the helper: it ends by itself once it has answered; one that has not answered has no more work."""
        try:
            self._process.wait(timeout=EXIT_WAIT_S if self._answered else 0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self._process.stdin is not None and self._process.stdout is not None  # (both are pipes)
        return self._process.stdin, self._process.stdout


_helper: Registrar | None = None


@contextmanager
def helping(cfg: TrackingConfig) -> Iterator[None]:
    """A helper started for the block (where export's run is written directly: `usable`), unless one is
    there already; stopped at its end if export has not used it."""
    global _helper
    if _helper is not None or not usable(cfg):
        yield
        return
    helper = _helper = Registrar()
    try:
        yield
    finally:
        if _helper is helper:
            _helper = None
        helper.stop()


def usable(cfg: TrackingConfig) -> bool:
    """Whether a helper would take export's registration off this process: tracking on, into the project's
    own sqlite store where the runs are written directly (sqlite_record.py says when they are)."""
    return cfg.enabled and sqlite_record.experiment_id(tracking_uri(), cfg.experiment) is not None


def helped() -> bool:
    """Whether a helper is there for this process's export (then its run is written directly)."""
    return _helper is not None


def register(params: Params, run: StageRun, shipped: Shipped) -> str:
    """Register `shipped` under export's `run`: through the helper if one is there (it registers one model,
    then ends), else here."""
    global _helper
    helper, _helper = _helper, None
    if helper is None or run.run_id is None:
        return register_shipped(params, run, shipped)
    return helper.register(params, run.run_id, shipped)  # (`helping` waits for it to end)


def main() -> int:
    """The helper: MLflow's client loaded and its stores opened, then one request answered."""
    prepare()  # the flow's CPU mode is in the environment: before numpy loads
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the answer's channel; anything printed goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    configure_logging()
    logging.getLogger(registry.__name__).setLevel(logging.WARNING)  # the flow reports the verdict itself
    mlflow = _loaded()
    line = sys.stdin.readline()
    if not line:  # the flow ended without registering
        return 0
    try:
        request = json.loads(line)
        params = Params.model_validate(request["params"])
        shipped = Shipped.from_dict(request["shipped"])
        run = StageRun(ClientWriter(mlflow), str(request["run_id"]))
        with mlflow.start_run(run_id=run.run_id):  # export's run: its flavours log into it
            reply: dict[str, Any] = {"verdict": register_shipped(params, run, shipped)}
            run.flush()  # the metrics it has not written yet (StageRun writes them at most every second)
    except ExpectedFailure as exc:
        reply = {"error": str(exc), "exit_code": int(exc.exit_code)}
    except Exception as exc:
        log.exception("registering the model failed")
        reply = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}", "exit_code": 1}
    answer.write(json.dumps(reply) + "\n")
    answer.flush()
    return 0


def _loaded() -> Any:
    """MLflow, pointed at the store, with what registering loads and its registry store's first query made."""
    # heavy: what register_shipped loads (~3.5 s with MLflow): what this process is for, before the request
    import mlflow.onnx  # noqa: F401
    import mlflow.pyfunc  # noqa: F401
    import onnxruntime  # noqa: F401
    import pandas  # noqa: F401

    import tasks.data.preprocess  # noqa: F401
    import tasks.ship.promotion  # noqa: F401
    from tasks.tracking.store import mlflow_module

    mlflow = mlflow_module()
    mlflow.MlflowClient().search_registered_models(max_results=1)  # SQLAlchemy's mappings set up (~1 s)
    return mlflow


if __name__ == "__main__":
    sys.exit(main())
