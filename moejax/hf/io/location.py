"""Opening a checkpoint location: `open_location` turns a local folder, an `https://` base URL or an
`hf://` repository into its `Storage`. It sits above both kinds of storage (`moejax.hf.io.storage`:
the interface and the local folder; `moejax.hf.io.remote`: HTTP range reads and the Hub, imported
only when a remote location is opened), so neither imports the other's module back."""

from __future__ import annotations

from moejax.errors import ConfigError
from moejax.hf.io.storage import LocalStorage, Storage


def open_location(location, **options) -> Storage:
    """The storage of a checkpoint location: a local folder (str or PathLike), an `http(s)://` base
    URL (the folder that holds config.json), or `hf://org/name[@revision][/subfolder]`. An opened
    Storage is returned as it is. `options` go to the remote storage (e.g. header_prefetch)."""
    if isinstance(location, Storage):
        return location
    if isinstance(location, str) and "://" in location:
        if location.startswith(("http://", "https://")):
            from moejax.hf.io.remote import HttpStorage

            return HttpStorage(location, **options)
        if location.startswith("hf://"):
            from moejax.hf.io.remote import HubStorage

            return HubStorage(location, **options)
        raise ConfigError(f"{location}: unsupported location; expected a local folder, an https:// base URL "
                          "or hf://org/name[@revision]")
    return LocalStorage(location)
