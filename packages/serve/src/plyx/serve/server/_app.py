"""The ASGI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus
``/tokenize``, ``/detokenize``, ``/health`` and Prometheus ``/metrics``.

Limits, in the order a request meets them: body size (413), API key (401),
JSON shape and UTF-8 (400 naming the field), model name (404), token ids and
seed in range (400), prompt length (400 ``context_length_exceeded``: prompt +
completion never exceed the context), input rails (the safety hooks), in-flight
requests and the engine's bounded queue (429). A client that disconnects has its
engine requests aborted (their blocks freed before the next step).

Every answer of the API, error or not, is counted in ``plyx_requests_total`` by
status and route; an unexpected exception is a 500 whose connection stays usable
(keep-alive), not a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI
from plyx.serve.disagg._launch import WorkerUnavailableError
from plyx.serve.engine import AsyncEngine, Engine, QueueFullError, RequestGuard, RequestRefused
from plyx.serve.server._chat import ChatTemplate, ChatTemplateError, load_chat_template
from plyx.serve.server._errors import (
    REFUSAL_CODE,
    APIError,
    error_response,
    from_config_error,
    from_validation_error,
)
from plyx.serve.server._generation import Job, chat_logprobs, completion_logprobs, new_job_id, sse
from plyx.serve.server._metrics import COUNTED_KEY, ServerMetrics, route_of
from plyx.serve.server._protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
    best_of_params,
    sampling_params,
)
from plyx.serve.server._tools import ToolPlan, plan_tools, prepare_messages
from plyx.specs.errors import ConfigError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

__all__ = ["ServerSettings", "create_app"]

log = logging.getLogger("plyx.serve.server")


class ServerSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the HTTP layer enforces (the engine's own limits live in ``EngineConfig``)."""

    model_name: str = "plyx"
    """Name served by /v1/models; requests must name it (or one of ``model_aliases``)."""
    model_aliases: tuple[str, ...] = ()
    """Other names requests may use (``plyx serve`` adds the checkpoint's directory name, e.g. ``step-001000``);
    /v1/models lists them after ``model_name``, each with ``parent`` = ``model_name``."""
    api_key: str = ""
    """Bearer token required on /v1/*, /tokenize and /detokenize; empty disables auth."""
    max_request_bytes: int = 1_048_576
    """Largest request body (413 beyond)."""
    max_concurrent: int = 512
    """Most API requests in flight (429 beyond)."""
    drain_timeout: float = 30.0
    """On shutdown, seconds in-flight requests get to finish before they are ended."""
    guardrail_policy: str = ""
    """Passed to the safety hooks as ``context["guardrail_policy"]``."""
    tool_parser: str = "hermes"
    """Tool-call parser of ``tool_choice="auto"`` (a ``plyx_tool_parsers`` plugin: ``hermes``, ``llama3_json``,
    ``mistral``...); empty: no parser (``auto`` is refused, ``required`` and named functions still work)."""
    switch_interval: float = 0.0
    """``sys.setswitchinterval`` while the app runs (0 leaves Python's 5 ms). The engine thread and the event
    loop share the GIL; a shorter interval hands it back to the engine sooner after the loop took it (on an
    H100 run, 0.5 ms did not change throughput measurably, nor on a 2-core CPU with the benchmark client in
    its own process, where TPOT was no better; so it is off by default)."""


class _State:
    def __init__(self, engine: Engine, settings: ServerSettings, chat_template: ChatTemplate | None,
                 aengine: AsyncEngine | None = None) -> None:
        self.engine = engine
        self.aengine = aengine if aengine is not None else AsyncEngine(engine)
        self.settings = settings
        self.chat_template = chat_template
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())  # /v1/models' `created`: when this server started
        self.inflight = 0
        self.tokenizer = engine.tokenizer
        if settings.tool_parser:
            from plyx.serve.server._tool_parsers import get_tool_parser

            self.tool_parser: Any = get_tool_parser(settings.tool_parser)
        else:
            self.tool_parser = None


