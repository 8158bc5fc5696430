"""Serve a vLLM deployment through attnplug backends (opt-in).

vLLM loads the ``vllm.general_plugins`` entry points in every process it
starts; attnplug's (``attnplug = "attnplug.integrations.vllm:register"``) calls
:func:`register`, which does nothing unless the user asked:

* ``ATTNPLUG_VLLM=1`` (also ``true``/``on``/``yes``) switches it on; unset, empty
  or ``0`` leaves vLLM exactly as it is (nothing is imported, nothing registered);
* ``ATTNPLUG_VLLM_ARGS`` holds attnplug's standard flags (``add_attention_args``:
  ``--attention-backend``, ``--prefill-attention-backend``,
  ``--decode-attention-backend``, ``--kv-layout`` …), shell-quoted; a half left
  unset is filled by resolution for the model's architecture and this host.

When on, :func:`register` overrides vLLM's ``CPU_ATTN`` backend (what vLLM's
CPU platform always selects) and vLLM's ``CUSTOM`` backend (what
``--attention-backend CUSTOM`` selects on a GPU) with
``attnplug.integrations.vllm.backend.AttnplugVllmBackend``: the resolved pair
then serves every attention layer. Importing this package imports neither
vllm nor torch; :func:`register` imports vLLM's registry only when switched on.
"""

from __future__ import annotations

import os

#: the switch (opt-in)
ENV_SWITCH = "ATTNPLUG_VLLM"
#: attnplug's standard attention flags, shell-quoted
ENV_ARGS = "ATTNPLUG_VLLM_ARGS"
#: the class vLLM is told to load for its attention backend
BACKEND_PATH = "attnplug.integrations.vllm.backend.AttnplugVllmBackend"

_ON = {"1", "true", "on", "yes"}
_OFF = {"", "0", "false", "off", "no"}


def enabled(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Whether the user switched the integration on (``ATTNPLUG_VLLM``); a value that is neither on nor
    off is an error naming the variable."""
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV_SWITCH}={value!r} (expected 1 to serve vLLM through attnplug, or 0 / unset)")


def register() -> bool:
    """The ``vllm.general_plugins`` entry point: route vLLM's attention to attnplug when switched on.

    Returns whether it registered. Safe to call more than once (vLLM calls it once per process)."""
    if not enabled():
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _forget_selected_backends()
    return True


def unregister() -> None:
    """Give vLLM its own ``CPU_ATTN`` / ``CUSTOM`` back (for engines built after this call)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM):
        if member.is_overridden() and member.get_path() == BACKEND_PATH:
            member.clear_override()
    _forget_selected_backends()


def _forget_selected_backends() -> None:
    # vLLM memoises the backend class it selected per layer signature; an engine built after a change
    # of registration must select again
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


__all__ = ["BACKEND_PATH", "ENV_ARGS", "ENV_SWITCH", "enabled", "register", "unregister"]
