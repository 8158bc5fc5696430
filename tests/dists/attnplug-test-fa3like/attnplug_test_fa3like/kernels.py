"""Kernel module of the fa3-like test plugin (imported only when a backend is built)."""

from attnplug import AttentionBackend

BUILT = []  # lets a test prove this module was imported only at build time


class RecordingBackend(AttentionBackend):
    def __init__(self, tag):
        self.tag = tag
        self.calls = []

    def init_forward_metadata(self, batch):
        self.calls.append(("init", batch.forward_mode.value))

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        self.calls.append(("extend", batch.forward_mode.value))
        return self.tag

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        self.calls.append(("decode", batch.forward_mode.value))
        return self.tag


def make_fa3(ctx):
    BUILT.append("fake_fa3")
    return "fake_fa3", RecordingBackend("fake_fa3")


def make_flashinfer(ctx):
    BUILT.append("fake_flashinfer")
    return "fake_flashinfer", RecordingBackend("fake_flashinfer")
