"""``python -m mailflow.sources.scheduled``: deprecated alias of ``mailflow campaign`` (same arguments),
kept for one release; it says so on stderr, then runs the same commands."""

import sys

from mailflow.sources.scheduled import main

print("warning: `python -m mailflow.sources.scheduled` is deprecated and goes away in the next minor release; "
      "run `mailflow campaign` (same arguments)", file=sys.stderr, flush=True)
sys.exit(main())
