"""Test plugin that misbehaves in the one way ``ATTNPLUG_TEST_HOSTILE`` names.

Unset, it is well behaved: it registers ``hostile_ok`` (any dtype, CPU).
Each mode below is one failure class of ``docs/reliability.md``; the tests in
``tests/fast/test_hostile_plugins.py`` set the mode and check that only this
plugin is set aside, with a message naming its distribution.
"""

import os
import sys
import time

from attnplug import BackendDescriptor, Capabilities, hookimpl

MODE = os.environ.get("ATTNPLUG_TEST_HOSTILE", "")
#: how many times each hook ran in this process (the once-per-process test reads it)
CALLS = {"attnplug_register_backends": 0}

if MODE == "import_systemexit":
    raise SystemExit(3)
if MODE == "import_keyboardinterrupt":
    raise KeyboardInterrupt
if MODE == "import_print":
    print("hello from a plugin at import")
if MODE == "import_sleep":  # the test sends a real SIGINT while this sleeps
    sys.stderr.write("hostile: ready\n")
    sys.stderr.flush()
    time.sleep(60)

CAPS = Capabilities(devices=("cpu",))
FACTORY = "attnplug_test_hostile.kernel:make"


def _descriptors():
    if MODE == "conflict_torch_native":  # the name attnplug-torch-native registers: neither keeps it
        return [BackendDescriptor(name="torch_native", factory=FACTORY, capabilities=CAPS, priority={"cpu": 1})]
    kw = dict(name="hostile_ok", factory=FACTORY, capabilities=CAPS, priority={"cpu": 1})
    if MODE == "priority_str":
        kw["priority"] = {"cpu": "high"}
    elif MODE == "priority_raises":
        kw["priority"] = lambda host: 1 / 0
    elif MODE == "priority_fn_str":
        kw["priority"] = lambda host: "high"
    elif MODE == "caps_dict":
        kw["capabilities"] = {"dtypes": ("float32",)}
    elif MODE == "caps_bool_str":
        kw["capabilities"] = Capabilities(devices=("cpu",), sliding_window="yes")
    elif MODE == "probe_str":
        kw["probe"] = lambda host: "needs"
    elif MODE == "probe_raises_systemexit":
        kw["probe"] = lambda host: sys.exit(4)
    elif MODE == "aliases_str":
        kw["aliases"] = "xyz"
    elif MODE in ("claims_other", "delegates"):
        kw["factory"] = "attnplug_test_hostile.kernel:make_claims_other"
        if MODE == "delegates":
            kw["delegates_to"] = ("fake_triton",)
    elif MODE == "factory_systemexit":
        kw["factory"] = "attnplug_test_hostile.kernel:make_exits"
    elif MODE == "factory_keyboardinterrupt":
        kw["factory"] = "attnplug_test_hostile.kernel:make_interrupts"
    return [BackendDescriptor(**kw)]


@hookimpl
def attnplug_register_backends(register):
    CALLS["attnplug_register_backends"] += 1
    if MODE == "count":
        time.sleep(0.3)  # widen the window in which a second discovery could start
    if MODE == "hook_print":
        print("hello from a register hook")
    if MODE == "hook_systemexit":
        raise SystemExit(5)
    for d in _descriptors():
        register(d)


@hookimpl
def attnplug_arch_overrides(register):
    if MODE == "override_list":
        register("HostileForCausalLM", lambda host, config: ["attention_backend", "hostile_ok"], name="as_a_list")
    if MODE == "override_raises":
        register("HostileForCausalLM", lambda host, config: sys.exit(12), name="exits")
    if MODE == "override_arch_int":
        register(7, lambda host, config: {})


@hookimpl
def attnplug_resolution_rules(register):
    if MODE == "rule_bad_stage":
        register("hostile_rule", "sideways", lambda host, config, registry: {})
    if MODE == "rule_returns_str":
        register("hostile_rule", "fallback", lambda host, config, registry: "attention_backend=hostile_ok")
    if MODE == "rule_unknown_field":
        register("hostile_rule", "force", lambda host, config, registry: {"no_such_field": 1})


@hookimpl
def attnplug_check_config(config, host):
    if MODE == "check_config_str":
        return "this is one problem, not one per character"
    if MODE == "check_config_dict":
        return {"problem": "x"}
    if MODE == "check_config_systemexit":
        sys.exit(13)
    if MODE == "check_config_print":
        print("chatter from check_config")
    return None
