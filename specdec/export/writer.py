"""The bundle on disk: a staging folder renamed into place when whole, and the checksums its manifest records.

Shared by every writer of bundles (export, quantize, distill, corpus); it imports none of them.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

from specdec.runtime.manifest import MANIFEST_NAME, sha256_file


@contextlib.contextmanager
def staged_folder(out_dir: Path, suffix: str = ".partial", create: bool = True) -> Iterator[Path]:
    """Yield a side folder `<out_dir><suffix>` to write into; rename it to `out_dir` when the block succeeds, remove
    it when it fails or is interrupted: `out_dir` only ever holds a whole bundle (or what it held before).
    `create=False` leaves making the folder to the block (e.g. an export_bundle into it)."""
    partial = out_dir.with_name(out_dir.name + suffix)
    shutil.rmtree(partial, ignore_errors=True)
    if create:
        partial.mkdir(parents=True)
    try:
        yield partial
        if out_dir.exists():
            shutil.rmtree(out_dir)
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def bundle_files(folder: Path) -> dict[str, str]:
    """Every file of a bundle folder but its manifest, with its SHA-256: the manifest's `files`."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_NAME}
