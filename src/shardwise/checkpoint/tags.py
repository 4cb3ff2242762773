"""Which checkpoint tags are allowed (pure: no torch.distributed, no filesystem access).

A tag names a directory directly under `save_dir`, and `latest` names a tag, so a tag must be exactly one
path component: a tag such as "../x" or "/abs" would write (and, when re-saving, remove) a directory
outside `save_dir`. Saving accepts ASCII letters, digits and `. _ - + = @`, not starting with '.'
(`.<tag>.partial` and `.<tag>.replaced` are the temporary names), at most `MAX_LENGTH` characters, and not
`latest`. Loading accepts any single path component, so that checkpoints saved under older, looser rules
still load by name; `load_tag_problem` refuses only what could name another directory.
"""

from __future__ import annotations

import re

from .layout import LATEST

MAX_LENGTH = 200  # a file name is at most 255 bytes; ".<tag>.replaced" must fit
ALLOWED = "ASCII letters, digits and . _ - + = @, not starting with '.', at most 200 characters, not 'latest'"
_SAVE_TAG = re.compile(r"[A-Za-z0-9_\-+=@][A-Za-z0-9._\-+=@]*")


def save_tag_problem(tag: str) -> str | None:
    """Why `tag` cannot be saved under, or None when it can."""
    if not _SAVE_TAG.fullmatch(tag) or len(tag) > MAX_LENGTH:
        return f"must be one directory name of {ALLOWED}; got {tag!r}"
    if tag == LATEST:
        return f"'{LATEST}' is the file that names the newest tag; choose another tag"
    return None


def load_tag_problem(tag: str) -> str | None:
    """Why `tag` cannot name a checkpoint directory under the load directory, or None when it can."""
    if tag in ("", ".", "..") or any(c in tag for c in "/\\\0\n\r"):
        return "must be one directory name (no '/', '..', NUL or newline)"
    return None
