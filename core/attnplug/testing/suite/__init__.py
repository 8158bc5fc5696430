"""The attnplug conformance suite (collected only by ``pytest --backend=<name>``).

``cases`` generates the cases from a backend's declared capabilities (pure
data); ``harness`` builds problems and checks answers against
``attnplug.testing.reference``; the ``test_*`` modules are the cases.
See ``docs/conformance.md``.
"""

#: a namespace of modules (each imported by name, so importing the package loads no torch)
__all__: list[str] = []
