"""``python -m mailflow.sources.scheduled``: the scheduled-campaign command line (create, provision,
cancel, pause, resume, status, complete)."""

import sys

from mailflow.sources.scheduled import main

sys.exit(main())
