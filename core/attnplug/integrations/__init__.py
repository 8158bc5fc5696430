"""Integrations of attnplug into existing model libraries (each imported on purpose).

``attnplug.integrations.transformers``: run a Hugging Face transformers model's
attention through a resolved attnplug backend pair. Importing ``attnplug`` (or
this package) imports neither transformers nor torch.
"""

#: a namespace of modules (each imported by name, so importing the package loads no torch)
__all__: list[str] = []
