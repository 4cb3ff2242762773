"""Starting training processes: ``cli`` checks and plans a launch, ``local`` runs it on one node, ``multinode`` on
several; ``check_comm``, ``k8s`` and ``report`` are the launch-side tools. The ``shardwise`` command, which
dispatches to every tool, is ``shardwise/cli.py``."""
