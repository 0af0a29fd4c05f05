"""The OpenAI-compatible HTTP server of plyx-serve (needs the ``server`` extra: fastapi, uvicorn, prometheus-client).

Example::

    from plyx.serve.engine import Engine
    from plyx.serve.server import ServerSettings, create_app
    app = create_app(Engine(model, tokenizer=tok), settings=ServerSettings(model_name="tiny"), chat_template="chatml")
    uvicorn.run(app, host="127.0.0.1", port=8000)

or from the command line: ``plyx serve PATH --host 127.0.0.1 --port 8000 [--api-key K]``.

``SERVE_COMMAND`` imports without the ``server`` extra (so ``plyx --help`` works everywhere); the app
and its helpers import fastapi on first use.
"""

from __future__ import annotations

from typing import Any

from plyx.serve.server._cli import SERVE_COMMAND, build_server, serve_config_from_args

__all__ = [
    "BUILTIN_TEMPLATES",
    "SERVE_COMMAND",
    "APIError",
    "ChatTemplate",
    "ServerSettings",
    "ServerThread",
    "build_server",
    "create_app",
    "load_chat_template",
    "serve_config_from_args",
    "serve_in_thread",
]

_LAZY = {
    "ServerSettings": "plyx.serve.server._app",
    "create_app": "plyx.serve.server._app",
    "BUILTIN_TEMPLATES": "plyx.serve.server._chat",
    "ChatTemplate": "plyx.serve.server._chat",
    "load_chat_template": "plyx.serve.server._chat",
    "APIError": "plyx.serve.server._errors",
    "ServerThread": "plyx.serve.server._thread",
    "serve_in_thread": "plyx.serve.server._thread",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plyx.serve.server' has no attribute {name!r}")
