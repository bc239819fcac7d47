"""`python -m tasks.tools.reproduce RUN_ID`: the command line is cli.py's."""

import sys

from tasks.tools.reproduce.cli import main

sys.exit(main())
