"""``make airflow`` / ``make stop``: a thin entry point; the runner is :mod:`mailflow_dev.airflow_local`."""

import sys

from mailflow_dev.airflow_local import main

if __name__ == "__main__":
    sys.exit(main())
