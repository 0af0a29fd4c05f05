"""Disaggregated prefill and decode (vLLM's P/D disaggregation with a KV connector).

``plyx serve PATH --disaggregate`` runs prompts' prefills in a prefill worker process (on its own GPU when
there are two) and decodes in the front end's engine; the KV blocks of each prompt go from one to the other
through a KV connector plugin (``plyx_kv_connectors``; built in: ``torch_distributed``, send/recv over gloo or
NCCL). Decodes then never share a step with a long prefill, so their time per output token stays flat while
long prompts arrive.

Example::

    from plyx.serve.disagg import start_prefill_worker, DisaggAsyncEngine
    worker = start_prefill_worker("ckpt/", engine)            # spawns, connects, checks cache geometry
    app = create_app(engine, aengine=DisaggAsyncEngine(engine, worker), settings=...)
"""

from plyx.serve.disagg._async import DisaggAsyncEngine
from plyx.serve.disagg._connector import (
    BUILTIN_CONNECTORS,
    KVRequestError,
    KVTransferError,
    TorchDistributedConnector,
    get_kv_connector,
)
from plyx.serve.disagg._launch import PrefillWorker, WorkerUnavailableError, start_prefill_worker
from plyx.serve.engine._kv_transfer import KVBlocks, export_prefix, import_prefix

__all__ = [
    "BUILTIN_CONNECTORS",
    "DisaggAsyncEngine",
    "KVBlocks",
    "KVRequestError",
    "KVTransferError",
    "PrefillWorker",
    "TorchDistributedConnector",
    "WorkerUnavailableError",
    "export_prefix",
    "get_kv_connector",
    "import_prefix",
    "start_prefill_worker",
]
