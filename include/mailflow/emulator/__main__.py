"""``python -m mailflow.emulator``: deprecated alias of ``mailflow emulator`` (same options), kept for
one release; it says so on stderr, then runs the same command (:mod:`mailflow.emulator.cli`)."""

import sys

from mailflow.emulator.cli import emulator

print("warning: `python -m mailflow.emulator` is deprecated and goes away in the next minor release; "
      "run `mailflow emulator` (same options)", file=sys.stderr, flush=True)
emulator.main(prog_name="mailflow emulator")
