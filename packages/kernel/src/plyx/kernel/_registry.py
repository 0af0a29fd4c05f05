"""``Registry``: plyx-kernel's implementation of the ``plyx.specs.kernels.KernelRegistry`` contract.

Selection for ``(name, query)``:

1. an override (innermost ``registry.override(...)`` block, then ``PLYX_KERNELS``,
   then ``KernelConfig.overrides``) names the implementation; if its predicates
   refuse the query, strict mode raises and otherwise the registry warns and
   falls back to step 2;
2. otherwise the accepted implementation of highest priority, ties broken by
   implementation name, so the choice never depends on registration order.

Implementations listed in ``KernelConfig.disabled`` are never chosen.
Implementations from other distributions than plyx-kernel (the distribution
comes from the entry point that registered them, never from the plugin's own
arguments) are checked by the conformance kit (``plyx.specs.testing.kernels``)
the first time they would be chosen for each (device, dtype, gradients needed)
combination: every case of the kernel name that lies inside the
implementation's declared capability, forward and (when gradients are needed)
backward, in the query's dtype, within a time budget
(``PLYX_KERNELS_VERIFY_BUDGET_MS``, default 3000; the first case always runs).
One that fails, or that cannot be checked (no cases for its name, none inside
its capability, a dtype without an error model), is refused with the reason and
a ``KernelConformanceWarning``, never silently used. The probe runs once per
combination however many threads race to it. ``PLYX_KERNELS_VERIFY=0`` turns it
off; the variable is read on every selection, so changing it takes effect.

Choices are cached per (name, device, dtype, compute capability, shape class,
requires_grad, overrides); a cached choice is re-checked against the exact
shape, since a shape class spans sizes a shape limit may split.

``get`` (the hot path of every dispatching call) answers from a second cache
in front of ``select``, keyed by a plain tuple read straight off the tensors
without building a ``KernelQuery``: (name, device type, device index, dtype,
requires_grad, sizes, overrides version). Sizes are left out for kernel names
none of whose implementations has a shape predicate (the choice cannot depend
on them) and are the tensors' exact shapes otherwise (a shape class may
straddle a shape limit, and ``select`` re-checks exact sizes; exact shapes
determine the sizes ``query_for`` reads and are cheaper to read). The overrides version is the
registry's generation (bumped by register, unregister and configure), the
innermost ``override()`` block and the ``PLYX_KERNELS``/``PLYX_KERNELS_STRICT``
variables, so the cache always returns what ``select`` returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from plyx.specs.config import KernelConfig
from plyx.specs.kernels import (
    Candidate,
    KernelImpl,
    KernelNotFoundError,
    KernelQuery,
    KernelUnavailableError,
)
from plyx.specs.tensorspec import dtype_name

__all__ = ["Registry", "KernelFallbackWarning", "KernelConformanceWarning", "BUILTIN_SOURCE", "probe"]

#: the distribution whose implementations are trusted without a conformance probe
BUILTIN_SOURCE = "plyx-kernel"
#: entries of ``get``'s fast cache before it is emptied (exact sizes of shape-limited kernels may vary a lot)
FAST_CACHE_LIMIT = 4096


class KernelFallbackWarning(UserWarning):
    """An override could not be honoured and the registry fell back (strict mode raises instead)."""


class KernelConformanceWarning(UserWarning):
    """An implementation failed the conformance probe and is refused."""


def _env_reader() -> tuple[Callable[[Any], Any], Callable[[str], Any]]:
    """A fast reader of environment variables for the dispatch hot path.

    ``os.environ.get`` of an unset variable raises and catches a KeyError inside
    (~1.5 us); the mapping it wraps answers in ~0.03 us. Falls back to
    ``os.environ.get`` where that mapping is not there (another Python).
    """
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encode):
        return data.get, encode
    return os.environ.get, lambda key: key


_env, _encode_env = _env_reader()
_KEY_OVERRIDES = _encode_env("PLYX_KERNELS")
_KEY_STRICT = _encode_env("PLYX_KERNELS_STRICT")
_KEY_VERIFY = _encode_env("PLYX_KERNELS_VERIFY")
#: default time budget of one conformance probe (one implementation, device, dtype, grad), in ms
VERIFY_BUDGET_MS = 3000.0


def _truthy(value: str | None) -> bool:
    return (value or "") not in ("", "0", "false", "False", "no")


def _shape_dependent(impl: KernelImpl) -> bool:
    """Whether ``impl``'s predicates may look at sizes (``check`` may look at anything)."""
    cap = impl.capability
    return bool(cap.shape_limits or cap.shape_multiple_of or cap.shape_in or cap.check is not None)


