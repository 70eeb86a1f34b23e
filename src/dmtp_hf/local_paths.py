"""Telling a mistyped local folder from a Hugging Face Hub id, before anything asks the Hub.

Transformers takes any model path that is not an existing folder for a Hub id: a typo in ``./runs/my-dmtp/final``
then ends, after a minute of retries, in "couldn't connect to huggingface.co" (or "not a valid repo id"), which
says nothing about the folder. A path that can only be local is checked here first. It imports nothing heavy, so
the command line checks its paths before loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["looks_local", "require_local_folder"]


def looks_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` can only mean a local folder, never a Hub id (``namespace/name``).

    Local: a ``PathLike``; a string that starts with ``.``, ``/`` or ``~``; one with an OS path separator other than
    ``/`` (Windows) or more than one ``/`` (Hub ids have exactly one); or a ``parent/name`` whose parent folder exists
    here (``runs/my-draft`` next to an existing ``runs/``).
    """
    if isinstance(path, os.PathLike):
        return True
    text = str(path)
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        return True
    if any(separator in text for separator in {os.sep, os.altsep} - {None, "/"}):  # Windows: backslashes
        return True
    parent = os.path.dirname(text)
    return bool(parent) and os.path.isdir(os.path.expanduser(parent))


def require_local_folder(path: str | os.PathLike | None, what: str = "checkpoint") -> None:
    """Raise ``FileNotFoundError`` when ``path`` can only be a local folder (`looks_local`) and is not one.

    ``what`` names the folder in the message (``"checkpoint"``, ``"--target"``...). ``None`` and anything that may
    be a Hub id pass: Hub ids are left to Transformers.
    """
    if path is None or not looks_local(path):
        return
    folder = Path(os.path.expanduser(os.fspath(path)))
    if folder.is_dir():
        return
    if folder.exists():
        raise FileNotFoundError(f"The {what} {os.fspath(path)!r} is a file, not a checkpoint folder.")
    existing = next((parent for parent in folder.parents if parent.is_dir()), None)
    nearest = f" (the nearest existing folder is {str(existing)!r})" if existing not in (None, Path(".")) else ""
    text = os.fspath(path)
    why = "It can only be a local path"
    if isinstance(path, str) and not text.startswith((".", "/", "~")) and text.count("/") == 1:
        # local only because its parent folder exists here: the same text is a valid Hub id
        parent = text.split("/")[0]
        why = (
            f"It is read as a local path because a folder {parent!r} exists in the current directory (to load the "
            f"Hub repo {text!r}, run from another directory)"
        )
    raise FileNotFoundError(
        f"No {what} folder at {text!r}{nearest}. {why}, so the Hugging Face Hub was not asked: check the spelling "
        "(a Hub id is namespace/name)."
    )
