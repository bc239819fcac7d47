"""The secret in the webhook URL of the notification tests, which nothing may write down.

A token that tasks/core/redact.py would NOT mask (one case, no secret-like name): finding it nowhere
shows that nothing wrote the URL, not that a log filter hid it. Made when the tests start, so that
the copies of this file in test projects do not hold it.
"""

from __future__ import annotations

import secrets
from pathlib import Path

TOKEN, QUERY_SECRET = f"ls0notify0{secrets.token_hex(8)}", f"zz0{secrets.token_hex(4)}"
HOOK_PATH = f"/hooks/{TOKEN}/b1?code={QUERY_SECRET}"


def holds_token(path: Path) -> bool:
    data = path.read_bytes()
    return TOKEN.encode() in data or QUERY_SECRET.encode() in data


def in_text(text: str) -> bool:
    return TOKEN in text or QUERY_SECRET in text
