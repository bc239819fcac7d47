"""`python -m benchmarks.synthetic_images`: the command line of benchmarks/synthetic_images/cli.py."""

from benchmarks.synthetic_images.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
