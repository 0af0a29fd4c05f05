"""``serve_in_thread``: the app on uvicorn in a background thread, for tests, benchmarks and notebooks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

__all__ = ["ServerThread", "serve_in_thread"]


@attrs.frozen
class ServerThread:
    """A running server: ``base_url`` (``http://host:port``), the ``uvicorn.Server`` and its thread."""

    base_url: str
    server: Any
    thread: threading.Thread


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    start_timeout: float = 60.0, stop_timeout: float = 30.0, **config: Any) -> Iterator[ServerThread]:
    """Start ``app`` on ``host:port`` (0: a free port) and stop it on exit (waiting up to ``stop_timeout`` s).

    ``config`` goes to ``uvicorn.Config`` (e.g. ``timeout_graceful_shutdown=5``). Raises ``RuntimeError``
    when the server does not start within ``start_timeout`` seconds (its thread's log says why).
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **config))
    thread = threading.Thread(target=server.run, name="plyx-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host} (see its log above)")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield ServerThread(f"http://{bound[0]}:{bound[1]}", server, thread)
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
