"""The error types for bad user input and failed runs, and the helpers every config check uses."""


class ConfigError(ValueError):
    """Bad input: one line naming the field, the value and the fix.

    The CLI prints ``str(error)`` on stderr and exits with code 2.
    """

    def __init__(self, field: str, value, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{field}={value!r}: {fix}")

    def __reduce__(self):  # so the error crosses process boundaries (prepare's workers) intact
        return type(self), (self.field, self.value, self.fix)


class RunError(RuntimeError):
    """A failure during a run that the user can act on (a full disk, a checkpoint that cannot
    be written): the CLI prints ``str(error)`` as one line and exits with code 1."""


class PreflightError(RunError):
    """A pre-flight check of a multi-process job failed on some process (jaxscale.runtime.preflight): the
    CLI prints it as one line and exits with code 3, before the model compiles."""


def require(ok: bool, field: str, value, fix: str) -> None:
    """Raise ConfigError(field, value, fix) unless `ok`: the one form every config check takes."""
    if not ok:
        raise ConfigError(field, value, fix)


def field_value(config, field: str):
    """The value at a dotted config path such as 'model.moe.num_experts'."""
    node = config
    for key in field.split("."):
        node = node[key]
    return node


def require_positive(config, fields: tuple[str, ...]) -> None:
    """Every dotted field is > 0; the first that is not raises ConfigError."""
    for field in fields:
        require(field_value(config, field) > 0, field, field_value(config, field), "must be > 0")


def require_non_negative(config, fields: tuple[str, ...]) -> None:
    """Every dotted field is >= 0; the first that is not raises ConfigError."""
    for field in fields:
        require(field_value(config, field) >= 0, field, field_value(config, field), "must be >= 0")


def require_choice(field: str, value, choices: tuple[str, ...]) -> None:
    """`value` is one of `choices`; else ConfigError listing them."""
    require(value in choices, field, value, f"choose one of {', '.join(choices)}")
