"""What every command-line entry point shares: logging, and failures as one line and an exit code.

Every entry point prints an invalid params.yaml or argument (exit 2), a refusal (3), missing hardware
(4) and any other expected failure (1) as one line naming the file, URL or key (the table:
tasks/core/errors.py ExitCode); anything else is a bug and keeps its traceback. Every line
they print or log passes tasks/core/redact.py first.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from tasks.core.atomic import WRITE_ERRNOS
from tasks.core.config.base import ConfigError
from tasks.core.errors import ExitCode, ExpectedFailure
from tasks.core.redact import escape_controls, redact
from tasks.core.redact import install as install_redaction


def configure_logging(fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Our progress at INFO; libraries (ONNX Runtime, onnxscript, ...) only when they warn. Secrets masked."""
    install_redaction()
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format=fmt)
    logging.getLogger("tasks").setLevel(logging.INFO)


def quiet_libraries() -> None:
    """Library messages that say nothing to the person running the pipeline, silenced (before the
    libraries load). What stays: their warnings and errors about the user's data, params and servers."""
    # MLflow's INFO lines: its database migrations, "Detected uv project", "View run ... at"
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # "Failed to resolve installed pip version": a uv environment has no pip, and every model is
    # logged with explicit requirements (tasks/runner.py), so the conda.yaml it is about is unused
    logging.getLogger("mlflow.utils.environment").setLevel(logging.ERROR)
    # torchao registers an Enum with torch's pytree on import, which torch now calls deprecated:
    # a note to torchao's developers, printed on every run that quantizes
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def dvc_logs_once() -> None:
    """DVC used in this process: its messages printed once, and only its warnings and errors.

    DVC puts its own console handlers on its loggers when imported, and its records also reach the
    root logger's (Prefect's console, `logging.basicConfig`'s): each line came out twice. Its INFO lines
    ("Updating lock file", "To track the changes with git, run: git add data.dvc") repeat what our own
    stage log and closing summary say.
    """
    import dvc  # noqa: F401 - sets up its handlers

    for name in ("dvc", "dvc_data", "dvc_objects"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


def exit_code(body: Callable[[], int], context: str = "") -> int:
    """Run `body` (an entry point's work, returning its exit code); an expected failure becomes one
    line on stderr, prefixed with `context`, and its exit code."""
    install_redaction()  # tracebacks of bugs too
    try:
        return body()
    except ConfigError as exc:  # raised before anything was written
        _error(str(exc))
        return exc.exit_code
    except ExpectedFailure as exc:
        _error(f"{context}{exc}")
        return exc.exit_code
    except OSError as exc:  # a full disk met outside our own writes (DVC's, MLflow's): still one line
        if exc.errno not in WRITE_ERRNOS:
            raise
        _error(f"{context}{exc.filename or 'a write'} failed: {exc.strerror}")
        return ExitCode.FAILED


def one_line(message: str) -> str:
    """`message` masked and on one line: a value with a newline (a file name, a run record's tag, an
    HTTP reason phrase) must not forge a second line, nor an escape sequence rewrite the terminal."""
    return escape_controls(redact(message))


def _error(message: str) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr)
