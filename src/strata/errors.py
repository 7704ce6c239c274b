"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class StrataError(Exception):
    """Bad input: a file, tensor, key, field or argument that is not what was expected. `param` names the
    request field at fault, where one is (the server reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ArtifactError(StrataError):
    """A DFlash drafter artifact (GGUF or Hugging Face folder) that fails validation."""
