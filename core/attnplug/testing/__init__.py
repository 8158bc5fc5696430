"""Testing support shipped with the core: the float64 reference and the conformance suite."""

#: a namespace of modules (each imported by name, so importing the package loads no torch)
__all__: list[str] = []
