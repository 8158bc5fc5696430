"""Speculative decoding: draft backends for a host engine, and model-facing dispatch.

A host with a target runner and a draft runner calls::

    draft = build_draft_backends(registry, draft_ctx, num_steps=k, target_ctx=target_ctx)

and gets, each built through ``registry.build`` and stamped with the name the
constructor that ran answered:

* ``draft.decode``: a :class:`MultiStepDraftBackend`, one child per draft
  step; the host hands ``draft.decode.step(i)`` to the forward context for
  step ``i``;
* ``draft.extend``: the draft-extend backend, wrapped (by default in a
  :class:`SidecarWrapper` that carries a hidden-state buffer) with the inner
  stamps copied;
* ``draft.target_verify``: (when ``target_ctx`` is given) the backend serving
  ``TARGET_VERIFY`` for the target runner: the configured pair's half that
  ``selector`` names for ``speculative_attention_mode``.

The draft's backend is ``config.speculative_draft_attention_backend`` when
set; otherwise the configured pair's half that the selector names for the
mode (decode half for draft decode, prefill half for draft extend, the
``speculative_attention_mode`` half for draft-extend-v2). No mode table and
no rename table exist here: the selector answers halves, the factories answer
names.

Model code calls :func:`kernel_for_forward` with the backend serving the
current forward (from ``attnplug.forward_context``), never a global.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

from . import selector
from .backend import AttentionBackend
from .capabilities import Capabilities
from .errors import AttnplugError, PluginError
from .forward_context import active_frames, current_backend
from .modes import ForwardMode
from .stamps import stamp, stamps_of
from .wrapper import BackendWrapper

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

    from .batch import ForwardBatch
    from .build_context import BuildContext
    from .config import AttentionConfig
    from .layer import LayerSpec
    from .registry import Registry

__all__ = [
    "DraftBackends",
    "MultiStepDraftBackend",
    "SidecarWrapper",
    "build_draft_backends",
    "draft_backend_name",
    "kernel_for_forward",
    "target_verify_backend_name",
]


# -- containers and wrappers ---------------------------------------------------------------


class MultiStepDraftBackend(AttentionBackend):
    """The draft-decode container: one backend per draft step.

    The host hands ``step(i)`` to ``forward_context`` for draft step ``i``; model
    code then talks to that child. ``stamps_children`` makes every child carry
    the container's stamps. The container itself forwards every protocol
    method: hooks without a batch go to every step; hooks with a batch go to the
    step that is active in the current forward context (the host entered
    ``forward_context(container.step(i), batch, runner=...)``).
    """

    stamps_children = True

    def __init__(self, steps: Sequence[AttentionBackend]) -> None:
        steps = tuple(steps)
        if not steps:
            raise ValueError("MultiStepDraftBackend needs at least one step backend")
        for i, s in enumerate(steps):
            if not isinstance(s, AttentionBackend):
                raise TypeError(f"MultiStepDraftBackend step {i} is a {type(s).__name__}, not an AttentionBackend")
        if len({id(s) for s in steps}) != len(steps):
            raise ValueError("MultiStepDraftBackend steps must be distinct backend objects (one per step)")
        self._steps = steps

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self._steps[0].capabilities

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def children(self) -> tuple[AttentionBackend, ...]:
        return self._steps

    def step(self, i: int) -> AttentionBackend:
        """The backend serving draft step ``i`` (0-based)."""
        if not isinstance(i, int) or not 0 <= i < len(self._steps):
            raise IndexError(f"draft step {i!r} out of range: this container has {len(self._steps)} steps")
        return self._steps[i]

    def _active_step(self, method: str) -> AttentionBackend:
        for frame in reversed(active_frames()):
            for s in self._steps:
                if frame.backend is s:
                    return s
        raise AttnplugError(
            f"MultiStepDraftBackend.{method}: no draft step of this container is active; the host enters "
            f"forward_context(container.step(i), batch, runner=...) for step i and calls the step's methods"
        )

    def not_supported_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None = None) -> list[str]:
        out: list[str] = []
        for s in self._steps:
            for r in s.not_supported_reasons(layer, ctx):
                if r not in out:
                    out.append(r)
        return out

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._active_step("init_forward_metadata").init_forward_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._active_step("forward").forward(q, k, v, layer, batch, save_kv_cache)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._active_step("forward_extend").forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._active_step("forward_decode").forward_decode(q, k, v, layer, batch, save_kv_cache)

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        for s in self._steps:
            s.init_cuda_graph_state(max_batch_size, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._active_step("init_forward_metadata_capture_cuda_graph").init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._active_step("init_forward_metadata_replay_cuda_graph").init_forward_metadata_replay_cuda_graph(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        values = [s.get_cuda_graph_seq_len_fill_value() for s in self._steps]
        if len(set(values)) != 1:
            raise AttnplugError(f"MultiStepDraftBackend: steps disagree on the CUDA-graph fill value: {values}")
        return values[0]

    def on_after_cuda_graph_warmup(self) -> None:
        for s in self._steps:
            s.on_after_cuda_graph_warmup()


class SidecarWrapper(BackendWrapper):
    """Wraps the draft-extend backend and keeps a hidden-state buffer beside it.

    EAGLE-style draft heads read the target's hidden states of the accepted
    tokens during draft extend; the host stores them here after verify and
    the draft model takes them back. The buffer belongs to this runner's
    wrapper object: nothing is shared between runners. Every protocol method
    and the inner stamps come from ``BackendWrapper``.
    """

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(inner)
        self.hidden_states: torch.Tensor | None = None

    def set_hidden_states(self, hidden_states: torch.Tensor | None) -> None:
        self.hidden_states = hidden_states

    def take_hidden_states(self) -> torch.Tensor | None:
        """Return the stored hidden states and clear the buffer."""
        hidden, self.hidden_states = self.hidden_states, None
        return hidden


# -- names -------------------------------------------------------------------------------


def draft_backend_name(mode: ForwardMode | str, config: AttentionConfig) -> str:
    """The backend name the draft runner asks the registry for in ``mode``.

    ``config.speculative_draft_attention_backend`` when set; otherwise the
    configured pair's half that the selector names for ``mode``.
    """
    mode = ForwardMode.parse(mode)
    if config.speculative_draft_attention_backend:
        return config.speculative_draft_attention_backend
    name = selector.backend_name_for_mode(mode, config, None)
    if name is None:
        raise AttnplugError(
            f"no draft backend for {mode.value}: speculative_draft_attention_backend is unset and the pair's "
            f"{selector.half_for_mode(mode, config.speculative_attention_mode)} half is not resolved; "
            f"resolve the configuration first or set --speculative-draft-attention-backend"
        )
    return name


def target_verify_backend_name(config: AttentionConfig) -> str:
    """The configured pair's half serving ``TARGET_VERIFY`` (per ``speculative_attention_mode``)."""
    name = selector.backend_name_for_mode(ForwardMode.TARGET_VERIFY, config, None)
    if name is None:
        raise AttnplugError(
            f"no target-verify backend: the pair's "
            f"{selector.half_for_mode(ForwardMode.TARGET_VERIFY, config.speculative_attention_mode)} half is "
            f"not resolved; resolve the configuration first or set --attention-backend"
        )
    return name


