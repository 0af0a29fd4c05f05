"""The continuous-batching engine of plyx-serve: scheduler, chunked prefill, preemption, prefix caching.

Example::

    from plyx.serve.engine import Engine, EngineConfig
    engine = Engine(model, tokenizer=tok, config=EngineConfig(max_batch_size=32))
    outs = engine.generate([prompt_ids], SamplingParams(temperature=0, max_new_tokens=32))

    # several LoRA adapters resident, mixed per row in each step
    lora = MultiLora.load(model, {"sql": "adapters/sql", "chat": "adapters/chat"})
    engine = Engine(model, tokenizer=tok, lora=lora)
    engine.add_request("r1", prompt_ids, SamplingParams(max_new_tokens=32), adapter="sql")
"""

from plyx.serve._lora import MultiLora
from plyx.serve.engine._async import AsyncEngine, RequestStream
from plyx.serve.engine._config import EngineConfig
from plyx.serve.engine._engine import Engine, EngineOutput, EngineStats, QueueFullError
from plyx.serve.engine._guard import RequestGuard, RequestRefused
from plyx.serve.engine._mixed_graphs import MixedGraphs
from plyx.serve.engine._prefix_cache import PrefixCache
from plyx.serve.engine._weight_sync import sync_weights

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineOutput",
    "EngineStats",
    "MixedGraphs",
    "MultiLora",
    "PrefixCache",
    "QueueFullError",
    "RequestGuard",
    "RequestRefused",
    "RequestStream",
    "sync_weights",
]
