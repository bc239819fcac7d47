"""The one exception type for failures a user can act on (bad data, a failed download, a full disk,
an untrusted or corrupt file, another run holding the lock, a diverging training run).

Entry points print it as one line naming the file, URL or key (no traceback) and exit 1.
"""

from __future__ import annotations


class DataError(RuntimeError):
    """An expected failure: the message names the file or URL and what is wrong.

    Whatever raised it has left the previous outputs as they were.
    """
