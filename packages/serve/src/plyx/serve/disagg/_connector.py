"""KV connectors: how a prefill worker's KV blocks reach the decode engine (vLLM's ``KVConnector`` roles).

A connector has two ends. The **consumer** lives in the front end beside the decode engine: ``prefill(prompt)``
sends a prompt to the worker and returns its ``KVBlocks``. The **producer** lives in the prefill worker:
``serve(handler)`` answers each prompt with ``handler(prompt)`` until the consumer closes. Connectors are
plugins: ``plyx_kv_connectors`` returns ``Component(name, factory)`` with ``factory(**options)`` -> a connector
(options: ``role`` ``"consumer"`` | ``"producer"``, ``address``, ``timeout``, ``device``, ``backend``), and
``plyx serve --kv-connector NAME`` picks one. The built-in ``torch_distributed`` is below.

``torch_distributed``: a two-rank process group (consumer rank 0, producer rank 1) over a ``TCPStore`` the
consumer hosts. Control messages (int64 headers, the prompt) go through gloo; the KV payload too, staged on
the CPU, unless both ends hold distinct CUDA devices, where it goes device to device through NCCL
(``backend="auto"``). Every receive of the consumer has the group's ``timeout``: a worker that dies closes its
sockets and the receive fails at once; a worker that hangs fails it after ``timeout`` seconds.

Wire format (tag 0, rank 0 <-> rank 1)::

    connect   producer -> consumer  int64[6]  (version, layers, block_size, kv_heads, head_dim, dtype code)
    prefill   consumer -> producer  int64[2]  (OP_PREFILL, n)  then int64[n] the prompt
              producer -> consumer  int64[3]  (status, num_tokens, message bytes)
                                    status 0: k, v  [L, num_tokens / block_size, block_size, KV, Dh]
                                    status 1: uint8[message bytes], the worker's error (it keeps serving)
    close     consumer -> producer  int64[2]  (OP_CLOSE, 0)
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import torch
from plyx.serve.engine._kv_transfer import KVBlocks

__all__ = ["BUILTIN_CONNECTORS", "KVRequestError", "KVTransferError", "TorchDistributedConnector", "get_kv_connector"]

_VERSION = 1
OP_CLOSE, OP_PREFILL = 0, 1
_READY_KEY = "plyx-kv-producer-ready"
#: cache dtypes a hand-over carries, by wire code
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KVTransferError(RuntimeError):
    """The transfer failed: the peer died, did not answer in time, or its cache does not match ours."""


class KVRequestError(KVTransferError):
    """The worker failed on this one prompt (its error is the message); it goes on serving."""


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise KVTransferError(f"KV dtype {dtype} cannot be handed over; use one of {', '.join(map(str, _DTYPES))}")
    return _DTYPES.index(dtype)


class TorchDistributedConnector:
    """The built-in connector: ``torch.distributed`` send/recv between the front end and one prefill worker.

    Args:
        role: ``"consumer"`` (front end, hosts the store; ``address`` port 0 picks a free one) or ``"producer"``.
        address: ``host:port`` of the consumer's store (after construction, ``self.address`` has the real port).
        timeout: seconds one receive of the consumer may wait (a prefill must answer within it), and the
            rendezvous' limit. The producer waits for requests without limit (its peer closing ends it).
        device: this end's device (the KV blocks' device).
        backend: ``auto`` (NCCL for the payload when both ends are distinct CUDA devices, gloo otherwise),
            ``gloo`` or ``nccl``.

    Not thread-safe: one thread drives each end.
    """

    name = "torch_distributed"

    def __init__(self, *, role: str, address: str = "127.0.0.1:0", timeout: float = 120.0,
                 device: str | torch.device = "cpu", backend: str = "auto") -> None:
        import torch.distributed as dist

        if role not in ("consumer", "producer"):
            raise ValueError(f"role must be 'consumer' or 'producer' (got {role!r})")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl (got {backend!r})")
        host, _, port = address.rpartition(":")
        self.role = role
        self.rank = 0 if role == "consumer" else 1
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.backend = backend
        self.store = dist.TCPStore(host or "127.0.0.1", int(port), 2, role == "consumer",
                                   dt.timedelta(seconds=max(self.timeout, 60.0)), wait_for_workers=False)
        self.address = f"{host or '127.0.0.1'}:{self.store.port}"
        self._ctl: Any = None
        self._data: Any = None
        self._stage = True  # the payload goes through the CPU (gloo)
        self.geometry: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None

    # -- both ends -----------------------------------------------------------------------
    def connect(self, geometry: tuple[int, int, int, int], dtype: torch.dtype, wait: float = 300.0) -> None:
        """Join the group (blocks until the other end joins) and check both caches have one geometry.

        Args:
            geometry: ``(layers, block_size, kv_heads, head_dim)`` of this end's cache (``kv_geometry``).
            dtype: this end's cache dtype.
            wait: seconds the consumer waits for the producer to come up (it loads a model first).

        Raises:
            KVTransferError: the two caches differ (the message names both).
        """
        import torch.distributed as dist

        # the producer waits for work without limit: only the consumer's receives are timed
        timeout = dt.timedelta(seconds=self.timeout if self.role == "consumer" else 7 * 24 * 3600)
        # the group's rendezvous waits only `timeout`: the consumer first waits for the producer to be up
        if self.role == "producer":
            self.store.set(_READY_KEY, "1")
        else:
            self.store.wait([_READY_KEY], dt.timedelta(seconds=wait))
        self._ctl = dist.ProcessGroupGloo(dist.PrefixStore("plyx-kv-ctl", self.store), self.rank, 2, timeout)
        mine = torch.tensor([_VERSION, *geometry, _dtype_code(dtype)], dtype=torch.long)
        self.geometry, self.dtype = tuple(geometry), dtype
        here = torch.tensor([int(self.device.type == "cuda"), self.device.index or 0], dtype=torch.long)
        if self.role == "producer":
            self._send(mine)
            self._send(here)
            peer = self._recv(torch.zeros(2, dtype=torch.long))
        else:
            theirs = self._recv(torch.zeros(6, dtype=torch.long))
            peer = self._recv(torch.zeros(2, dtype=torch.long))
            self._send(here)  # first: a refused producer then waits in its serve loop for close()
            if not torch.equal(theirs, mine):
                raise KVTransferError(
                    f"the prefill worker's cache (version, layers, block_size, kv_heads, head_dim, dtype code) = "
                    f"{tuple(theirs.tolist())} differs from the decode engine's {tuple(mine.tolist())}; start both "
                    "from one checkpoint with one --block-size and --dtype")
        both_cuda = bool(here[0]) and bool(peer[0])
        # NCCL cannot put two ranks on one device: one shared GPU hands over through gloo (staged on the CPU)
        nccl = both_cuda and (self.backend == "nccl" or (self.backend == "auto" and int(here[1]) != int(peer[1])))
        if nccl:
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._data = dist.ProcessGroupNCCL(dist.PrefixStore("plyx-kv-data", self.store), self.rank, 2, opts)
            self._stage = False
        else:
            self._data = self._ctl

    def close(self) -> None:
        """Tell the producer to stop (consumer); drop the groups. Safe to call twice or after a failure."""
        if self.role == "consumer" and self._ctl is not None:
            try:
                self._send(torch.tensor([OP_CLOSE, 0], dtype=torch.long))
            except Exception:  # the peer is gone already
                pass
        self._ctl = self._data = None

    # -- consumer --------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> KVBlocks:
        """Send ``prompt_ids`` to the worker; its KV blocks (on this end's device).

        Raises:
            KVTransferError: the worker answered with an error, or the group failed (dead peer, timeout).
        """
        if self._ctl is None:
            raise KVTransferError("the connector is not connected (or was closed); call connect() first")
        self._send(torch.tensor([OP_PREFILL, len(prompt_ids)], dtype=torch.long))
        self._send(torch.tensor(prompt_ids, dtype=torch.long))
        status, num_tokens, msg_len = self._recv(torch.zeros(3, dtype=torch.long)).tolist()
        if status != 0:
            msg = bytes(self._recv(torch.zeros(msg_len, dtype=torch.uint8)).tolist()).decode("utf-8", "replace")
            raise KVRequestError(f"the prefill worker failed on this prompt: {msg}")
        assert self.geometry is not None and self.dtype is not None
        layers, bs, kv, dh = self.geometry
        shape = (layers, num_tokens // bs, bs, kv, dh)  # [L, nb, bs, KV, Dh]
        where = "cpu" if self._stage else self.device
        k = torch.empty(shape, dtype=self.dtype, device=where)
        v = torch.empty(shape, dtype=self.dtype, device=where)
        if num_tokens:
            self._data.recv([k], 1, 1).wait()
            self._data.recv([v], 1, 2).wait()
            if not self._stage:  # NCCL's wait only orders the stream: the blocks are read on the host's next step
                torch.cuda.synchronize(self.device)
        return KVBlocks(num_tokens, k, v)

    # -- producer --------------------------------------------------------------------------
    def serve(self, handler: Callable[[list[int]], KVBlocks]) -> None:
        """Answer prompts with ``handler(prompt) -> KVBlocks`` until the consumer closes (or goes away: the
        receive then raises). A handler error is sent back and serving goes on."""
        while True:
            op, n = self._recv(torch.zeros(2, dtype=torch.long)).tolist()
            if op == OP_CLOSE:
                return
            prompt = self._recv(torch.zeros(n, dtype=torch.long)).tolist()
            try:
                blocks = handler(prompt)
            except Exception as exc:  # the worker survives a bad request; the consumer raises it
                msg = f"{type(exc).__name__}: {exc}".encode()
                self._send(torch.tensor([1, 0, len(msg)], dtype=torch.long))
                self._send(torch.tensor(list(msg), dtype=torch.uint8))
                continue
            self._send(torch.tensor([0, blocks.num_tokens, 0], dtype=torch.long))
            if blocks.num_tokens:
                k, v = (blocks.k.cpu(), blocks.v.cpu()) if self._stage else (blocks.k, blocks.v)
                self._data.send([k.contiguous()], 0, 1).wait()
                self._data.send([v.contiguous()], 0, 2).wait()
                if not self._stage:  # keep k and v alive until NCCL has read them
                    torch.cuda.synchronize(self.device)

    # -- internals -------------------------------------------------------------------------
    def _send(self, t: torch.Tensor) -> None:
        self._ctl.send([t], 1 - self.rank, 0).wait()

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        self._ctl.recv([t], 1 - self.rank, 0).wait()
        return t


#: name -> class of the built-in connectors (the serve plugin returns them through ``plyx_kv_connectors``)
BUILTIN_CONNECTORS: dict[str, type] = {TorchDistributedConnector.name: TorchDistributedConnector}


def get_kv_connector(name: str) -> Callable[..., Any]:
    """The factory of the connector called ``name`` among the installed plugins'; a ConfigError lists those found."""
    from plyx.specs.errors import ConfigError
    from plyx.specs.plugins import components

    found = components("plyx_kv_connectors")
    if name not in found:
        raise ConfigError("kv_connector", f"KV connector {name!r} not found. It is either misspelled or not "
                          f"installed; installed: {', '.join(sorted(found)) or 'none'}", value=name,
                          fix="pass --kv-connector with one of those")
    return found[name].factory