def _shape_refusal(impl: KernelImpl, query: KernelQuery) -> str | None:
    """Re-check only the shape-dependent predicates (cheap) of a cached choice."""
    cap = impl.capability
    if not (cap.shape_limits or cap.shape_multiple_of or cap.shape_in or cap.check):
        return None
    return cap.refusal(query)


class Registry:
    """Kernel implementations under symbolic names, chosen by capability and priority.

    Args:
        config: overrides, disabled implementations and strictness; see ``configure``.
        verify: probe third-party implementations with the conformance kit before
            first use; defaults to ``PLYX_KERNELS_VERIFY`` (on unless ``0``).

    Example::

        reg = Registry()
        reg.register(KernelImpl("rmsnorm", "reference", rmsnorm))
        fn = reg.get("rmsnorm", x)          # chosen for x's device and dtype
        with reg.override(rmsnorm="reference"):
            ...
    """

    def __init__(self, config: KernelConfig | None = None, *, verify: bool | None = None) -> None:
        self._lock = threading.RLock()
        self._impls: dict[str, dict[str, KernelImpl]] = {}
        self._cache: dict[tuple[Any, ...], KernelImpl] = {}
        # (qualname, device, dtype, grad) -> failure (None: passed); filled under _probe_lock, once per key
        self._verified: dict[tuple[str, str, str, bool], str | None] = {}
        self._probe_lock = threading.Lock()
        # (name, impl) pairs sorted by name: hashable, so part of the fast cache's key as is
        self._scoped: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
            f"plyx_kernel_override_{id(self)}", default=())
        self._fast: dict[tuple[Any, ...], Callable[..., Any]] = {}  # get()'s cache, see the module docstring
        self._generation = 0  # bumped whenever registrations or the config change
        self._by_shape: frozenset[str] = frozenset()  # names with a shape-dependent implementation
        self._config = KernelConfig()
        self._verify_arg = verify  # None: follow PLYX_KERNELS_VERIFY, read at each selection
        if config is not None:
            self.configure(config)

    # -- registration -----------------------------------------------------
    def register(self, impl: KernelImpl, *, source: str = "") -> None:
        """Add ``impl``; a second (name, impl) pair is an error naming both sources."""
        if not isinstance(impl, KernelImpl):
            raise TypeError(f"register() takes a plyx.specs.kernels.KernelImpl, got {type(impl).__name__}; "
                            "wrap the function as KernelImpl(name, impl, fn, capability, priority)")
        if not impl.name or not impl.impl or ":" in impl.impl:
            raise ValueError(f"kernel implementation needs a name and an impl name without ':', got {impl.name!r}:{impl.impl!r}")
        if not callable(impl.fn):
            raise TypeError(f"kernel {impl.qualname}: fn must be callable, got {type(impl.fn).__name__}")
        if source and not impl.source:
            impl = _evolve(impl, source=source)
        with self._lock:
            existing = self._impls.setdefault(impl.name, {}).get(impl.impl)
            if existing is not None:
                if existing.fn is impl.fn and existing.source == impl.source:
                    return  # re-entrant: the same plugin registering twice is harmless
                raise KernelUnavailableError(
                    f"kernel {impl.qualname} is registered twice: by {existing.source or '<unknown>'} and by "
                    f"{impl.source or '<unknown>'}; uninstall one of them or give one a different impl name"
                )
            self._impls[impl.name][impl.impl] = impl
            self._invalidate()

    def unregister(self, name: str, impl: str) -> None:
        """Remove one implementation (tests, or an application replacing a built-in)."""
        with self._lock:
            self._known(name)
            if impl not in self._impls[name]:
                raise KernelNotFoundError(self._missing_impl(name, impl))
            del self._impls[name][impl]
            if not self._impls[name]:
                del self._impls[name]
            self._invalidate()

    # -- policy --------------------------------------------------------------
    def configure(self, config: KernelConfig) -> None:
        """Apply a ``KernelConfig``: overrides, disabled implementations and strict mode."""
        config.check()
        with self._lock:
            self._config = config
            self._invalidate()

    @property
    def config(self) -> KernelConfig:
        return self._config

    @property
    def verify(self) -> bool:
        """Whether third-party implementations are probed (the constructor's ``verify``, else ``PLYX_KERNELS_VERIFY``)."""
        if self._verify_arg is not None:
            return self._verify_arg
        return _truthy(os.environ.get("PLYX_KERNELS_VERIFY", "1"))

    @property
    def strict(self) -> bool:
        """Strict mode (``KernelConfig.strict`` or ``PLYX_KERNELS_STRICT=1``): an override never falls back."""
        return self._config.strict or _truthy(os.environ.get("PLYX_KERNELS_STRICT"))

    @contextlib.contextmanager
    def override(self, **choices: str) -> Iterator[None]:
        """Force ``name=impl`` inside the block (nested blocks win; per thread and task)."""
        for name, impl in choices.items():
            if not isinstance(impl, str) or not impl:
                raise ValueError(f"override {name}={impl!r}: the implementation must be a name such as 'reference'")
        token = self._scoped.set(tuple(sorted({**dict(self._scoped.get()), **choices}.items())))
        try:
            yield
        finally:
            self._scoped.reset(token)

    def overrides(self) -> dict[str, tuple[str, str]]:
        """The overrides in force now: name -> (impl, where it comes from)."""
        out = {name: (impl, "KernelConfig.overrides") for name, impl in self._config.overrides.items()}
        env = os.environ.get("PLYX_KERNELS", "")
        if env:
            out.update({name: (impl, "PLYX_KERNELS") for name, impl in KernelConfig.parse_env(env).items()})
        out.update({name: (impl, "registry.override()") for name, impl in self._scoped.get()})
        return out

    # -- queries -------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._impls)

    def implementations(self, name: str) -> list[KernelImpl]:
        self._known(name)
        return sorted(self._impls[name].values(), key=lambda i: (-i.priority, i.impl))

    def __iter__(self) -> Iterator[KernelImpl]:
        for name in self.names():
            yield from self.implementations(name)

    def __contains__(self, name: object) -> bool:
        return name in self._impls

    def select(self, name: str, query: KernelQuery) -> KernelImpl:
        """The implementation used for ``query``; cached per shape class."""
        overrides = self.overrides()
        key = (name, query.cache_key(), tuple(sorted(overrides.items())), self.strict, self.verify)
        hit = self._cache.get(key)
        if hit is not None and _shape_refusal(hit, query) is None:
            return hit
        candidates = self._decide(name, query, overrides, warn=True)
        chosen = next(c.impl for c in candidates if c.taken)
        if hit is None and not _tracing():  # keep the first choice of the class; exact re-checks handle the rest
            with self._lock:
                self._cache[key] = chosen
        return chosen

    def explain(self, name: str, query: KernelQuery) -> list[Candidate]:
        """Every implementation of ``name``, highest priority first, with taken/refused and why."""
        return self._decide(name, query, self.overrides(), warn=False, explaining=True)

    def get(self, name: str, *tensors: Any, **shape: int) -> Callable[..., Any]:
        """The callable chosen for the device and dtype of ``tensors`` (the first one's dtype) and ``shape``.

        Answers from the fast cache when it can (a few dictionary reads), else
        through ``select(name, query_for(...))``, whose answer it then remembers.
        """
        key = self._fast_key(name, tensors, shape)
        if key is not None:
            fn = self._fast.get(key)
            if fn is not None:
                return fn
        fn = self.select(name, query_for(name, *tensors, **shape)).fn
        if key is not None:
            with self._lock:
                if key[-1][0] == self._generation:  # not invalidated while selecting
                    if len(self._fast) >= FAST_CACHE_LIMIT:
                        self._fast.clear()
                    self._fast[key] = fn
        return fn

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Select for the tensor arguments and call: ``registry("rmsnorm", x, w, eps=1e-5)``."""
        tensors = [a for a in args if hasattr(a, "device")]
        return self.get(name, *tensors)(*args, **kwargs)

    # -- internals -------------------------------------------------------------
    def _invalidate(self) -> None:
        """Forget every cached choice (caller holds the lock): registrations or the config changed."""
        self._cache.clear()
        self._fast.clear()
        self._generation += 1
        self._by_shape = frozenset(n for n, impls in self._impls.items() if any(map(_shape_dependent, impls.values())))

    def _fast_key(self, name: str, tensors: tuple[Any, ...], shape: Mapping[str, int]) -> tuple[Any, ...] | None:
        """``get``'s cache key, or None where only the slow path can answer (it raises the errors).

        Read straight off the tensors: each attribute read costs ~0.05 us, a ``KernelQuery`` ~10 us.
        """
        if not tensors or _tracing():
            return None  # under torch.compile/export sizes may be symbolic: only select() can answer
        first = tensors[0]
        device = getattr(first, "device", None)
        if device is None:
            return None
        grad = getattr(first, "requires_grad", None)
        if grad is None:
            return None  # not a tensor: query_for raises
        for t in tensors[1:]:
            other = getattr(t, "device", None)
            if other is not None:
                if other != device:
                    return None  # mixed devices: query_for raises
                grad = grad or bool(getattr(t, "requires_grad", False))
        if grad:
            grad = _grad_enabled()
        if name in self._by_shape:
            # the tensors' shapes (and explicit sizes) determine default_sizes(); reading them is
            # ~10x cheaper than computing it, at the price of more keys (bounded by FAST_CACHE_LIMIT)
            sizes: Any = tuple([getattr(t, "shape", None) for t in tensors])
            if shape:
                sizes += tuple(sorted(shape.items()))
            try:
                hash(sizes)
            except TypeError:  # symbolic sizes (SymInt) do not hash
                return None
        else:
            sizes = None  # no implementation looks at sizes: the choice cannot depend on them
        policy = (self._generation, self._scoped.get(), _env(_KEY_OVERRIDES), _env(_KEY_STRICT), _env(_KEY_VERIFY))
        # the device object stands for (type, index); it hashes and compares by both
        return (name, device, first.dtype, grad, sizes, policy)

    def _known(self, name: str) -> None:

        if name not in self._impls:
            known = ", ".join(self.names()) or "none"
            raise KernelNotFoundError(
                f"kernel {name!r} not found. It is either misspelled or not installed (known kernels: {known}); "
                f"`plyx kernels list` shows every implementation"
            )

    def _missing_impl(self, name: str, impl: str) -> str:
        have = ", ".join(sorted(self._impls[name]))
        return (f"kernel {name!r} has no implementation {impl!r}. It is either misspelled or not installed "
                f"(implementations of {name}: {have})")

    def _refusal(self, impl: KernelImpl, query: KernelQuery) -> str | None:
        disabled = set(self._config.disabled)
        if impl.impl in disabled or impl.qualname in disabled:
            return "disabled by KernelConfig.disabled"
        reason = impl.capability.refusal(query)
        # registered by a plugin (populate credits every registration to the entry point's distribution) and
        # not plyx-kernel's own: probed. No source: registered by the application itself on its own registry.
        if reason is None and self.verify and impl.source and impl.source.split(" ")[0] != BUILTIN_SOURCE:
            reason = self._conformance(impl, query)
        return reason

    def _conformance(self, impl: KernelImpl, query: KernelQuery) -> str | None:
        """The probe's verdict for (impl, device, dtype, grad): None when it passed, else why it is refused."""
        grad = query.requires_grad and impl.capability.backward
        key = (impl.qualname, query.device_type, query.dtype, grad)
        if key in self._verified:
            return self._verified[key]
        if _tracing():
            # the probe runs real kernels on random data and reads results on the host, which
            # torch.compile/export cannot trace: refuse for now, probe at the first eager use
            return "not yet checked by the conformance kit (its first use is inside torch.compile/export tracing)"
        with self._probe_lock:  # racing threads: one probes, the others wait for its verdict
            if key not in self._verified:
                failure = probe(impl, query.device_type, query.dtype, grad)
                if failure:
                    _warn_at_kernel(impl, f"kernel {impl.qualname} from {impl.source or '<unknown>'} {failure}; it is "
                                          "refused (PLYX_KERNELS_VERIFY=0 skips the check)")
                self._verified[key] = failure
        return self._verified[key]

    def _decide(self, name: str, query: KernelQuery, overrides: Mapping[str, tuple[str, str]], *, warn: bool,
                explaining: bool = False) -> list[Candidate]:
        impls = self.implementations(name)
        forced, where = overrides.get(name, (None, ""))
        if forced is not None and not explaining and forced in self._impls[name]:
            forced_impl = self._impls[name][forced]
            if self._refusal(forced_impl, query) is None:
                # the override decides: evaluating the others would only run their conformance probes
                return [Candidate(forced_impl, True, f"forced by {where}")]
        refusals = {i.impl: self._refusal(i, query) for i in impls}
        chosen: KernelImpl | None = None
        forced_note = ""
        if forced is not None:
            if forced not in refusals:
                raise KernelNotFoundError(self._missing_impl(name, forced) + f"; named by {where}")
            if refusals[forced] is None:
                chosen = self._impls[name][forced]
            else:
                problem = (f"kernel {name}: {where} forces {forced!r}, which refuses "
                           f"{_describe(query)}: {refusals[forced]}")
                if self.strict and not explaining:
                    raise KernelUnavailableError(problem + "; remove the override or run where its predicates hold "
                                                 "(strict mode does not fall back)")
                forced_note = f"; {where} forced {forced!r} but it refuses this query" + (
                    " (strict mode would raise)" if self.strict else "")
                if warn:
                    warnings.warn(problem + "; falling back to the best accepted implementation "
                                  "(set KernelConfig.strict or PLYX_KERNELS_STRICT=1 to raise)",
                                  KernelFallbackWarning, stacklevel=4)
        if chosen is None:
            chosen = next((i for i in impls if refusals[i.impl] is None), None)
        if chosen is None and not explaining:
            lines = "; ".join(f"{i.impl}: {refusals[i.impl]}" for i in impls)
            raise KernelUnavailableError(f"no implementation of kernel {name!r} accepts {_describe(query)} ({lines})")
        out = []
        for impl in impls:
            refusal = refusals[impl.impl]
            if chosen is not None and impl.impl == chosen.impl:
                why = (f"forced by {where}" if forced == impl.impl else f"highest priority ({impl.priority}) among accepted")
                out.append(Candidate(impl, True, why + forced_note))
            elif refusal is not None:
                out.append(Candidate(impl, False, f"refused: {refusal}"))
            elif forced is not None and forced == (chosen.impl if chosen else None):
                out.append(Candidate(impl, False, f"accepted, but {where} forces {forced!r}"))
            else:
                out.append(Candidate(impl, False, f"accepted, lower priority ({impl.priority}) than {chosen.impl if chosen else '?'}"))
        return out


