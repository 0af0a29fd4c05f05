"""``DisaggAsyncEngine``: the front end's engine with prefills done by a prefill worker.

The server sees an ``AsyncEngine``: ``add`` first sends the prompt to the worker through the KV connector (on
a thread of its own, so the decode engine keeps stepping meanwhile), then queues the import of the returned
blocks and the request on the engine thread, in that order, so the request's admission finds its prompt's
blocks cached and computes only the last partial block. A failed worker makes every later ``add`` raise
``WorkerUnavailableError`` (HTTP 503 naming it) at once; nothing waits on a dead peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence as Seq
from typing import Any

from plyx.serve._params import SamplingParams
from plyx.serve.disagg._connector import KVRequestError
from plyx.serve.disagg._launch import PrefillWorker, WorkerUnavailableError
from plyx.serve.engine._async import AsyncEngine, RequestStream
from plyx.serve.engine._engine import Engine
from plyx.serve.engine._kv_transfer import KVBlocks, check_transferable, import_prefix

__all__ = ["DisaggAsyncEngine"]

log = logging.getLogger("plyx.serve.disagg")


class DisaggAsyncEngine(AsyncEngine):
    """An ``AsyncEngine`` (the decode engine) whose prompts are prefilled by ``worker``.

    Args:
        engine: the decode engine (prefix caching on, plain KV cache, no adapters).
        worker: the connected ``PrefillWorker`` (owned from here on: ``shutdown`` stops it).

    Attributes:
        remote_prefills: prompts the worker computed. imported_tokens: prompt tokens whose KV came from it.
    """

    def __init__(self, engine: Engine, worker: PrefillWorker) -> None:
        check_transferable(engine)
        super().__init__(engine)
        self.worker = worker
        self._transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plyx-kv-transfer")
        self._failure: str | None = None
        self.remote_prefills = 0
        self.imported_tokens = 0

    @property
    def unavailable(self) -> str | None:
        """Why the worker cannot serve (naming it), or None while it can."""
        if self.worker.proc.poll() is not None:  # an exit says more than an earlier timeout did
            self._failure = self.worker.failure()
        return self._failure

    async def add(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, *,
                  adapter: str | None = None, guard: Any = None) -> RequestStream:
        """Prefill on the worker, then queue the request here; raises ``WorkerUnavailableError`` when the
        worker cannot serve, and what ``Engine.add_request`` raises."""
        prompt = [int(t) for t in prompt_ids]
        if len(prompt) > self.engine.cache.block_size:  # shorter prompts have no full block to hand over
            self.engine.check_prompt(prompt)  # a bad prompt is the client's 400, not a worker's failure
            if self.unavailable:
                raise WorkerUnavailableError(self.worker.name, self.unavailable)
            fut = self._transfer.submit(self._prefill, prompt)
            blocks = await asyncio.wrap_future(fut)
            self._inbox.put(("import", prompt, blocks))
        return await super().add(request_id, prompt, params, adapter=adapter, guard=guard)

    def _prefill(self, prompt: list[int]) -> Any:  # on the transfer thread
        if self._failure is not None:
            raise WorkerUnavailableError(self.worker.name, self._failure)
        try:
            blocks = self.worker.connector.prefill(prompt)
        except KVRequestError:  # the worker is fine; this request is not (the server answers 500)
            raise
        except Exception as exc:  # the group failed: dead peer or timeout; the connector cannot recover
            self._failure = self.worker.failure(exc)
        else:
            self.remote_prefills += 1
            device = self.engine.device
            if blocks.k.device != device:  # staged on the CPU (gloo): copy here, not on the engine thread
                blocks = KVBlocks(blocks.num_tokens, blocks.k.to(device), blocks.v.to(device))
            return blocks
        log.error("disaggregated prefill stopped: %s", self._failure)
        raise WorkerUnavailableError(self.worker.name, self._failure)

    def _handle(self, cmd: tuple[Any, ...]) -> None:  # on the engine thread
        if cmd[0] == "import":
            try:
                self.imported_tokens += import_prefix(self.engine, cmd[1], cmd[2])
            except Exception:  # the request then computes its prompt itself
                log.exception("importing KV blocks failed")
            return
        super()._handle(cmd)

    async def shutdown(self, timeout: float = 0.0) -> None:
        await super().shutdown(timeout)
        await asyncio.to_thread(self._transfer.shutdown, True, cancel_futures=True)
        await asyncio.to_thread(self.worker.stop)
