"""``python -m mailflow_dev.chaos_feedback`` (``make chaos``): the feedback fault-injection run."""

import sys

from mailflow_dev.chaos_feedback import main

sys.exit(main())
