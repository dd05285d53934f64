"""The daemon's side of CURVE: the folder of client certificates it admits.

The server's own secret certificate, and any single certificate, are read by
``prefetchd_client.transport`` (the client needs those too); this folder only the daemon
reads, when the config is checked and again when the control socket starts.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from prefetchd_client.folders import is_private
from prefetchd_client.transport import load_public_certificate


def load_authorized_keys(directory: str | os.PathLike) -> list[bytes]:
    """The client public keys in ``directory``'s ``*.key`` files; ValueError says what is wrong.

    Whoever can write to the folder or its files decides who gets in: they must be this
    user's and not writable by others.
    """
    folder = Path(directory)
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise ValueError(f"cannot read folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{folder} is not a folder")
    keys = []
    for path in [folder, *sorted(folder.glob("*.key"))]:
        st = os.stat(path)
        if not is_private(st):
            raise ValueError(
                f"{path} must be yours and not writable by others (it decides who may connect); "
                f"it has uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}: run chmod go-w {path}"
            )
        if path != folder:
            keys.append(load_public_certificate(path))
    if not keys:
        raise ValueError(
            f"{folder} holds no client certificates: copy each client's public certificate (the .key "
            "file zmq.auth.create_certificates writes, not the .key_secret) into it"
        )
    return keys
