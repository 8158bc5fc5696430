"""Testing support shipped with the core: the float64 reference and the conformance suite."""
