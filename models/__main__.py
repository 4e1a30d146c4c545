"""`python -m models train|generate` (from the checkout's root)."""

import sys

from models import cli

sys.exit(cli.main())
