"""``python -m mailflow_dev.chaos`` (``make chaos``): the fault-injection run."""

import sys

from mailflow_dev.chaos import main

sys.exit(main())
