"""Secrets never reach MLflow: what is logged (params, tags, text artifacts) is masked first.

Masked, wherever they appear in a logged string:
- the value of every environment variable whose name contains token, password, secret or key
  (API tokens, cloud keys, MLFLOW_TRACKING_PASSWORD...): a value can end up in a URL or a path;
- credentials in URLs (`https://user:pass@host` -> `https://***@host`) and URL query parameters
  named like a secret (`?token=...`, `&sig=...`);
- the whole value of a param or tag whose name contains one of those words.
"""

from __future__ import annotations

import os
import re
from typing import Any

MASK = "***"
SECRET_NAME = re.compile(r"token|passw|secret|key|credential", re.IGNORECASE)
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")
_SECRET_QUERY = re.compile(
    r"([?&][^=&#\s]*(?:token|passw|secret|key|sig|credential)[^=&#\s]*=)[^&#\s'\"]+", re.IGNORECASE
)
_MIN_SECRET_LENGTH = 6  # shorter values ("1", "true", "us-east") would mask ordinary text


def secret_values() -> list[str]:
    """Values of this process's environment variables with secret-looking names, longest first."""
    values = {
        value for name, value in os.environ.items() if SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_LENGTH
    }
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every secret masked."""
    for value in secret_values():
        text = text.replace(value, MASK)
    text = _USERINFO.sub(f"{MASK}@", text)
    return _SECRET_QUERY.sub(rf"\g<1>{MASK}", text)


def redact_mapping(values: dict[str, Any]) -> dict[str, str]:
    """Params or tags as MLflow stores them (strings), secrets masked."""
    return {key: MASK if SECRET_NAME.search(key) else redact(str(value)) for key, value in values.items()}
