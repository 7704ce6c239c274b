"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class StrataError(Exception):
    """Bad input: a file, tensor, key, field or argument that is not what was expected. `param` names the
    request field at fault, where one is (the server reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ArtifactError(StrataError):
    """A DFlash drafter artifact (GGUF or Hugging Face folder) that fails validation."""


class SettingError(StrataError):
    """An engine setting that does not fit the model, the drafter or the other settings. The message names
    settings by their EngineConfig fields in braces ("{window} 9: ..."): read as the field names by default,
    and as a front end's own names where it renders them (the CLI's flags: `named(cli.FLAGS)`)."""

    def __init__(self, template: str, param: str | None = None):
        self.template = template
        super().__init__(self.named({}), param)

    def named(self, names: dict[str, str]) -> str:
        return self.template.format_map(_Names(names))


class _Names(dict):
    def __missing__(self, key: str) -> str:
        return key
