"""KV-cache layouts: how one layer's K and V are arranged in memory.

Every backend reads the cache through a layout it declares
(``Capabilities.kv_layouts``). The cache (``PagedKVCache``) allocates its
storage through one ``KVLayout`` and offers two layout-independent accessors
that the host, the reference, the suite and doctor use: ``read_kv`` (any slots,
token-major copies) and ``set_kv`` (writes). A backend that owns a layout may
reach its raw storage with ``PagedKVCache.layer_storage``.

Slots are the same in every layout: slot ``s`` is offset ``s % page_size`` of
page ``s // page_size``; ``req_to_token`` maps positions to slots. Only where a
slot's K and V live in memory differs.

The core defines two layouts; a plugin defines more by naming a ``KVLayout``
subclass in ``BackendDescriptor.kv_layout_factories`` (imported only when a cache is
allocated in it, so the descriptor stays light):

* ``nhd`` (the default): K ``[num_slots, num_kv_heads, head_dim]`` and V
  ``[num_slots, num_kv_heads, v_head_dim]`` per layer, token-major; a page-major
  ``[num_pages, page_size, heads, dim]`` view is free (what FlashInfer and FA3 read).
* ``hnd``: K ``[num_pages, num_kv_heads, page_size, head_dim]`` (and V alike),
  head-major within a page (what TensorRT-LLM's kernels read).

Adopting memory a host engine allocated (``KVLayout.wrap``, used by
``PagedKVCache(..., buffers=...)``): the engine hands one contiguous buffer per
layer holding exactly ``geometry.kv_numel`` elements in the cache dtype (vLLM's
per-layer ``[blocks, kv_heads, block_size, head_dim + v_head_dim]`` tensor is one),
and the layout returns its storage as **views** of that buffer: no copy, and
writes through the layout are writes into the engine's memory. The default
carves the buffer into the tensors ``allocate`` would make, in order (K first,
then V: every whole page of K and V maps to a fixed region, so engines that
share one buffer between layers with disjoint pages stay disjoint); a layout
whose storage holds more (a side table) overrides ``wrap``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the methods that need it: the registry reads this module's names
    import torch

__all__ = [
    "BUILTIN_LAYOUTS", "HND", "NHD", "HNDLayout", "KVGeometry", "KVLayout", "NHDLayout", "builtin_layout",
    "check_layout", "check_wrap_buffer",
]

#: the layout every backend reads unless it declares otherwise
NHD = "nhd"
#: head-major pages: ``[num_pages, num_kv_heads, page_size, dim]``
HND = "hnd"


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """The shape of a cache, as a layout sees it."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def kv_numel(self) -> int:
        """Elements of one layer's K and V together: what a buffer given to ``KVLayout.wrap`` holds."""
        return self.num_slots * self.num_kv_heads * (self.head_dim + self.v_head_dim)


