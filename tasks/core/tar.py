"""`tarfile` with PEP 706's extraction filters on every Python 3.11 the project admits, and bounded headers.

`extractall(..., filter="data")` (refuse absolute paths, `..`, links out of the folder, devices; strip
setuid modes) arrived in Python 3.11.4. Debian 12's python3.11 is 3.11.2 (the Python of many arm64
servers, and of the emulated arm64 machine, tests/support/arm64.py), where the keyword is a TypeError. There
the standard library's own module, backported by `backports.tarfile` (a dependency on those versions
only), gives the same filters: the archives we open from outside are checked by CPython's code, not ours.

The filters see a member only once tarfile has read its headers, and tarfile reads a GNU long name or
link ('L', 'K') or a pax header ('x', 'g') whole into memory, whatever size it declares (a 261 KB
.tar.gz declaring a 256 MiB long name took 2 GiB), and resolves each such header by recursing into the
next (3000 of them in 12 KB: RecursionError). `BoundedTarInfo` (`tarfile.open(..., tarinfo=...)`)
refuses both before reading them.
"""

from __future__ import annotations

import tarfile as _stdlib

if hasattr(_stdlib, "data_filter"):
    tarfile = _stdlib
else:  # pragma: no cover - Python 3.11.0-3.11.3
    from backports import tarfile  # type: ignore[no-redef]

__all__ = ["BoundedTarInfo", "HeaderRefused", "tarfile"]

# One extended header's payload, in bytes: 16 times Linux's PATH_MAX (4096, the longest name or link
# target that could be extracted at all) and Linux's largest extended attribute (XATTR_SIZE_MAX, what
# a pax SCHILY.xattr record may carry). Anything longer is an attack, refused before it is read.
MAX_EXTENDED_HEADER = 64 << 10
# Extended headers before one member. Writers put at most three (GNU tar: a long link and a long name;
# pax writers: a global and an extended one), each level one recursion in tarfile: refused well before
# Python's recursion limit.
MAX_EXTENDED_CHAIN = 8
# Keywords a global pax header may set, in all. tarfile copies them into every later member: 10,000 tiny
# keywords in one 64 KiB header would cost a million members a 10,000-entry dict each. git archive's
# global header has one (comment).
MAX_GLOBAL_KEYWORDS = 64
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
_EXTENDED += (tarfile.SOLARIS_XHDTYPE,)
_DEPTH = "_lockstep_extended_depth"  # on the TarFile being read: extended headers above the current one


class HeaderRefused(Exception):
    """A header `BoundedTarInfo` refused; the message says which (the caller names the archive).

    Not a tarfile.HeaderError on purpose: TarFile.next takes some of those, past the first member, for
    the end of the archive, and would quietly extract the members before it.
    """


class BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo whose extended headers are size- and count-bounded before tarfile reads them."""

    extended_bytes = 0  # declared sizes of the extended headers before this member (held in memory)

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        # tarfile's documented hook for subclasses: every header, the nested ones included, passes here
        if self.type not in _EXTENDED:
            return super()._proc_member(tar)
        if self.size > MAX_EXTENDED_HEADER:
            kind = "a GNU long name or link" if self.type in _EXTENDED[:2] else "a pax"
            raise HeaderRefused(f"{kind} header of {self.size} bytes (at most {MAX_EXTENDED_HEADER} are read)")
        depth = getattr(tar, _DEPTH, 0) + 1
        if depth > MAX_EXTENDED_CHAIN:
            raise HeaderRefused(f"more than {MAX_EXTENDED_CHAIN} extended headers before one member")
        setattr(tar, _DEPTH, depth)
        try:
            member = super()._proc_member(tar)
        finally:
            setattr(tar, _DEPTH, depth - 1)
        if self.type == tarfile.XGLTYPE and len(tar.pax_headers) > MAX_GLOBAL_KEYWORDS:
            raise HeaderRefused(f"global pax headers setting more than {MAX_GLOBAL_KEYWORDS} keywords")
        member.extended_bytes += self.size
        return member
