"""Resend-compatible HTTP emulator (test double, demo email API, benchmark provider).

``create_app(EmulatorConfig(...))`` builds the Starlette app; ``python -m mailflow.emulator`` serves it;
``mailflow.emulator.testing.EmulatorProcess`` runs it as a subprocess for tests.
"""

from mailflow.emulator.app import EmulatorConfig, create_app

__all__ = ["EmulatorConfig", "create_app"]
