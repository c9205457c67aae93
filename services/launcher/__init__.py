"""`baton up`: every service of a one-host mesh as a local child process.

`process.py` owns one child (its listening line, health wait, log forwarding and
stop); `mesh.py` owns the order (workers concurrently, then the gateway), the
supervision (a child that exits or never gets healthy stops everything) and the
shutdown (gateway first, then workers; leftover shared-memory segments removed).
"""
