"""The serve ABI is frozen per major version: names, parameter kinds and defaults may only be added to.

``data/serve-abi-1.json`` is the 1.x snapshot. Regenerate it only when adding (the test prints the
current surface): ``python -c "from test_abi import surface; import json; print(json.dumps(surface(), indent=1))"``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import msgspec
import plyx.serve as serve

SNAPSHOT = Path(__file__).parent / "data" / "serve-abi-1.json"


def _signature(fn) -> list[list[str]]:
    return [[p.name, p.kind.name, repr(p.default)] for p in inspect.signature(fn).parameters.values()]


def _fields(cls) -> list[list[str]]:
    return [[f.name, repr(f.default)] for f in msgspec.structs.fields(cls)]


def surface() -> dict:
    return {
        "__all__": sorted(serve.__all__),
        "functions": {name: _signature(getattr(serve, name)) for name in ("generate", "stream_generate", "beam_search")},
        "structs": {name: _fields(getattr(serve, name)) for name in (
            "SamplingParams", "StructuredOutput", "BeamSearchParams", "RequestOutput", "CompletionOutput",
            "TokenLogprob", "RequestMetrics", "StreamEvent")},
    }


def test_surface_only_grows():
    frozen = json.loads(SNAPSHOT.read_text())
    now = surface()
    assert set(frozen["__all__"]) <= set(now["__all__"]), "a public name was removed"
    for name, params in frozen["functions"].items():
        current = now["functions"][name]
        # existing parameters keep their position, kind and default; new ones may only be appended keyword-only
        assert current[: len(params)] == params, f"{name}: existing parameters changed"
        assert all(kind == "KEYWORD_ONLY" for _, kind, _ in current[len(params):]), f"{name}: new positional parameter"
    for name, fields in frozen["structs"].items():
        current = {f: d for f, d in now["structs"][name]}
        for field, default in fields:
            assert field in current, f"{name}.{field} was removed"
            assert current[field] == default, f"{name}.{field} changed its default"


def test_options_are_keyword_only():
    for name in ("generate", "stream_generate", "beam_search"):
        params = list(inspect.signature(getattr(serve, name)).parameters.values())
        positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert positional == ["model", "prompts", "params"], name
