"""The ``shardwise`` command: starts training processes (``cli`` parses and dispatches, ``local`` runs one node)."""
