"""The one error every tokenizer source raises."""


class TokenizerError(ValueError):
    """The tokenizer cannot be built from the given file or folder."""
