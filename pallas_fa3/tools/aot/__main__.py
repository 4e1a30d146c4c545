"""`python -m pallas_fa3.tools.aot`: the same as `pallas-fa3 aot`."""

import sys

from pallas_fa3.tools.aot import command

sys.exit(command.main())
