"""The broker's core: links and the hot path, the routing and pending tables, the
outbox, and the dispatch table every control frame goes through.

Imports neither the mesh, the handlers nor the observers: they are built on it.
"""
