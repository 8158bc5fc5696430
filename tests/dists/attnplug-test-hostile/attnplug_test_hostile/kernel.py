"""Kernel module of the hostile test plugin (imported only at build)."""

import sys

from attnplug import AttentionBackend


class Hostile(AttentionBackend):
    def init_forward_metadata(self, batch):
        pass

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return "hostile"

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        return "hostile"


def make(ctx):
    return "hostile_ok", Hostile()


def make_claims_other(ctx):
    return "fake_triton", Hostile()  # a name attnplug-test-other owns


def make_exits(ctx):
    sys.exit(9)


def make_interrupts(ctx):
    raise KeyboardInterrupt