class KVLayout:
    """How one layer's K and V live in memory. Subclass it to define a layout.

    A layout is stateless (one instance may serve many caches). ``k``/``v``
    passed to ``write`` are already in the cache dtype; ``read`` returns new
    token-major tensors ``[n, num_kv_heads, head_dim]`` / ``[n, num_kv_heads,
    v_head_dim]`` and never views of the storage. Slots given to ``read`` and
    ``write`` are checked by the cache before the call (in range, integer).
    """

    #: the name backends declare in ``Capabilities.kv_layouts``
    name: str = ""
    #: one line for ``attnplug list`` and docs
    description: str = ""

    def geometry_reasons(self, geometry: KVGeometry) -> list[str]:
        """Why this layout cannot hold a cache of ``geometry`` (page size, head-dim rules); empty when it can."""
        return []

    def allocate(self, geometry: KVGeometry, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The zero-filled storage of one layer."""
        raise NotImplementedError

    def wrap(self, geometry: KVGeometry, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One layer's storage as views of ``buffer``, memory a host engine allocated (no copy).

        ``buffer`` is contiguous and holds exactly ``geometry.kv_numel`` elements in the cache dtype
        (any shape). Default: the tensors ``allocate`` makes (shapes taken on the ``meta`` device),
        carved from ``buffer`` in order. A layout whose ``allocate`` makes a tensor of another dtype
        (a side table) overrides this. Errors name the layout, the expected and the actual value.
        """
        import torch

        check_wrap_buffer(self.name, geometry, buffer)
        flat = buffer.reshape(-1)
        views, at = [], 0
        for t in self.allocate(geometry, buffer.dtype, torch.device("meta")):
            if t.dtype != buffer.dtype:
                raise NotImplementedError(
                    f"layout {self.name!r}: allocate makes a {t.dtype} tensor beside the {buffer.dtype} K/V; "
                    f"override KVLayout.wrap to adopt an engine's buffer")
            views.append(flat[at:at + t.numel()].view(t.shape))
            at += t.numel()
        if at != flat.numel():
            raise ValueError(f"layout {self.name!r}: allocate makes {at} elements per layer, but "
                             f"geometry.kv_numel={flat.numel()}; override KVLayout.wrap")
        return tuple(views)

    def read(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (int64 ``[n]``), token-major, as new tensors."""
        raise NotImplementedError

    def write(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (token-major, cache dtype) at ``slots`` (int64 ``[n]``)."""
        raise NotImplementedError

    def page_snapshot(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
                      slots: torch.Tensor) -> Any | None:
        """Optional: a copy of the whole pages holding ``slots``, for a staged write to undo itself with
        ``restore_pages`` (a write changes nothing outside the slots it writes, so putting whole pages back
        restores exactly the rows it replaced). A layout whose pages are contiguous blocks can copy them far
        faster than it gathers a long prefill's scattered rows. ``None`` (the default, and a layout's
        answer where per-row ``read`` is cheaper): the skeleton snapshots the rows with ``read``."""
        return None

    def restore_pages(self, storage: tuple[torch.Tensor, ...], snapshot: Any) -> None:
        """Put back what ``page_snapshot`` copied (only called with a snapshot it returned)."""
        raise NotImplementedError(f"layout {self.name!r}: page_snapshot returned a snapshot but restore_pages "
                                  f"is not defined")

    def __repr__(self) -> str:
        return f"<KVLayout {self.name!r}>"


class NHDLayout(KVLayout):
    """Token-major slots: K ``[num_slots, kv_heads, head_dim]``, V ``[num_slots, kv_heads, v_head_dim]``."""

    name = NHD
    description = "token-major slots [num_slots, kv_heads, dim] (page-major NHD as a free view)"

    def allocate(self, geometry: KVGeometry, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        import torch

        g = geometry
        return (torch.zeros(g.num_slots, g.num_kv_heads, g.head_dim, dtype=dtype, device=device),
                torch.zeros(g.num_slots, g.num_kv_heads, g.v_head_dim, dtype=dtype, device=device))

    def read(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = storage
        return kb.index_select(0, slots), vb.index_select(0, slots)

    def write(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        kb, vb = storage
        kb[slots] = k
        vb[slots] = v


class HNDLayout(KVLayout):
    """Head-major pages: K ``[num_pages, kv_heads, page_size, head_dim]`` (V alike with ``v_head_dim``)."""

    name = HND
    description = "head-major pages [num_pages, kv_heads, page_size, dim]"

    def allocate(self, geometry: KVGeometry, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        import torch

        g = geometry
        return (torch.zeros(g.num_pages, g.num_kv_heads, g.page_size, g.head_dim, dtype=dtype, device=device),
                torch.zeros(g.num_pages, g.num_kv_heads, g.page_size, g.v_head_dim, dtype=dtype, device=device))

    def read(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ps = geometry.page_size
        page, off = slots.div(ps, rounding_mode="floor"), slots % ps
        return tuple(buf[page, :, off] for buf in storage)  # type: ignore[return-value]

    def write(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        ps = geometry.page_size
        page, off = slots.div(ps, rounding_mode="floor"), slots % ps
        kb, vb = storage
        kb[page, :, off] = k
        vb[page, :, off] = v


def check_wrap_buffer(layout: str, geometry: KVGeometry, buffer: Any) -> None:
    """``buffer`` can be adopted as one layer of ``geometry``: a contiguous tensor of ``kv_numel`` elements."""
    import torch

    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"layout {layout!r}: buffer is {type(buffer).__name__}, expected a torch.Tensor")
    if buffer.numel() != geometry.kv_numel:
        raise ValueError(
            f"layout {layout!r}: buffer has {buffer.numel()} elements (shape {tuple(buffer.shape)}), expected "
            f"kv_numel={geometry.kv_numel} = {geometry.num_pages} pages x {geometry.page_size} slots x "
            f"{geometry.num_kv_heads} kv heads x ({geometry.head_dim} + {geometry.v_head_dim})")
    if not buffer.is_contiguous():
        raise ValueError(f"layout {layout!r}: buffer of shape {tuple(buffer.shape)} and strides "
                         f"{tuple(buffer.stride())} is not contiguous; a layout adopts contiguous memory only")


#: the layouts the core defines, by name
BUILTIN_LAYOUTS: dict[str, type[KVLayout]] = {NHD: NHDLayout, HND: HNDLayout}


def builtin_layout(name: str) -> KVLayout:
    """The core's layout called ``name``; a ``ValueError`` listing the core's layouts otherwise."""
    try:
        return BUILTIN_LAYOUTS[name]()
    except KeyError:
        raise ValueError(
            f"kv layout {name!r} is not one of the core's ({', '.join(BUILTIN_LAYOUTS)}); a plugin's layout "
            f"is built with Registry.kv_layout(name)") from None


def check_layout(layout: Any) -> KVLayout:
    """``layout`` as a ``KVLayout``: a core layout's name, or an instance (a plugin's layout)."""
    if isinstance(layout, str):
        return builtin_layout(layout)
    if isinstance(layout, KVLayout) and isinstance(layout.name, str) and layout.name:
        return layout
    raise ValueError(f"layout={layout!r} (expected a KVLayout instance with a name, or one of "
                     f"{', '.join(BUILTIN_LAYOUTS)})")
