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


class PackageImportError(MLAInputError):
    """A package the suite or an implementation needs does not import in this environment (a build of torchvision
    that does not load with the installed torch, a missing shared library): one line naming the root cause
    (:func:`environment_line`), never the wrapper's message."""


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s chain: its ``__cause__``, else its ``__context__`` (unless suppressed),
    followed to the end (transformers' "Could not import module 'DeepseekV2ForCausalLM'" -> its RuntimeError ->
    torchvision's "operator torchvision::nms does not exist")."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ if exc.__cause__ is not None else (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def environment_line(exc: BaseException) -> str:
    """One line for an import or construction that failed: the root cause (:func:`root_cause`) as ``Type: first
    line of its message``, and, where it is another exception, the type it surfaced as (not its message: a
    wrapper's words, e.g. "Are this object's requirements defined correctly?", say nothing of the cause)."""
    root = root_cause(exc)
    lines = str(root).strip().splitlines()
    line = f"{type(root).__name__}: {lines[0].strip()}" if lines else type(root).__name__
    if root is not exc:
        line += f" (the root cause; it surfaced as {type(exc).__name__})"
    return line