def _warn_at_kernel(impl: KernelImpl, message: str) -> None:
    """A ``KernelConformanceWarning`` pointing at the refused kernel's own code (the plugin's), not at the registry."""
    import sys

    from plyx.specs.plugins import warn_at

    code = getattr(getattr(impl.fn, "__wrapped__", impl.fn), "__code__", None)
    if code is None:
        warnings.warn(message, KernelConformanceWarning, stacklevel=2)
        return
    module = sys.modules.get(getattr(impl.fn, "__module__", "") or "")
    warn_at(message, (code.co_filename, code.co_firstlineno, vars(module) if module is not None else None),
            KernelConformanceWarning)


def probe(impl: KernelImpl, device: str, dtype: str, grad: bool, *, budget_ms: float | None = None) -> str | None:
    """Check ``impl`` with every conformance case of its name inside its capability; None when it passes.

    Args:
        impl: the implementation (its capability decides which cases apply).
        device: device type the inputs are made on; dtype: the dtype under test.
        grad: also check gradients.
        budget_ms: stop starting cases after this long (default ``PLYX_KERNELS_VERIFY_BUDGET_MS`` or 3000 ms).

    Returns:
        None, or why the implementation is refused ("failed conformance: ...", "not checked: ...").
    """
    from plyx.specs.testing.kernels import KERNEL_CASES, UNIT_ROUNDOFF, check_kernel

    if impl.name not in KERNEL_CASES:
        return (f"not checked: kernel {impl.name!r} has no conformance cases (a plugin that introduces a kernel "
                f"name gives it cases with plyx.specs.testing.kernels.add_cases)")
    if dtype not in UNIT_ROUNDOFF:
        return f"not checked: the conformance kit has no error model for dtype {dtype}"
    if budget_ms is None:
        budget_ms = float(os.environ.get("PLYX_KERNELS_VERIFY_BUDGET_MS", "") or VERIFY_BUDGET_MS)

    def inside(args: list[Any], kwargs: dict[str, Any]) -> str | None:
        sized = query_for(impl.name, *[a for a in args if hasattr(a, "shape")])
        return impl.capability.refusal(KernelQuery(device_type=device, dtype=dtype,
                                                   compute_capability=sized.compute_capability,
                                                   shape=sized.shape, requires_grad=grad))

    report = check_kernel(impl.name, impl.fn, impl=impl.impl, device=device, dtypes=(dtype,), grad=grad,
                          case_filter=inside, budget_ms=budget_ms)
    if report.failures:
        return f"failed conformance: {report.failures[0]}" + (
            f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else "")
    if not report.checked:
        return (f"not checked: none of the {len(KERNEL_CASES[impl.name])} conformance case(s) of {impl.name} lies "
                f"inside its declared capability")
    return None


