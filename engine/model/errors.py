"""The error every model-loading step raises, so that callers catch one type."""


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message names the file and what to do."""