# -- building ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class DraftBackends:
    """What ``build_draft_backends`` returns; every backend here is stamped.

    ``decode``: the multi-step draft-decode container. ``extend``: the
    draft-extend backend (wrapped). ``extend_mode``: ``DRAFT_EXTEND`` or
    ``DRAFT_EXTEND_V2``, the mode ``extend`` was chosen for.
    ``target_verify``: the target runner's verify backend, or ``None`` when
    no target context was given. ``requested``: the name asked of the
    registry per role (the stamps hold what was actually built).
    """

    decode: MultiStepDraftBackend
    extend: AttentionBackend
    extend_mode: ForwardMode
    target_verify: AttentionBackend | None = None
    requested: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return self.decode.num_steps

    def step(self, i: int) -> AttentionBackend:
        return self.decode.step(i)

    def stamps(self) -> dict[str, tuple[str | None, str | None]]:
        """Role -> (prefill, decode) stamps; for reports and tests."""
        out = {"decode": stamps_of(self.decode), "extend": stamps_of(self.extend)}
        out.update({f"decode.step{i}": stamps_of(s) for i, s in enumerate(self.decode.children())})
        if self.target_verify is not None:
            out["target_verify"] = stamps_of(self.target_verify)
        return out


def build_draft_backends(
    registry: Registry,
    ctx: BuildContext,
    num_steps: int,
    *,
    target_ctx: BuildContext | None = None,
    extend_mode: ForwardMode | str = ForwardMode.DRAFT_EXTEND,
    wrap_extend: Callable[[AttentionBackend], AttentionBackend] | None = SidecarWrapper,
) -> DraftBackends:
    """Build the draft runner's backends (and the target's verify backend when ``target_ctx`` is given).

    ``ctx``: the draft runner's ``BuildContext`` (its KV cache, its shapes;
    built with ``is_draft=True``). ``num_steps``: draft decode steps.
    ``extend_mode``: ``DRAFT_EXTEND`` (prefill half) or ``DRAFT_EXTEND_V2``
    (the ``speculative_attention_mode`` half). ``wrap_extend``: a wrapper
    class/callable placed around the draft-extend backend (``None``: none);
    it must carry the inner stamps.

    Every leaf comes from ``registry.build`` (which validates the factory's
    ``(effective_name, backend)`` and stamps it); a factory answering an
    alias is a ``PluginError`` naming its distribution.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"build_draft_backends: num_steps={num_steps!r} (expected an integer >= 1)")
    extend_mode = ForwardMode.parse(extend_mode)
    if not extend_mode.is_draft_extend():
        raise ValueError(f"build_draft_backends: extend_mode={extend_mode.value!r} (expected a draft-extend mode)")
    if not ctx.is_draft:
        ctx = ctx.replace(is_draft=True)
    config = ctx.config

    # (a) draft decode: one leaf per step, then the container stamped through its children.
    decode_name = draft_backend_name(ForwardMode.DECODE, config)
    built = [registry.build(decode_name, ctx) for _ in range(num_steps)]
    effective = {name for name, _ in built}
    if len(effective) != 1:
        raise PluginError(
            registry.get(registry.canonical(decode_name, ctx.host)).distribution,
            f"backend {decode_name!r} answered different effective names for the draft steps: {sorted(effective)}",
        )
    container = MultiStepDraftBackend([b for _, b in built])
    stamp(container, effective.pop())

    # (b) draft extend, optionally wrapped; the wrapper must carry the inner stamps.
    extend_name = draft_backend_name(extend_mode, config)
    _, extend_inner = registry.build(extend_name, ctx)
    extend: AttentionBackend = extend_inner
    if wrap_extend is not None:
        extend = wrap_extend(extend_inner)
        if stamps_of(extend) != stamps_of(extend_inner):
            raise AttnplugError(
                f"wrapper {type(extend).__name__} around the draft-extend backend does not carry the inner "
                f"stamps ({stamps_of(extend)} != {stamps_of(extend_inner)}); subclass attnplug.BackendWrapper "
                f"or call attnplug.copy_stamps(inner, wrapper)"
            )

    # (c) target verify: the target pair's half named by the selector.
    requested = {"decode": decode_name, "extend": extend_name}
    target_verify = None
    if target_ctx is not None:
        verify_name = target_verify_backend_name(target_ctx.config)
        _, target_verify = registry.build(verify_name, target_ctx)
        requested["target_verify"] = verify_name

    return DraftBackends(container, extend, extend_mode, target_verify, requested)


# -- model-facing dispatch -------------------------------------------------------------------


def kernel_for_forward(
    mode: ForwardMode | str,
    config: AttentionConfig,
    backend: AttentionBackend | None = None,
    *,
    runner: str | None = None,
) -> str:
    """The kernel name serving ``mode`` in the current forward.

    ``backend``: the backend serving this forward; when omitted, the one the
    host put in the forward context (of ``runner`` when given; outside a
    forward this raises ``NoForwardContextError``). The answer comes from
    ``attnplug.selector.backend_name_for_mode``: the backend's stamps first,
    the configured pair only when that half is unstamped.
    """
    mode = ForwardMode.parse(mode)
    if backend is None:
        backend = current_backend(runner)
    name = selector.backend_name_for_mode(mode, config, backend)
    if name is None:
        raise AttnplugError(
            f"no kernel for {mode.value}: {type(backend).__name__} is unstamped and the configured pair's "
            f"{selector.half_for_mode(mode, config.speculative_attention_mode)} half is not resolved"
        )
    return name
