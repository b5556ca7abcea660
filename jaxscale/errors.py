"""The one error type for bad user input."""


class ConfigError(ValueError):
    """Bad input: one line naming the field, the value and the fix.

    The CLI prints ``str(error)`` on stderr and exits with code 2.
    """

    def __init__(self, field: str, value, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{field}={value!r}: {fix}")


class RunError(RuntimeError):
    """A failure during a run that the user can act on (a full disk, a checkpoint that cannot
    be written): the CLI prints ``str(error)`` as one line and exits with code 1."""
