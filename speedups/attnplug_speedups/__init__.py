"""attnplug-speedups: the skeleton's per-layer check compiled (``PagedBackend._forward``, docs/performance.md).

An optional accelerator with no behaviour of its own: ``layer_ok`` answers ``True`` only when the skeleton's
Python per-layer check of a planned layer would pass (two write counters unchanged since
``init_forward_metadata``; q, k and v exact ``torch.Tensor`` objects of the expected ``[tokens, heads, dim]``,
dtype and device type) and ``False`` whenever it cannot tell, so the Python check decides every other call.
``attnplug.paged`` uses it when this package imports and ``ATTNPLUG_SPEEDUPS`` is not ``0``; ``attnplug doctor``
says which. Built at install against torch's headers (a C++ compiler is needed, as for attnplug-cpu-fused).
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libc10 and libtorch, which the extension links against)

from ._C import expectation, layer_ok

__all__ = ["expectation", "layer_ok"]
