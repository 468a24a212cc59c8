"""The runtime's error for a model that cannot load (model.py, session.py)."""


class ModelError(ValueError):
    """A model folder is missing a file, or a file or field in it is wrong."""