def _evolve(impl: KernelImpl, **changes: Any) -> KernelImpl:
    import attrs

    return attrs.evolve(impl, **changes)


def _describe(query: KernelQuery) -> str:
    parts = [query.device_type, query.dtype]
    if query.compute_capability:
        parts.append(f"sm{query.compute_capability[0]}{query.compute_capability[1]}")
    parts += [f"{k}={v}" for k, v in sorted(query.shape.items())]
    if query.requires_grad:
        parts.append("with grad")
    return " ".join(parts)


_is_compiling: Callable[[], bool] | None = None


def _tracing() -> bool:
    """True inside torch.compile / torch.export tracing (on get's hot path: the lookup is bound once)."""
    global _is_compiling
    if _is_compiling is None:
        import torch

        _is_compiling = torch.compiler.is_compiling
    return bool(_is_compiling())


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _device_of(query: KernelQuery) -> str:
    return query.device_type


_CAPABILITIES: dict[Any, tuple[int, int]] = {}


def _capability(device: Any) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else _current_cuda()
    if index not in _CAPABILITIES:
        import torch

        _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))  # type: ignore[assignment]
    return _CAPABILITIES[index]


def _current_cuda() -> int:
    import torch

    return torch.cuda.current_device()


def default_sizes(name: str, tensors: tuple[Any, ...]) -> dict[str, int]:
    """The named sizes predicates look at, read off a kernel's positional tensors."""
    t = [x for x in tensors if hasattr(x, "shape")]
    if not t or not t[0].dim():
        return {}
    last = int(t[0].shape[-1])
    if name == "paged_attention_quant":  # (q, k_pool, ...): the pools' storage picks the implementation
        fp8 = len(t) > 1 and str(getattr(t[1], "dtype", "")) == "torch.float8_e4m3fn"
        return {"head_dim": last, "fp8": int(fp8)}
    if name in ("rope", "rope_qk") or name.endswith("attention"):
        return {"head_dim": last}
    if name == "cross_entropy":
        return {"vocab": last}
    if name == "linear_cross_entropy" and len(t) > 1:
        return {"hidden": last, "vocab": int(t[1].shape[0])}
    if name == "matmul" and len(t) > 1 and t[1].dim() == 2:
        return {"m": int(t[0].numel() // max(last, 1)), "k": last, "n": int(t[1].shape[-1])}
    return {"hidden": last}


def query_for(name: str, *tensors: Any, **shape: int) -> KernelQuery:
    """The ``KernelQuery`` for tensors: device and dtype of the first, grad if any needs one.

    Every tensor must live on the first one's device; sizes not given in
    ``shape`` are read off the tensors (``default_sizes``).
    """
    if not tensors:
        raise KernelUnavailableError(f"kernel {name}: get() needs at least one tensor to choose for its device and dtype, "
                                     f"e.g. registry().get({name!r}, x)")
    import torch

    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"kernel {name}: get() takes tensors, got {type(first).__name__} as the first argument")
    for i, t in enumerate(tensors[1:], start=1):
        if isinstance(t, torch.Tensor) and t.device != first.device:
            from plyx.kernel._errors import KernelInputError

            raise KernelInputError(name, f"tensors[{i}]", f"is on {t.device} but tensors[0] is on {first.device}",
                                   f"move it with `.to({str(first.device)!r})`")
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    sizes = {**default_sizes(name, tensors), **shape}
    return KernelQuery(
        device_type=first.device.type,
        dtype=dtype_name(first.dtype),
        compute_capability=_capability(first.device),
        shape=sizes,
        requires_grad=grad,
    )
