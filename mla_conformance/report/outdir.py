"""The owned, atomic output directory: the tool writes only into a directory it creates, an empty one, or
one whose every file its marker (:data:`MARKER`) names; anything else there is an error that names the
files, and nothing is touched. The new content is written into a temporary sibling and swapped in; a
failure or Ctrl-C leaves the previous content as it was. Single files (``bench --out``) are written beside
their target and renamed over it (:func:`write_file_atomically`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from mla_conformance.errors import MLAInputError

#: The marker file in every directory this tool writes (JSON: kind and the files it owns).
MARKER = ".mla-conformance-report"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _names(paths) -> str:
    paths = sorted(paths)
    shown = ", ".join(paths[:6])
    return shown + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")


def _read_marker(directory: Path) -> dict | None:
    try:
        data = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "mla-conformance" else None


def _probe_parent(path: Path, given: str, option: str) -> None:
    """``path`` can be created: its nearest existing ancestor is a directory this process can write in
    (proven by a directory created and removed there). Nothing is left behind: a run that fails later
    leaves no empty ``reports/``; the directories up to ``path`` are made when the output is written."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise MLAInputError(f"{option} {given}: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent))
    except OSError as exc:
        raise MLAInputError(f"{option} {given}: cannot write in {parent} ({exc.strerror or exc})") from None


def check_out_dir(out: str | Path, kind: str, option: str = "--out") -> Path:
    """The resolved output directory, if this tool may write it; else MLAInputError naming what is there.

    Writable: a path that does not exist (its parent is created), an empty directory, or a directory
    whose marker says ``kind`` and names every file in it. Never the current directory or one above it.
    """
    given = str(out)
    path = Path(out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise MLAInputError(f"{option} {given}: is the current directory or one above it; the report is "
                            f"swapped in as a whole directory, so give a directory of its own (e.g. reports/NAME)")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise MLAInputError(f"{option} {given}: exists and is not a directory; nothing was touched")
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            marker = _read_marker(path)
            if marker is None:
                raise MLAInputError(f"{option} {given}: holds files mla-conformance did not write ({_names(entries)}); "
                                    "nothing was touched: give a new or empty directory")
            owned = set(marker.get("files", [])) | {MARKER}
            foreign = [e for e in entries if e not in owned]
            if marker.get("kind") != kind:
                raise MLAInputError(f"{option} {given}: holds a {marker.get('kind')} written by mla-conformance, "
                                    f"not a {kind}; nothing was touched: give another directory")
            if foreign:
                raise MLAInputError(f"{option} {given}: holds files mla-conformance did not write ({_names(foreign)}); "
                                    "nothing was touched: move them away or give another directory")
            for e in entries:
                if e != MARKER and not (path / e).is_file():
                    raise MLAInputError(f"{option} {given}: {e} is not a plain file; nothing was touched")
    _probe_parent(path, given, option)
    if path.is_dir():  # proven writable before any work: a file created and removed in it
        if os.path.ismount(path):
            raise MLAInputError(f"{option} {given}: is a mount point; the report is swapped in as a whole "
                                f"directory, so give a directory inside it (e.g. {Path(given) / 'NAME'})")
        try:
            fd, probe = tempfile.mkstemp(prefix=".mla-conformance-probe-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise MLAInputError(f"{option} {given}: cannot write in it ({exc.strerror or exc}); nothing was "
                                "touched") from None
    return path


def check_out_file(out: str | Path, schema: str, option: str = "--out") -> Path:
    """The output file, if this tool may write it: new, or a JSON file whose ``schema`` is ``schema``."""
    given = str(out)
    path = Path(out).expanduser()
    if path.is_dir():
        raise MLAInputError(f"{option} {given}: is a directory; give a file name (e.g. {Path(given) / 'bench.json'})")
    if path.exists() or path.is_symlink():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("schema") != schema:
            raise MLAInputError(f"{option} {given}: exists and was not written by mla-conformance ({schema}); "
                                "nothing was touched: give a new file name")
    _probe_parent(path, given, option)
    return path


@contextlib.contextmanager
def _no_interrupt():
    """SIGINT held back for the few renames of a swap (delivered right after)."""
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    else:
        yield


def write_file_atomically(path: Path, text: str) -> None:
    """One file: written beside its target, then renamed over it (a reader never sees half of it).

    Callers check ownership first (:func:`check_out_file`); the mode follows the user's umask.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_owned_dir(directory: Path, files: dict[str, Any], *, kind: str,
                    extra: Callable[[Path], list[str]] | None = None) -> list[str]:
    """Write ``files`` into a temporary sibling, then swap it in for ``directory``.

    ``extra(tmpdir)`` writes more files first (the plots) and returns their names; a value of ``files`` may
    be a function of those names (the markdown that links the plots). Ownership is checked again right
    before the swap. On any failure or Ctrl-C the temporary directory goes and ``directory`` is as it was.
    Returns the names ``extra`` wrote.
    """
    directory = check_out_dir(directory, kind)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    except OSError as exc:
        raise MLAInputError(f"cannot write into {directory.parent}: {exc.strerror or exc}") from None
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        plots = extra(tmp) if extra is not None else []
        for fname, content in files.items():
            if callable(content):
                content = content(plots)
            path = tmp / fname
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            else:
                path.write_bytes(content)
        owned = sorted(set(files) | set(plots))
        (tmp / MARKER).write_text(json.dumps({"tool": "mla-conformance", "kind": kind, "files": owned},
                                             indent=1, sort_keys=True) + "\n", encoding="utf-8")
        check_out_dir(directory, kind)
        with _no_interrupt():
            if directory.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
                os.replace(directory, old)
            try:
                os.replace(tmp, directory)
            except BaseException:
                if old is not None:
                    os.replace(old, directory)
                    old = None
                raise
        return plots
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
