"""`python -m tasks.tools.gpu_check`: the command line is cli.py's."""

import sys

from tasks.tools.gpu_check.cli import main

sys.exit(main())
