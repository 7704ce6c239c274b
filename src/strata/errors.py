"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class StrataError(Exception):
    """Bad input: a file, tensor, key, field or argument that is not what was expected."""


class ArtifactError(StrataError):
    """A DFlash drafter artifact (GGUF or Hugging Face folder) that fails validation."""
