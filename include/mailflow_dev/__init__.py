"""Development tools, apart from the product: the embedded database (devenv), the demo data
loader, the crash/fault harness (chaos, contact_chaos) and load generation (loadgen).

The product (``mailflow``) never imports this package (import contract in pyproject.toml). The
Resend-compatible emulator stays in the product as :mod:`mailflow.emulator`, importable for users'
own tests.
"""
