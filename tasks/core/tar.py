"""`tarfile` with PEP 706's extraction filters on every Python 3.11 the project admits.

`extractall(..., filter="data")` (refuse absolute paths, `..`, links out of the folder, devices; strip
setuid modes) arrived in Python 3.11.4. Debian 12's python3.11 is 3.11.2 (the Python of many arm64
servers, and of the emulated arm64 machine, tests/support/arm64.py), where the keyword is a TypeError. There
the standard library's own module, backported by `backports.tarfile` (a dependency on those versions
only), gives the same filters: the archives we open from outside are checked by CPython's code, not ours.
"""

from __future__ import annotations

import tarfile as _stdlib

if hasattr(_stdlib, "data_filter"):
    tarfile = _stdlib
else:  # pragma: no cover - Python 3.11.0-3.11.3
    from backports import tarfile  # type: ignore[no-redef]

__all__ = ["tarfile"]
