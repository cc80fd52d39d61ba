"""Files and directory entries that survive a crash or a power cut once written (fsynced)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its directory's entry is on disk too.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some network and FUSE filesystems cannot sync a directory
            raise
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, text)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_error(path: Path, e: Exception) -> str:
    cause = getattr(e, "strerror", None) or type(e).__name__
    return (f"could not write checkpoint '{path}' ({cause}); free disk space or set checkpoint.dir "
            "to a writable directory")
