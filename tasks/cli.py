"""What every command-line entry point shares: logging, and failures as one line and an exit code.

`python -m tasks <stage>`, `python -m flows.pipeline`, `python -m flows.deployments` and
`python -m tasks.reproduce` print an invalid params.yaml (exit 2) and an expected failure (exit 1)
as one line naming the file, URL or key; anything else is a bug and keeps its traceback. Every line
they print or log passes tasks/redact.py first.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from tasks.atomic import WRITE_ERRNOS
from tasks.config import ConfigError
from tasks.errors import ExpectedFailure
from tasks.redact import install as install_redaction
from tasks.redact import redact

EXIT_FAILED, EXIT_BAD_PARAMS = 1, 2


def configure_logging(fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Our progress at INFO; libraries (ONNX Runtime, onnxscript, ...) only when they warn. Secrets masked."""
    install_redaction()
    logging.basicConfig(level=logging.WARNING, format=fmt)
    logging.getLogger("tasks").setLevel(logging.INFO)


def exit_code(body: Callable[[], int], context: str = "") -> int:
    """Run `body` (an entry point's work, returning its exit code); an expected failure becomes one
    line on stderr, prefixed with `context`, and its exit code."""
    install_redaction()  # tracebacks of bugs too
    try:
        return body()
    except ConfigError as exc:  # raised before anything was written
        _error(str(exc))
        return EXIT_BAD_PARAMS
    except ExpectedFailure as exc:
        _error(f"{context}{exc}")
        return EXIT_FAILED
    except OSError as exc:  # a full disk met outside our own writes (DVC's, MLflow's): still one line
        if exc.errno not in WRITE_ERRNOS:
            raise
        _error(f"{context}{exc.filename or 'a write'} failed: {exc.strerror}")
        return EXIT_FAILED


def one_line(message: str) -> str:
    """`message` masked and on one line: a value with a newline (a file name, a run record's tag)
    must not forge a second line."""
    return redact(message).replace("\n", "\\n").replace("\r", "\\r")


def _error(message: str) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr)
