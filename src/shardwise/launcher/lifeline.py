"""The lifeline: one TCP connection from every node agent back to the ``shardwise`` launcher (stdlib only).

[Note: lifeline] ssh, pdsh and mpirun do not reliably stop remote commands when the local client dies (a
remote command without a terminal gets no SIGHUP), so the launcher and each node agent hold a connection
open for the whole job, and it carries the job's control in both directions:

* node → launcher: newline-delimited JSON events: ``hello`` (with the token from the job spec, so a stray
  connection cannot join), ``failed`` (the node's first failing rank, its host and traceback) and ``done``.
* launcher → node: nothing but the connection itself. Closing it — because the launcher stops the job,
  or because the launcher was killed and the kernel closed its sockets — makes every agent stop its ranks.

A node whose connection drops without ``done``/``failed`` is reported as ``lost`` (its agent was killed).
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

Event = tuple[int, dict[str, Any]]  # (node rank, event)


class LifelineServer:
    """Launcher side: accepts one connection per node and turns what they send into :attr:`events`."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.events: queue.Queue[Event] = queue.Queue()
        self._listener = socket.create_server(("", 0), backlog=128)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, name="lifeline-accept", daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            with self._lock:
                if self._stopped:
                    conn.close()  # a node that starts after the job was stopped stops at once
                    continue
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lifeline-node", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        node, final = -1, False
        with conn, conn.makefile("r", encoding="utf-8") as lines:
            try:
                for line in lines:
                    event = json.loads(line)
                    if node < 0:
                        if event.get("event") != "hello" or event.get("token") != self.token:
                            return
                        node = int(event["node_rank"])
                    final = final or event.get("event") in ("failed", "done")
                    self.events.put((node, event))
            except (OSError, ValueError):
                pass
        if node >= 0 and not final:
            self.events.put((node, {"event": "lost"}))

    def stop(self) -> None:
        """Close every connection: each node agent then stops its ranks."""
        with self._lock:
            self._stopped = True
            conns, self._conns = self._conns, []
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Lifeline:
    """Node side: the connection to the launcher; :meth:`watch` calls back when the launcher goes away."""

    def __init__(self, addr: str, port: int, token: str, node_rank: int, host: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((addr, port), timeout=5)
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"node {node_rank} ({host}): cannot reach the shardwise launcher at {addr}:{port} "
                        f"({error}); is a firewall between the nodes and the launcher's machine?"
                    ) from None
                time.sleep(0.5)
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self.send({"event": "hello", "token": token, "node_rank": node_rank, "host": host})

    def send(self, event: dict[str, Any]) -> None:
        data = (json.dumps(event) + "\n").encode()
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError:
                pass  # the launcher is gone; watch() has already reacted

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call ``on_lost`` (from a daemon thread) when the launcher closes the connection or dies."""

        def wait() -> None:
            try:
                while self._sock.recv(4096):
                    pass
            except OSError:
                pass
            on_lost()

        threading.Thread(target=wait, name="lifeline-watch", daemon=True).start()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
