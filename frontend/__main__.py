"""`python -m frontend`: the command that serves a model (see frontend/cli.py)."""

import sys

from frontend.cli import main

sys.exit(main())
