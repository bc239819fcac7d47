"""Build the real image sets into the cache, or list them.

    python -m benchmarks.real_sets                        # build every set not built yet
    python -m benchmarks.real_sets build mnist5k twemoji  # some of them
    python -m benchmarks.real_sets --list                 # each set: built or not, where

One line per set: its name, images, classes, the largest class over the smallest, and its folder
(point `data.path` at it with `data.source: imagefolder`). The cache is $LOCKSTEP_REAL_SETS, else
$XDG_CACHE_HOME/lockstep/real-sets (~/.cache/lockstep/real-sets).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.real_sets.build import Built, build, cache_root, existing
from benchmarks.real_sets.sets import SETS, RealSet
from tasks.core.cli import exit_code
from tasks.core.errors import ExitCode


def line(entry: RealSet, built: Built | None) -> str:
    """One set's line: the built folder's own counts, or the documented ones and "not built"."""
    if built is None:
        where = f"not built (would be {cache_root() / entry.name})"
        images, classes, ratio = entry.images, len(entry.counts), entry.ratio
    else:
        where = str(built.folder)
        images, classes, ratio = built.images, len(built.counts), built.ratio
    return f"{entry.name:<14} {images:>5} images {classes:>3} classes  ratio {ratio:5.2f}  {where}"


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real_sets",
        description=__doc__.split("\n")[0],
        epilog=f"sets: {', '.join(SETS)}",
    )
    parser.add_argument("names", nargs="*", metavar="[build] NAME", help="the sets to build (default: all)")
    parser.add_argument("--list", action="store_true", help="list the sets, built or not; build nothing")
    args = parser.parse_args(argv)
    names = args.names[1:] if args.names[:1] == ["build"] else args.names
    unknown = [name for name in names if name not in SETS]
    if unknown:
        print(f"error: no real set named {', '.join(unknown)} (sets: {', '.join(SETS)})", file=sys.stderr)
        return ExitCode.BAD_INPUT
    chosen = names or list(SETS)
    if args.list:
        for name in chosen:
            print(line(SETS[name], existing(SETS[name])))
        return ExitCode.OK

    def body() -> int:
        for name in chosen:
            print(line(SETS[name], build(name, say=lambda text: print(text, file=sys.stderr))))
        return ExitCode.OK

    return exit_code(body, context="real sets: ")
