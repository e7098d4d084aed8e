"""The client side: connector, services, messages (the public names are re-exported by
``meshbus``; this package imports none of its modules, so one of them -- the broker
lists of ``brokers.py`` -- can be used without the rest)."""
