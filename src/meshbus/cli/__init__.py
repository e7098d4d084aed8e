"""The ``meshbus`` command: a thin layer over the library (``meshbus.cli.main``)."""
