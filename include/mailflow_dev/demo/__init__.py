"""Demo data for mailflow: the practice platform's ``app`` schema and a seeded population.

Use :func:`load_demo_data` from Python, or the CLI::

    python -m mailflow_dev.demo --dsn "host=127.0.0.1 user=postgres dbname=demo" \\
        [--users 5000] [--seed 42] [--anchor 2025-03-10T12:00:00Z] [--reset]
"""

from mailflow_dev.demo.generate import ASSESSMENT_KINDS, LOCALES, MALFORMED_KINDS
from mailflow_dev.demo.loader import LoadSummary, load_demo_data, schema_sql

__all__ = [
    "ASSESSMENT_KINDS",
    "LOCALES",
    "MALFORMED_KINDS",
    "LoadSummary",
    "load_demo_data",
    "schema_sql",
]
