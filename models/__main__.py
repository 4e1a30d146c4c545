"""`python -m models train|generate` (from the checkout's root).
More: docs/training.md#running-it
"""

import sys

from models import cli

sys.exit(cli.main())
