"""Kept entry point: ``python -m mailflow.contact_chaos`` runs the contact-policy race, which moved
to :mod:`mailflow_dev.contact_chaos` with the other development tools, apart from the product
(``python -m mailflow_dev.contact_chaos`` is the new name).

Importing this module imports nothing: the development tools are loaded only when it runs as
``__main__`` (the one import the "product never imports the development tools" contract allows).
"""

if __name__ == "__main__":
    import sys

    from mailflow_dev.contact_chaos import main

    sys.exit(main())