def create_app(engine: Engine, *, settings: ServerSettings | None = None, chat_template: ChatTemplate | str | None
               = None, model_dir: str | None = None, aengine: AsyncEngine | None = None) -> FastAPI:
    """The app serving ``engine`` (its thread starts with the app and stops, after draining, with it).

    Args:
        engine: an ``Engine`` with a tokenizer (text endpoints need one).
        settings: HTTP limits, served name and API key.
        chat_template: a ``ChatTemplate``, a builtin name (``chatml``...), a file or Jinja source; default:
            the template of ``model_dir``'s tokenizer config.
        model_dir: the model directory (tokenizer config and chat template).
        aengine: the ``AsyncEngine`` driving ``engine`` (default: a plain one); disaggregated serving passes a
            ``plyx.serve.disagg.DisaggAsyncEngine``, whose prefills run in a worker process.
    """
    settings = settings or ServerSettings()
    template = chat_template if isinstance(chat_template, ChatTemplate) else load_chat_template(model_dir, chat_template)
    state = _State(engine, settings, template, aengine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        previous = sys.getswitchinterval()
        if settings.switch_interval:
            sys.setswitchinterval(settings.switch_interval)
        # what exists now (the model, the captured graphs, the imported libraries: hundreds of thousands of objects)
        # lives as long as the server: moved out of the collector's generations, as vLLM does after start-up, so a
        # full collection walks only what serving allocates. A decode-heavy H100 run showed ~20 blocks of 21-40 ms
        # among blocks of 15 (the host, not the device, stalled), the signature of those collections
        gc.collect()
        gc.freeze()
        state.aengine.start()
        try:
            yield
        finally:
            await state.aengine.shutdown(settings.drain_timeout)
            gc.unfreeze()  # an app built again in this process (tests) leaves nothing uncollectable behind
            sys.setswitchinterval(previous)

    app = FastAPI(title="plyx-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.plyx = state

    app.add_middleware(_Guard, settings=settings, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    # -- plain endpoints ----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not state.aengine.alive and state.aengine.accepting:
            return error_response(APIError(503, "the engine thread is not running", code="engine_dead"))
        down = getattr(state.aengine, "unavailable", None)  # a disaggregated worker that died
        if down:
            return error_response(APIError(503, down, code="worker_unavailable"))
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": _model_cards(state)})

    @app.get("/v1/models/{model:path}")  # ids may hold a slash (org/name)
    async def model(model: str) -> Response:
        cards = _model_cards(state)
        for card in cards:
            if card["id"] == model:
                return _json(card)
        served = ", ".join(f"`{c['id']}`" for c in cards)
        raise APIError(404, f"The model `{model}` does not exist. This server serves {served} (see GET /v1/models)",
                       param="model", code="model_not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        body = await _read(request, LoadLoraRequest, settings)
        lora = _need_lora(state)
        try:
            await state.aengine.call(lambda: lora.add(body.lora_name, body.lora_path))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_value") from None
        return _json({"status": "loaded", "lora_name": body.lora_name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        body = await _read(request, UnloadLoraRequest, settings)
        lora = _need_lora(state)

        def unload() -> None:
            busy = sum(1 for r in engine.requests.values() if r.adapter == body.lora_name)
            if busy:
                raise APIError(409, f"adapter {body.lora_name!r} serves {busy} request(s) in flight; retry when they "
                               "finish", param="lora_name", code="adapter_in_use")
            lora.remove(body.lora_name)

        try:
            await state.aengine.call(unload)
        except ConfigError as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        return _json({"status": "unloaded", "lora_name": body.lora_name})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _read(request, TokenizeRequest, settings)
        _check_model(body.model, settings, required=False)
        tok = _need_tokenizer(state)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of `prompt` (text) or `messages` (chat)", param="prompt")
        if body.messages is not None:
            ids = _encode(tok, _render_chat(state, body.messages, None, body.add_generation_prompt), special=False)
        else:
            ids = _encode(tok, body.prompt or "", special=body.add_special_tokens)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _read(request, DetokenizeRequest, settings)
        _check_model(body.model, settings, required=False)
        tok = _need_tokenizer(state)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}) (got {bad[:8]})", param="tokens")
        return _json({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})

    # -- generation ----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read(request, CompletionRequest, settings)
        adapter = _adapter_of(state, body.model)
        if adapter is None:
            _check_model(body.model, settings)
        if body.echo or body.suffix:
            field = "echo" if body.echo else "suffix"
            raise APIError(400, f"`{field}` is not supported by this server; leave it out", param=field,
                           code="unsupported_parameter")
        prompts, texts = _completion_prompts(state, body.prompt)
        max_tokens = body.max_tokens
        params = sampling_params(body, max_tokens=max_tokens, default_max=16, logprobs=body.logprobs)
        _check_vocab(engine, body)
        params = _clamp(engine, prompts, params, max_tokens is not None)
        # best_of > n: that many samples, the n best returned; use_beam_search: a beam search of best_of beams
        params, computed = best_of_params(body, params)
        raw = msgspec.to_builtins(body)
        return await _generate(request, state, "completion", body.stream, body.stream_options, prompts, params,
                               raw, "\n".join(texts), adapter=adapter,
                               keep=body.n if computed > body.n and not body.use_beam_search else None,
                               show_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _read(request, ChatCompletionRequest, settings)
        adapter = _adapter_of(state, body.model)
        if adapter is None:
            _check_model(body.model, settings)
        tok = _need_tokenizer(state)
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser)
        text = _render_chat(state, prepare_messages(body.messages) if body.tools or _has_tool_turns(body.messages)
                            else body.messages, body.chat_template, body.add_generation_prompt, tools)
        ids = _encode(tok, text, special=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens=max_tokens, default_max=max(1, engine.max_model_len - len(ids)),
                                 logprobs=logprobs)
        _check_vocab(engine, body)
        params = _clamp(engine, [ids], params, max_tokens is not None, param="messages")
        if tools is not None and tools.structured is not None:
            if body.response_format is not None and body.response_format.type != "text":
                raise APIError(400, f"tool_choice={body.tool_choice!r} constrains the reply to tool calls; it cannot "
                               "be combined with response_format: drop one of them", param="response_format",
                               code="invalid_value")
            params = msgspec.structs.replace(params, structured=tools.structured)
        elif tools is not None and tools.parser is not None and tools.parser.keep_special_tokens:
            params = msgspec.structs.replace(params, skip_special_tokens=False)  # the call marker is a special token
        raw = msgspec.to_builtins(body)
        return await _generate(request, state, "chat", body.stream, body.stream_options, [ids], params, raw, text,
                               tools=tools if tools is not None and tools.mode != "none" else None, adapter=adapter)

    return app


# -- helpers ------------------------------------------------------------------------------
class _SSEResponse(StreamingResponse):
    """Server-sent events whose request is closed even when the client leaves before the body starts (then the
    body generator never runs, so its own ``finally`` cannot)."""

    def __init__(self, content: Any, finish: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._finish(499)


#: paths not counted in plyx_requests_total (probes and scrapes, not API traffic)
_UNCOUNTED = frozenset({"/health", "/metrics"})


class _Guard:
    """Pure ASGI middleware (no body buffering, disconnects pass through): API key, declared body size, the
    request count of every answer the handlers did not count themselves, and a 500 for an exception that
    escaped them (answered here, so the keep-alive connection stays usable; Starlette's own last-resort
    handler re-raises after answering, and uvicorn then closes the connection)."""

    def __init__(self, app: Any, settings: ServerSettings, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started: list[int] = []

        async def send_counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                started.append(int(message["status"]))
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted)
        except Exception as exc:
            log.exception("request failed")
            if started:  # the answer is under way (a stream): nothing else can be said on this connection
                raise
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            await error_response(err)(scope, receive, send_counted)
        finally:
            counted = scope.get(COUNTED_KEY, False)
            if self.metrics is not None and started and not counted and scope["path"] not in _UNCOUNTED:
                status = started[0]
                self.metrics.count(route=route_of(scope), status=status,
                                   finish_reason="error" if status >= 400 else "none")

    async def _guarded(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        err = None
        protected = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        if protected and self.settings.api_key:
            auth = headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.settings.api_key.encode()):
                err = APIError(401, "Incorrect or missing API key: send it as the header "
                               "`Authorization: Bearer <key>`", code="invalid_api_key")
        length = headers.get("content-length", "")
        if err is None and length.isdigit() and int(length) > self.settings.max_request_bytes:
            err = _too_large(int(length), self.settings.max_request_bytes)
        if err is not None:
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes, more than the limit of {limit}; send a smaller "
                    "request (or raise --max-request-bytes)", code="request_too_large")


async def _read(request: Request, kind: type, settings: ServerSettings) -> Any:
    raw = b""
    async for chunk in request.stream():  # also bounds bodies sent without Content-Length (chunked)
        raw += chunk
        if len(raw) > settings.max_request_bytes:
            raise _too_large(len(raw), settings.max_request_bytes)
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise from_validation_error(exc) from None


def _need_lora(state: _State) -> Any:
    if state.engine.lora is None:
        raise APIError(400, "this server was started without adapters, so it cannot load any at run time; start it "
                       "with --lora NAME=PATH (its base then batches adapters)", code="lora_disabled")
    return state.engine.lora


def _adapter_of(state: _State, name: str) -> str | None:
    """The resident LoRA adapter a request's ``model`` names (``plyx serve --lora NAME=PATH``), else None."""
    lora = state.engine.lora
    return name if lora is not None and name in lora.index else None


def _model_cards(state: _State) -> list[dict[str, Any]]:
    """/v1/models entries: the served model, its aliases and the resident adapters (vLLM's shape: ``parent`` is
    the base model). ``root`` is the served name, never a path of the server's file system."""
    settings, engine = state.settings, state.engine
    card = {"id": settings.model_name, "object": "model", "created": state.created, "owned_by": "plyx",
            "root": settings.model_name, "parent": None, "max_model_len": engine.max_model_len}
    aliases = [{**card, "id": alias, "parent": settings.model_name} for alias in settings.model_aliases]
    lora = engine.lora
    adapters = [] if lora is None else [{**card, "id": name, "root": name, "parent": settings.model_name}
                                        for name in lora.names]
    return [card, *aliases, *adapters]


def _check_vocab(engine: Engine, body: Any) -> None:
    """Token ids of ``logit_bias`` and ``stop_token_ids`` must be the model's (a negative id would index from the
    end of the vocabulary; one past it is no token at all)."""
    vocab = engine.vocab_size
    bad = [k for k in (body.logit_bias or {}) if not (k.lstrip("-").isdigit() and 0 <= int(k) < vocab)]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}) (got {bad[:8]})", param="logit_bias",
                       code="invalid_value")
    bad_ids = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
    if bad_ids:
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab}) (got {bad_ids[:8]})",
                       param="stop_token_ids", code="invalid_value")


