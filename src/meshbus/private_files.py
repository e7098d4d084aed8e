"""Files that hold secrets: written readable by their owner only, and refused by a broker
when others may read them (docs/security.md, "Files that hold secrets").

A broker's key, its TLS key and a config file with token hashes are what an attacker on
the same host wants. As ssh does with a private key, ``meshbus broker`` refuses to start
with one that its group or anyone else may read (or change), unless told
``--allow-insecure-key-files``; a config file of users is refused when others may change
it (they could add a user), and, when it holds token hashes, when they may read it.
Everything meshbus writes itself -- ``keygen``, the demo, the tests -- is written 0600.
"""

from __future__ import annotations

import os
import stat

from meshbus.errors import InvalidArgument

# Read, write or run by the group or by others: a private key is none of theirs.
NOT_PRIVATE = 0o077
# Written by the group or by others: a file that says who may sign in is theirs to forge.
WRITABLE_BY_OTHERS = 0o022
ALLOW_FLAG = "--allow-insecure-key-files"


class InsecureFile(InvalidArgument):
    """A file of secrets that others may read or change; the message names the file, its
    mode and the ``chmod`` that fixes it."""


def check_private(path: str | os.PathLike[str], what: str, mask: int = NOT_PRIVATE) -> None:
    """InsecureFile when ``path`` has any bit of ``mask`` set; ``what`` names it for the
    message ("the TLS key"). A file that cannot be read is left to whoever reads it next,
    whose error says why."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & mask:
        who = "read or changed" if mask & 0o044 else "changed"
        raise InsecureFile(
            f"{what} {os.fspath(path)} may be {who} by users other than its owner "
            f"(mode {mode:04o}); make it private: chmod 600 {os.fspath(path)} (or, to take "
            f"the risk, {ALLOW_FLAG})"
        )


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a new file that only its owner may read (0600, whatever the umask); refuses
    to overwrite one (FileExistsError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
