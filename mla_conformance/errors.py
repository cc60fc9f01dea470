"""Errors that name what the user gave us (a file, a tensor, an option) and say what is wrong."""


class MLAInputError(Exception):
    """Bad input from the user: reported as one clear line, never as a raw traceback."""


class BackendSpecError(MLAInputError):
    """A ``--mla-backend`` spec that cannot be resolved to a backend."""


class CheckpointError(MLAInputError):
    """A checkpoint directory, file or tensor that is missing, corrupt or has the wrong shape."""


class BackendOutputError(AssertionError):
    """A backend returned something the contract forbids (wrong shape/dtype, NaN/inf)."""
