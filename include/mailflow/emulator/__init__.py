"""Resend-compatible HTTP emulator (test double, demo email API, benchmark provider).

``create_app(EmulatorConfig(...))`` builds the Starlette app; ``mailflow emulator`` serves it;
``mailflow.emulator.testing.EmulatorProcess`` runs it as a subprocess for tests.
"""

from mailflow.emulator.app import create_app
from mailflow.emulator.config import EmulatorConfig

__all__ = ["EmulatorConfig", "create_app"]
