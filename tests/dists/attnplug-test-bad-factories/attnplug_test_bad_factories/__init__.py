"""Test plugin whose factories break the ``(effective_name, backend)`` contract, one way each."""

from attnplug import AttentionBackend, BackendDescriptor, hookimpl


class Tiny(AttentionBackend):
    def init_forward_metadata(self, batch):
        pass

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return "tiny"

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        return "tiny"


FACTORIES = {
    "bad_alias": lambda ctx: ("bad_alias_name", Tiny()),
    "bad_bare": lambda ctx: Tiny(),
    "bad_none": lambda ctx: None,
    "bad_unregistered": lambda ctx: ("no_such_backend", Tiny()),
    "bad_not_backend": lambda ctx: ("bad_not_backend", object()),
    "bad_raises": lambda ctx: 1 / 0,
    "good_other_name": lambda ctx: ("bad_none", Tiny()),  # a constructor may build another registered name
}


@hookimpl
def attnplug_register_backends(register):
    for name, factory in FACTORIES.items():
        aliases = ("bad_alias_name",) if name == "bad_alias" else ()
        register(BackendDescriptor(name=name, factory=factory, aliases=aliases))
