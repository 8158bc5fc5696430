"""Kernel module of the hostile test plugin (imported only at build).

The built backend misbehaves as ``ATTNPLUG_TEST_HOSTILE`` says (issue 26, items 11 and 12): its
``runtime_notes()``, ``init_forward_metadata`` or ``forward`` raise ``SystemExit`` /
``KeyboardInterrupt``, print, or notes come back as a string or another wrong type. Unset, its forward
returns zeros of the right shape (a wrong answer, but a tensor).
"""

import os
import sys

from attnplug import AttentionBackend

MODE = os.environ.get("ATTNPLUG_TEST_HOSTILE", "")
CALLS = {"forward": 0}


class Hostile(AttentionBackend):
    def init_forward_metadata(self, batch):
        if MODE == "metadata_systemexit":
            raise SystemExit(6)

    def _forward(self, q, layer):
        CALLS["forward"] += 1
        if MODE == "forward_systemexit":
            sys.exit(8)
        if MODE == "forward_keyboardinterrupt":
            raise KeyboardInterrupt
        if MODE == "forward_generatorexit":
            raise GeneratorExit("closed")
        if MODE == "forward_systemexit_later" and CALLS["forward"] > 2:
            sys.exit(10)  # the first calls work: this one stops in bench's timed calls
        if MODE == "forward_print":
            print("chatter from forward")
        return q.new_zeros((q.shape[0], layer.num_heads, layer.v_head_dim))

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return self._forward(q, layer)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        return self._forward(q, layer)

    def runtime_notes(self):
        if MODE == "notes_systemexit":
            raise SystemExit(7)
        if MODE == "notes_keyboardinterrupt":
            raise KeyboardInterrupt
        if MODE == "notes_str":
            return "fused kernel taken"
        if MODE == "notes_int":
            return 42
        if MODE == "notes_items":
            return ["a note", 3]
        if MODE == "notes_print":
            print("chatter from runtime_notes")
            return ["a note"]
        return []


def make(ctx):
    return "hostile_ok", Hostile()


def make_claims_other(ctx):
    return "fake_triton", Hostile()  # a name attnplug-test-other owns


def make_exits(ctx):
    sys.exit(9)


def make_interrupts(ctx):
    raise KeyboardInterrupt
