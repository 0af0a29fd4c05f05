"""``PrefillWorker``: start the prefill worker process, join its connector, and say what became of it."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["PrefillWorker", "WorkerUnavailableError", "start_prefill_worker"]

log = logging.getLogger("plyx.serve.disagg")


class WorkerUnavailableError(RuntimeError):
    """A disaggregated worker cannot serve (it died, hung, or never started); the server answers HTTP 503.

    Attributes:
        worker: which worker (``"prefill worker (pid 1234)"``).
    """

    def __init__(self, worker: str, message: str) -> None:
        self.worker = worker
        super().__init__(message)


class PrefillWorker:
    """A prefill worker process and the consumer end of its connector.

    Args:
        argv: the worker's command line (``worker_argv``); its output goes to a log file whose tail errors quote.
        connector: the consumer connector (already listening: ``connector.address`` is in ``argv``).
        env: extra environment of the worker (e.g. ``OMP_NUM_THREADS``).
    """

    def __init__(self, argv: list[str], connector: Any, *, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.connector = connector
        fd, name = tempfile.mkstemp(prefix="plyx-prefill-worker-", suffix=".log")
        self.log_path = Path(name)
        self._log = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})

    @property
    def name(self) -> str:
        return f"prefill worker (pid {self.proc.pid})"

    def connect(self, geometry: tuple[int, int, int, int], dtype: Any, start_timeout: float = 300.0) -> None:
        """Wait until the worker joined the connector; a worker that exits first is an error quoting its log."""
        error: list[BaseException] = []

        def join() -> None:
            try:
                self.connector.connect(geometry, dtype, wait=start_timeout + 5)
            except BaseException as exc:  # handed to the caller's thread
                error.append(exc)

        t = threading.Thread(target=join, name="plyx-kv-connect", daemon=True)
        t.start()
        deadline = time.monotonic() + start_timeout
        while t.is_alive():
            t.join(0.1)
            if self.proc.poll() is not None and t.is_alive():
                raise WorkerUnavailableError(self.name, f"the {self.name} exited with code {self.proc.returncode} "
                                             f"before joining:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerUnavailableError(self.name, f"the {self.name} did not join within {start_timeout:.0f} "
                                             f"s; its log:\n{self.log_tail()}")
        if error:
            self.stop()
            raise error[0]

    def failure(self, exc: BaseException | None = None) -> str:
        """Why the worker cannot serve, naming it: its exit code, or the transfer's error."""
        code = self.proc.poll()
        if code is not None:
            return f"the {self.name} exited with code {code}"
        first = str(exc).splitlines()[0][:300] if exc is not None else "no answer"
        if "Timed out" in first:
            return f"the {self.name} did not answer within {self.connector.timeout:.0f} s ({first})"
        return f"the {self.name} failed: {first}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Close the connector (the worker exits) and reap the process; kill it if it lingers."""
        try:
            self.connector.close()
        finally:
            if self.proc.poll() is None:
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout)
            self._log.close()
            self.log_path.unlink(missing_ok=True)


def start_prefill_worker(path: str | Path, engine: Any, *, connector: str = "torch_distributed",
                         device: str = "auto", dtype: str = "auto", backend: str = "auto", timeout: float = 120.0,
                         start_timeout: float = 300.0, threads: int = 0, num_blocks: int = 0,
                         memory_fraction: float = 0.3, env: dict[str, str] | None = None) -> PrefillWorker:
    """Start a prefill worker serving ``path`` for the decode ``engine`` and wait until it joined.

    Args:
        path: the checkpoint (the same the front end serves).
        engine: the decode engine: the worker's cache copies its block size, length limit and dtype.
        connector: a ``plyx_kv_connectors`` plugin name.
        device: the worker's device; ``auto``: the second GPU when there are two and the engine holds the first,
            else the engine's device (one GPU shared, or the CPU).
        dtype: the checkpoint's load dtype (as ``plyx serve --dtype``).
        backend, timeout: the connector's (``torch_distributed``: gloo/NCCL; seconds a prefill may take).
        start_timeout: seconds the worker may take to load the model and join.
        threads: the worker's torch threads (0: torch's default).
        num_blocks, memory_fraction: the worker's KV pool (0: a share of free GPU memory, or 4 sequences on CPU).
        env: extra environment variables of the worker.

    Returns:
        The connected ``PrefillWorker``.

    Raises:
        WorkerUnavailableError: the worker exited or did not join in time (the message quotes its log).
        KVTransferError: its cache geometry differs from the engine's.
    """
    import torch
    from plyx.serve.disagg._connector import get_kv_connector
    from plyx.serve.disagg._worker import worker_argv
    from plyx.serve.engine._kv_transfer import check_transferable, kv_geometry

    check_transferable(engine)
    here = engine.device
    if device == "auto":
        two = here.type == "cuda" and torch.cuda.device_count() > 1
        device = f"cuda:{1 if (here.index or 0) == 0 else 0}" if two else str(here)
    consumer = get_kv_connector(connector)(role="consumer", address="127.0.0.1:0", timeout=timeout, device=here,
                                           backend=backend)
    layout = engine.cache.layout
    argv = worker_argv(str(path), consumer.address, connector=connector, backend=backend, device=device, dtype=dtype,
                       block_size=int(layout.block_size), num_blocks=num_blocks, max_model_len=engine.max_model_len,
                       max_batch_tokens=engine.config.max_batch_tokens, memory_fraction=memory_fraction,
                       timeout=timeout, threads=threads)
    worker = PrefillWorker(argv, consumer, env=env)
    worker.connect(kv_geometry(engine), engine.cache.kv_blocks(0)[0].dtype, start_timeout)
    log.info("disaggregated: %s on %s joined through %s (its log: %s)", worker.name, device, connector,
             worker.log_path)
    return worker
