"""The one error type users see: a message that names the file and the field, never a traceback."""


class DFlashError(Exception):
    """A user-facing failure. The CLI prints ``str(err)`` and exits non-zero, without a traceback."""

    exit_code = 2


class SpecError(DFlashError):
    """The spec file is malformed or inconsistent (names the file and the field path)."""


class StaleArtifact(DFlashError):
    """An input artifact is missing, tampered with, or made from different inputs."""


class EnvDrift(DFlashError):
    """The live environment differs from the pinned one."""


class PoisonedProcess(DFlashError):
    """torch's process-global tracing flags were found set where they must be clear."""

    exit_code = 3
