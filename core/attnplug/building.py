"""Building a backend: ``build`` (the only place a backend is constructed), ``build_pair`` and the
check of what a factory returned.

``build`` reads the host's frozen view for the name, availability and library floor, asks the support
query (``attnplug.support``) whether the backend claims the build context (device, dtypes, layout,
head dims, layers on this host, the kernel library's floor), runs the factory as plugin code
(``isolation``), validates its ``(effective_name, backend)`` (a name of another distribution only
through ``delegates_to``) and writes the stamps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend import AttentionBackend
from .descriptor import BackendDescriptor
from .errors import AttnplugError, BackendUnavailableError, NotSupportedError, PluginError
from .isolation import call_plugin, echo_output
from .stamps import stamp
from .support import SupportQuery
from .support import reasons as support_reasons_of

if TYPE_CHECKING:
    from .registry import Registry


def build_problems(desc: BackendDescriptor, ctx: Any) -> list[str]:
    """Why ``desc`` cannot serve the build context ``ctx``: the support query's reasons (dtype,
    KV-cache dtype, KV layout, page size, device, head dims, the layers on this host, the
    library floor)."""
    floor = desc.library_floor_problem(ctx.host)
    query = SupportQuery.from_context(ctx, floor_problem=floor).replace(backend=desc.name)
    return support_reasons_of(query, desc.capabilities)


def build(registry: "Registry", name: str, ctx: Any) -> tuple[str, AttentionBackend]:
    """Build backend ``name`` for ``ctx``; returns the stamped ``(effective_name, backend)``.

    Refuses with ``NotSupportedError`` (the support query's reasons) when ``ctx`` asks for what
    the backend does not claim, or its kernel library is older than its floor.
    """
    host = ctx.host
    canonical = registry.canonical(name, host)
    desc = registry.get(canonical)
    avail = registry.availability(canonical, host)
    if not avail:
        others = [n for n in registry.available_names(host) if n != canonical]
        raise BackendUnavailableError(canonical, avail.reasons, f"Available here: {', '.join(others) or 'none'}")
    problems = build_problems(desc, ctx)
    if problems:
        claim = "its declared capabilities do not claim it" if problems[-1] != desc.library_floor_problem(host) \
            else "its declared capabilities or its kernel library's floor refuse it"
        raise NotSupportedError(canonical, problems, what=f"the build context it was asked for ({claim})")
    what = f"loading factory {desc.factory!r} of backend {canonical!r}"
    factory, out = call_plugin(desc.distribution, what, desc.load_factory)
    echo_output(desc.distribution, what, out)
    what = f"factory of backend {canonical!r}"
    try:
        result, out = call_plugin(desc.distribution, what, factory, ctx)
    except PluginError as exc:
        if isinstance(exc.__cause__, AttnplugError) and not isinstance(exc.__cause__, PluginError):
            raise exc.__cause__ from None  # already names what is at fault (e.g. NotSupportedError)
        raise
    echo_output(desc.distribution, what, out)
    effective, backend = validate_factory_result(registry, result, desc)
    stamp(backend, effective)
    if getattr(backend, "ctx", None) is None:
        try:  # what it was built for: not_supported_reasons(layer) answers for it
            backend.ctx = ctx
        except AttributeError:  # pragma: no cover - a backend with __slots__ or a read-only ctx
            pass
    return effective, backend


def validate_factory_result(registry: "Registry", result: Any, desc: BackendDescriptor) -> tuple[str, AttentionBackend]:
    """Check a factory's ``(effective_name, backend)``; ``PluginError`` naming the distribution otherwise."""
    where = f"factory of backend {desc.name!r} returned"
    if result is None:
        raise PluginError(desc.distribution, f"{where} None; it must return (effective_name, backend)")
    if isinstance(result, AttentionBackend):
        raise PluginError(
            desc.distribution,
            f"{where} a bare {type(result).__name__}; it must return (effective_name, backend)",
        )
    if not isinstance(result, tuple) or len(result) != 2:
        raise PluginError(desc.distribution, f"{where} {result!r}; it must return (effective_name, backend)")
    effective, backend = result
    if not isinstance(effective, str):
        raise PluginError(desc.distribution, f"{where} effective name {effective!r}; it must be a str")
    if effective in registry._aliases:
        raise PluginError(
            desc.distribution,
            f"{where} the alias {effective!r} as its effective name; return the canonical name "
            f"{registry._aliases[effective][0]!r}",
        )
    if effective not in registry.descriptors:
        raise PluginError(
            desc.distribution,
            f"{where} effective name {effective!r}, which is not a registered backend "
            f"(registered: {', '.join(registry.names())})",
        )
    owner = registry.descriptors[effective].distribution
    if owner != desc.distribution and effective not in desc.delegates_to:
        raise PluginError(
            desc.distribution,
            f"{where} effective name {effective!r}, which belongs to distribution {owner!r}; a factory "
            f"answers a name of its own distribution, or one it declares in BackendDescriptor.delegates_to",
        )
    if not isinstance(backend, AttentionBackend):
        raise PluginError(
            desc.distribution,
            f"{where} ({effective!r}, {type(backend).__name__}); the backend must subclass "
            f"attnplug.AttentionBackend",
        )
    return effective, backend


def build_pair(registry: "Registry", ctx: Any) -> AttentionBackend:
    """Build the backend serving ``ctx.config``'s resolved pair: one backend, or a
    ``HybridBackend`` when the halves differ."""
    from .hybrid import HybridBackend

    prefill, decode = ctx.config.attention_backends()
    if prefill is None or decode is None:
        raise AttnplugError(
            f"the attention pair is not resolved (prefill={prefill!r}, decode={decode!r}); "
            f"run attnplug.resolve(config) first or set --attention-backend"
        )
    host = ctx.host
    p, d = registry.canonical(prefill, host), registry.canonical(decode, host)
    _, pb = build(registry, p, ctx)
    if p == d:
        return pb
    _, db = build(registry, d, ctx)
    return HybridBackend(pb, db, ctx.config.speculative_attention_mode)
