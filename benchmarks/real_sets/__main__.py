"""`python -m benchmarks.real_sets`: the command line of benchmarks/real_sets/cli.py."""

from benchmarks.real_sets.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
