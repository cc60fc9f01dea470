"""Errors that name what the user gave us (a file, a tensor, an option) and say what is wrong."""


class MLAInputError(Exception):
    """Bad input from the user: reported as one clear line, never as a raw traceback."""


class UserError(MLAInputError):
    """A command-line option or argument that is wrong: ``mla-conformance`` prints it as one line and exits 2."""


class BackendSpecError(MLAInputError):
    """A ``--mla-backend`` spec that cannot be resolved to a backend."""


class CheckpointError(MLAInputError):
    """A checkpoint directory, file or tensor that is missing, corrupt or has the wrong shape."""


class BackendError(Exception):
    """The backend under test crashed: it raised, or returned something of the wrong type, shape or dtype.

    Reported as an *error*, apart from a *failure* (an ``AssertionError`` from a check: the backend ran and
    its output or bytes are wrong). Both fail the run.
    """


class BackendOutputError(BackendError):
    """A backend returned something the contract forbids (not a Tensor, wrong shape, wrong dtype)."""
