"""Kept entry point: ``python -m mailflow.chaos`` runs the fault-injection harness, which moved to
:mod:`mailflow_dev.chaos` with the other development tools, apart from the product
(``python -m mailflow_dev.chaos`` is the new name).

Importing this module imports nothing: the development tools are loaded only when it runs as
``__main__`` (the one import the "product never imports the development tools" contract allows).
"""

if __name__ == "__main__":
    import sys

    from mailflow_dev.chaos import main

    sys.exit(main())