def _check_model(name: str | None, settings: ServerSettings, *, required: bool = True) -> None:
    if name is None and not required:
        return
    if name != settings.model_name and name not in settings.model_aliases:
        also = f" (also as {', '.join(f'`{a}`' for a in settings.model_aliases)})" if settings.model_aliases else ""
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{settings.model_name}`{also} "
                       "(see GET /v1/models)", param="model", code="model_not_found")


def _need_tokenizer(state: _State) -> Any:
    if state.tokenizer is None:
        raise APIError(400, "this server has no tokenizer: send token ids as the prompt", param="prompt")
    return state.tokenizer


def _encode(tok: Any, text: str, *, special: bool) -> list[int]:
    raw = tok.raw
    if tok.is_hf:
        return list(raw.encode(text, add_special_tokens=special))
    return list(raw.encode(text, add_special_tokens=special).ids)


def _content(message: dict[str, Any], i: int) -> dict[str, Any]:
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise APIError(400, f"messages[{i}].role must be system, developer, user, assistant or tool (got {role!r})",
                       param=f"messages[{i}].role")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": "..."}]
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                               param=f"messages[{i}].content")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                       param=f"messages[{i}].content")
    return {**message, "role": role, "content": content}


def _has_tool_turns(messages: list[Any]) -> bool:
    return any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)


def _render_chat(state: _State, messages: list[dict[str, Any]], override: str | None, add_generation: bool,
                 tools: ToolPlan | None = None) -> str:
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    msgs = [_content(m, i) if isinstance(m, dict) else {} for i, m in enumerate(messages)]
    template = state.chat_template
    if override is not None:
        try:
            template = load_chat_template(None, override, files=False)
        except ValueError as exc:
            raise APIError(400, str(exc), param="chat_template") from None
    if template is None:
        raise APIError(400, "the model has no chat template (none in its tokenizer config); start the server with "
                       "--chat-template chatml (or a file), or pass chat_template", param="messages",
                       code="no_chat_template")
    if tools is not None and tools.mode != "none" and not template.renders_tools:
        raise APIError(400, f"the chat template {template.name!r} does not render tools, so the model would never "
                       "see them; start the server with a template that does (--chat-template hermes, or the "
                       "model's own tool-use template), or pass chat_template", param="tools",
                       code="invalid_value")
    try:
        return template.render(msgs, add_generation_prompt=add_generation, tools=tools.tools if tools else None)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _completion_prompts(state: _State, prompt: Any) -> tuple[list[list[int]], list[str]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(items) > 64:
        raise APIError(400, f"at most 64 prompts per request (got {len(items)})", param="prompt")
    ids, texts = [], []
    vocab = state.engine.vocab_size
    for i, item in enumerate(items):
        if not (isinstance(item, str) or (isinstance(item, list) and item
                                          and all(isinstance(t, int) and not isinstance(t, bool) for t in item))):
            raise APIError(400, f"prompt[{i}] must be a string or a non-empty list of token ids (got "
                           f"{type(item).__name__})", param="prompt", code="invalid_value")
        bad = [t for t in item if not 0 <= t < vocab] if isinstance(item, list) else []
        if bad:  # checked before the tokenizer decodes them (it overflows on a negative id)
            raise APIError(400, f"prompt[{i}] holds token ids outside the vocabulary [0, {vocab}): {bad[:8]}; send "
                           "ids the model's tokenizer produced", param="prompt", code="invalid_value")
        if isinstance(item, str):
            ids.append(_encode(_need_tokenizer(state), item, special=True))
            texts.append(item)
        else:
            ids.append([int(t) for t in item])
            texts.append(state.tokenizer.decode(ids[-1], skip_special_tokens=False) if state.tokenizer else "")
    for i, p in enumerate(ids):
        try:
            state.engine.check_prompt(p, where=f"prompt[{i}]")
        except ConfigError as exc:
            code = "context_length_exceeded" if "context" in exc.problem else "invalid_value"
            raise APIError(400, str(exc), param="prompt", code=code) from None
    return ids, texts


def _reencode(state: _State, kind: str, text: str, count: int) -> list[list[int]]:
    """The token ids of a prompt an input rail rewrote (chat: the rendered conversation; completions:
    the prompts, joined by newlines when there are several, as the hook saw them)."""
    tok = _need_tokenizer(state)
    texts = [text] if count == 1 else text.split("\n")
    if len(texts) != count:
        raise APIError(400, f"a guardrail rewrote this request's {count} prompts into a text that no longer "
                       f"splits into {count}; send one prompt per request", param="prompt", code="invalid_value")
    ids = [_encode(tok, t, special=kind != "chat") for t in texts]
    for i, p in enumerate(ids):
        try:
            state.engine.check_prompt(p, where=f"prompt[{i}] (after the guardrail's rewrite)")
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    return ids


def _clamp(engine: Engine, prompts: list[list[int]], params: Any, explicit: bool, param: str = "prompt") -> Any:
    """Reject an explicit max_tokens that does not fit the context (as OpenAI does); clamp a default one, so that
    prompt + completion <= max_model_len always holds. A prompt that leaves no room for one token is a 400."""
    longest = max(len(p) for p in prompts)
    room = engine.max_model_len - longest
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
                       f"prompt has {longest} tokens, which leaves no room for a completion (at least 1 token). "
                       "Shorten the prompt.", param=param, code="context_length_exceeded")
    if params.max_new_tokens > room:
        if explicit:
            raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, "
                           f"you requested {longest + params.max_new_tokens} tokens ({longest} in the prompt, "
                           f"{params.max_new_tokens} in the completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        params = msgspec.structs.replace(params, max_new_tokens=room, min_tokens=min(params.min_tokens, room))
    return params


async def _generate(request: Request, state: _State, kind: str, stream: bool, stream_options: Any,
                    prompts: list[list[int]], params: Any, raw: dict[str, Any], prompt_text: str, *,
                    tools: ToolPlan | None = None, adapter: str | None = None, keep: int | None = None,
                    show_logprobs: bool | None = None) -> Response:
    settings = state.settings
    job_id = new_job_id(kind)  # known before the hooks run, so audit records carry it
    context = {"request_id": job_id, "client": request.client.host if request.client else "", "endpoint":
               request.url.path, "guardrail_policy": settings.guardrail_policy}
    # the guardrails run at the engine boundary (input rails here, output rails and the response report on the
    # engine's outputs), once per API call whatever its number of prompts and choices
    guard = RequestGuard({**raw, "prompt_text": prompt_text}, context)
    try:
        state.engine.admit(guard)
    except RequestRefused as exc:
        raise _refusal_error(exc.refusal) from None
    if not state.aengine.accepting:
        raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
    if state.inflight >= settings.max_concurrent:
        raise APIError(429, f"too many requests in flight ({settings.max_concurrent}); retry later",
                       code="too_many_requests")

    if guard.rewritten is not None:  # an input rail redacted the prompt
        prompts = _reencode(state, kind, guard.rewritten, len(prompts))

    job = Job(state.aengine, prompts, params, guard, kind, job_id=job_id, adapter=adapter, keep=keep,
              show_logprobs=show_logprobs)
    state.inflight += 1
    try:
        await job.start()  # a failure aborts the prompts already queued: their report carries this status
    except QueueFullError as exc:
        state.inflight -= 1
        guard.status = 429
        raise APIError(429, str(exc), code="queue_full") from None
    except ConfigError as exc:
        state.inflight -= 1
        guard.status = 400
        raise from_config_error(exc) from None
    except WorkerUnavailableError as exc:  # disaggregated serving: the prefill worker is gone
        state.inflight -= 1
        guard.status = 503
        raise APIError(503, f"{exc}; restart the server (or its worker)", code="worker_unavailable") from None
    except BaseException:
        state.inflight -= 1
        guard.status = 500
        raise

    closed = False

    def finish(status: int = 200) -> None:
        """Account the request once, whichever path ends it (answer, error, disconnect before streaming)."""
        nonlocal closed
        if closed:
            return
        closed = True
        request.scope[COUNTED_KEY] = True  # the guard middleware does not count it again
        # the engine reports the response (plyx_on_response) when the job's last request ends: a job that ended
        # on its own did already (status 200); one aborted now reports this status
        guard.status = status
        job.abort()
        state.inflight -= 1
        end = job.finished_at or time.monotonic()
        tokens = max((len(c.token_ids) for c in job.choices), default=0)
        reason = job.choices[0].finish_reason or "abort"
        state.metrics.observe(arrival=job.arrival, first_token=job.first_token, finish=end, tokens=tokens,
                              finish_reason=reason, status=status, route=route_of(request.scope))

    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        return _SSEResponse(_stream(state, job, kind, include_usage, finish, tools), finish)
    return await _whole(request, state, job, kind, finish, tools)


def _refusal_error(refusal: dict[str, Any]) -> APIError:
    """The answer to an input rail's refusal: the OpenAI error object the hook sent (plyx-safety's ``error``:
    code ``content_policy_violation``, type ``invalid_request_error``, its ``rule_id``), or one of that shape
    built from a bare ``{"message", "rule_id", "status"}``."""
    error = refusal.get("error") if isinstance(refusal.get("error"), dict) else {}
    try:
        status = int(refusal.get("status", 400))
    except (TypeError, ValueError):
        status = 400
    status = status if 400 <= status < 600 else 400
    message = str(error.get("message") or refusal.get("message") or "refused by a guardrail")
    rule_id = error.get("rule_id", refusal.get("rule_id"))
    extra = {"rule_id": rule_id} if rule_id is not None else {}
    return APIError(status, message, param=error.get("param"), code=str(error.get("code") or REFUSAL_CODE),
                    type=str(error.get("type") or "invalid_request_error"), extra=extra)


async def _whole(request: Request, state: _State, job: Job, kind: str, finish: Any,
                 tools: ToolPlan | None = None) -> Response:
    async def collect() -> None:
        async for _ in job.events():
            pass

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                job.abort()
                finish(499)
                return Response(status_code=499)
        task.result()
    except asyncio.CancelledError:
        task.cancel()
        job.abort()
        finish(499)
        raise
    except Exception as exc:
        finish(500)
        raise APIError(500, str(exc), code="engine_error") from None
    tok = state.tokenizer
    choices = []
    for c in job.returned():
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if tools is not None:
                split = tools.stream()
                split.feed(c.text)
                message["content"], calls = split.message()
                if calls:
                    message["tool_calls"] = calls
                finish_reason = _tool_finish(tools, finish_reason, bool(calls))
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(tok, c.logprobs) if job.show_logprobs else None,
                            "finish_reason": finish_reason})
        else:
            choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": completion_logprobs(tok, c.logprobs, 0)
                            if job.show_logprobs else None})
    body = {"id": job.id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": job.created, "model": job.adapter or state.settings.model_name, "system_fingerprint": None,
            "choices": choices, "usage": job.usage()}
    finish()
    return _json(body)


def _tool_finish(tools: ToolPlan, reason: str | None, called: bool) -> str | None:
    """``tool_calls`` when the reply ended normally in calls (a named function keeps ``stop``, as OpenAI)."""
    return "tool_calls" if called and reason == "stop" and tools.mode != "named" else reason


async def _stream(state: _State, job: Job, kind: str, include_usage: bool, finish: Any,
                  tools: ToolPlan | None = None) -> AsyncIterator[bytes]:
    tok = state.tokenizer
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    base = {"id": job.id, "object": obj, "created": job.created, "model": job.adapter or state.settings.model_name}
    # every chunk is `data: {<base>,"choices":[<entry>]}`: the constant part is encoded once per request, not per
    # token (this runs on the event loop, which shares the GIL with the engine thread)
    head = b"data: " + msgspec.json.encode(base)[:-1] + b',"choices":['
    encode = msgspec.json.encode
    offsets = [0] * len(job.choices)
    splits = [tools.stream() for _ in job.choices] if tools is not None else []
    called = [False] * len(job.choices)
    status = 200
    try:
        if kind == "chat":  # the role first, as OpenAI does
            yield sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None} for c in job.choices]})
        async for batch in job.batches():
            parts = []
            for choice, text, lps, finish_reason in batch:
                want_lp = job.show_logprobs and lps
                if kind == "chat":
                    delta: dict[str, Any] = {"content": text} if text else {}
                    if splits:  # content before any call streams; calls leave as tool_calls deltas
                        split = splits[choice.index]
                        content, calls = split.feed(text)
                        if finish_reason is not None:
                            rest, more = split.finish()
                            content, calls = content + rest, calls + more
                        delta = {"content": content} if content else {}
                        if calls:
                            delta["tool_calls"] = calls
                            called[choice.index] = True
                        if finish_reason is not None:
                            finish_reason = _tool_finish(tools, finish_reason, called[choice.index])  # type: ignore[arg-type]
                    entry = {"index": choice.index, "delta": delta,
                             "logprobs": chat_logprobs(tok, lps) if want_lp else None,
                             "finish_reason": finish_reason}
                else:
                    entry = {"index": choice.index, "text": text, "finish_reason": finish_reason,
                             "logprobs": completion_logprobs(tok, lps, offsets[choice.index]) if want_lp else None}
                    offsets[choice.index] += len(text)
                # completions: one chunk per token event, text or not (a held-back partial character or
                # stop-string prefix still shows the client progress, and ITL is measured per token); chat:
                # deltas with content
                if kind != "chat" or delta or finish_reason is not None or want_lp:
                    parts.append(head + encode(entry) + b"]}\n\n")
            if parts:  # the events that were ready together leave in one write
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        # usage and the end marker in one write
        yield (sse({**base, "choices": [], "usage": job.usage()}) if include_usage else b"") + b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # the client went away: job.events() aborted the engine requests
        raise
    except Exception as exc:
        status = 500
        yield sse({"error": APIError(500, str(exc), code="engine_error").body()["error"]}) + b"data: [DONE]\n\n"
    finally:
        job.abort()
        finish(status)
