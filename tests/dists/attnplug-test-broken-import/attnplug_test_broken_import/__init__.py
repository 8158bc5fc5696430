"""Test plugin whose descriptor module fails to import."""

import attnplug_this_module_does_not_exist  # noqa: F401
