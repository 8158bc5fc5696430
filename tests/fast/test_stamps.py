"""Stamps: written by the registry, carried by containers' children and by wrappers."""

from __future__ import annotations

from attnplug import AttentionBackend, BackendWrapper
from attnplug.stamps import copy_stamps, stamp
from attnplug.stamps import stamps_of


class Leaf(AttentionBackend):
    pass


class Container(AttentionBackend):
    stamps_children = True

    def __init__(self, n):
        self.steps = [Leaf() for _ in range(n)]

    def children(self):
        return tuple(self.steps)


class NonStampingContainer(Container):
    stamps_children = False


def test_stamp_writes_both_fields():
    b = Leaf()
    stamp(b, "fa3")
    assert stamps_of(b) == ("fa3", "fa3")
    stamp(b, "fa3", "flashinfer")
    assert stamps_of(b) == ("fa3", "flashinfer")


def test_container_declaring_stamps_children_gets_every_child_stamped():
    c = Container(3)
    stamp(c, "triton")
    assert [stamps_of(s) for s in c.steps] == [("triton", "triton")] * 3


def test_container_not_declaring_it_leaves_children_alone():
    c = NonStampingContainer(2)
    stamp(c, "triton")
    assert [stamps_of(s) for s in c.steps] == [(None, None)] * 2


def test_nested_containers_are_stamped_recursively():
    outer = Container(0)
    outer.steps = [Container(2), Leaf()]
    stamp(outer, "fa3")
    assert stamps_of(outer.steps[0].steps[1]) == ("fa3", "fa3")


def test_wrapper_carries_inner_stamps():
    inner = Leaf()
    stamp(inner, "trtllm_mha", "fa3")
    w = BackendWrapper(inner)
    assert stamps_of(w) == ("trtllm_mha", "fa3")


def test_copy_stamps_copies_not_shares():
    a, b = Leaf(), Leaf()
    stamp(a, "x")
    copy_stamps(a, b)
    stamp(a, "y")
    assert stamps_of(b) == ("x", "x")
