"""Remote checkpoints, read by range requests only: an `https://` base URL (the folder that holds
config.json) through fsspec's HTTP file system, and a Hugging Face repository
`hf://org/name[@revision][/subfolder]` through huggingface_hub's `HfFileSystem`.

The reader (`moejax.hf.io.checkpoint_reader`) and the header parser (`moejax.hf.io.safetensors_format`)
are the local ones; these storages only fetch bytes:

* a shard's header: one request for its first `header_prefetch` bytes (128 KiB: most shards'
  headers, DeepSeek-V3's ~70 KB ones included), a second only for a longer header; every shard's
  first request is in flight at once (https);
* a tensor: one range request for exactly its bytes; config.json and the index: read whole;
* never a whole shard. A range answered with anything but exactly the bytes asked for is refused
  before its body is read: HTTP 200 (a server that ignores Range and starts sending the whole
  file), a missing or different Content-Range, a body of the wrong length;
* transient failures (connection errors, timeouts, HTTP 408/425/429/5xx, a truncated body) are
  retried after `RETRY_DELAYS`; a missing file (HTTP 404) is a `MissingFile` naming its URL.

For https the request is made on fsspec's `HTTPFileSystem` session and I/O loop (aiohttp), so that
the status and Content-Range can be checked before any body byte is read; for hf:// reads go
through `HfFileSystem` files opened without a read-ahead cache (one range request per read).

fsspec (with aiohttp) and huggingface_hub are imported only here, only when a remote location is
opened: `pip install 'moejax[remote]'`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import re
import time
from pathlib import PurePosixPath
from urllib.parse import quote, urlsplit

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.io.storage import MissingFile, Storage

HEADER_PREFETCH = 128 * 1024
RETRY_DELAYS = (0.25, 1.0, 4.0)  # seconds before the 2nd, 3rd and 4th attempt
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
SMALL_FILE_LIMIT = 256 * 2**20  # config.json, the index: refused beyond this (a wrong URL, not a small file)
CONCURRENCY = 16  # header requests in flight at once


def _import(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(f"{what} needs the optional dependencies fsspec, aiohttp and huggingface_hub "
                          f"({error}); install them with: pip install 'moejax[remote]'") from None


@dataclasses.dataclass(frozen=True, order=True)
class RemotePath:
    """A file of a remote checkpoint: the location it was opened as (`base`) and its path inside
    it. Prints as its URL; has the few Path-like members the reader uses (`/`, name, parent,
    relative_to), and no `__fspath__`, so it can never be opened as a local file by mistake."""

    base: str
    relative: str = ""

    def __truediv__(self, name: str) -> RemotePath:
        parts = [part for part in f"{self.relative}/{name}".split("/") if part and part != "."]
        return RemotePath(self.base, "/".join(parts))

    @property
    def name(self) -> str:
        return (self.relative or self.base.rstrip("/")).rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.base, self.relative.rsplit("/", 1)[0] if "/" in self.relative else "")

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        prefix = f"{other.relative}/" if other.relative else ""
        if other.base != self.base or not self.relative.startswith(prefix):
            raise ValueError(f"{self} is not inside {other}")
        return PurePosixPath(self.relative[len(prefix):])

    @property
    def url(self) -> str:
        return f"{self.base}/{quote(self.relative)}" if self.relative else self.base

    def __str__(self) -> str:
        return f"{self.base}/{self.relative}" if self.relative else self.base


@dataclasses.dataclass
class ReadStats:
    """What a remote storage has fetched: requests made and body bytes received."""

    requests: int = 0
    bytes: int = 0


class _Transient(Exception):
    """A failure worth retrying (the message says which)."""


def _range_text(start: int, length: int) -> str:
    return f"bytes {start}-{start + length - 1}"


# --------------------------------------------------------------------------------------------
# https:// through fsspec's HTTP file system
# --------------------------------------------------------------------------------------------


class HttpStorage(Storage):
    """A checkpoint folder served over http(s): `url` is the folder (config.json is `url/config.json`).
    `storage_options` go to fsspec's HTTPFileSystem (e.g. client_kwargs={"trust_env": True} to use
    proxy settings, headers={"Authorization": ...})."""

    remote = True

    def __init__(self, url: str, *, header_prefetch: int = HEADER_PREFETCH, concurrency: int = CONCURRENCY,
                 **storage_options):
        parts = urlsplit(url)
        if not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"{url}: expected a checkpoint folder's base URL, https://host/path (no query or fragment)")
        http = _import("fsspec.implementations.http", f"reading {url}")
        self._aiohttp = _import("aiohttp", f"reading {url}")
        self._sync = _import("fsspec.asyn", f"reading {url}").sync
        self.fs = http.HTTPFileSystem(**storage_options)
        self.root = RemotePath(url.rstrip("/"))
        self.header_prefetch = header_prefetch
        self.concurrency = concurrency
        self.stats = ReadStats()
        self._timeout = self._aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)

    def read_prefix(self, path: RemotePath, length: int) -> tuple[int, bytes]:
        return self._sync(self.fs.loop, self._fetch, path, 0, length)

    def read_prefixes(self, paths, length: int) -> dict:
        async def every():
            limit = asyncio.Semaphore(self.concurrency)

            async def one(path):
                async with limit:
                    return await self._fetch(path, 0, length)

            return await asyncio.gather(*(one(path) for path in paths), return_exceptions=True)

        results = self._sync(self.fs.loop, every)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(paths, results))

    def read_range(self, path: RemotePath, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        size, data = self._sync(self.fs.loop, self._fetch, path, start, length)
        if len(data) != length:
            raise CheckpointError(f"{path}: asked for {_range_text(start, length)}, but the file has only {size} "
                                  "bytes (changed on the server since its header was read?)")
        return data

    def read_file(self, path: RemotePath) -> bytes | None:
        try:
            return self._sync(self.fs.loop, self._fetch, path, None, None)[1]
        except MissingFile:
            return None

    def shard_files(self, single_name: str) -> list:
        return [self.root / single_name]  # an http server cannot be listed

    async def _fetch(self, path: RemotePath, start: int | None, length: int | None) -> tuple[int, bytes]:
        """(file size, body) of one GET (a Range request when `start` is given), retried on
        transient failures."""
        attempts = len(RETRY_DELAYS) + 1
        for attempt in range(1, attempts + 1):
            try:
                return await self._request(path, start, length)
            except _Transient as error:
                if attempt == attempts:
                    what = f" ({_range_text(start, length)})" if start is not None else ""
                    raise CheckpointError(f"{path}{what}: {error}; gave up after {attempts} attempts") from error
                await asyncio.sleep(RETRY_DELAYS[attempt - 1])
        raise AssertionError("unreachable")

    async def _request(self, path: RemotePath, start: int | None, length: int | None) -> tuple[int, bytes]:
        aiohttp = self._aiohttp
        session = await self.fs.set_session()
        options = dict(self.fs.kwargs)
        headers = {**options.pop("headers", {}), "Accept-Encoding": "identity"}
        if start is not None:
            headers["Range"] = f"bytes={start}-{start + length - 1}"
        try:
            async with session.get(path.url, headers=headers, timeout=self._timeout, **options) as response:
                self.stats.requests += 1
                size, body = await self._answer(response, path, start, length)
                self.stats.bytes += len(body)
                return size, body
        except aiohttp.ClientPayloadError as error:  # the body ended before its Content-Length
            raise _Transient(f"truncated response ({error})") from error
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            raise _Transient(f"{type(error).__name__}: {error}") from error
        except aiohttp.ClientError as error:  # an invalid URL, a malformed response: not worth retrying
            raise CheckpointError(f"{path}: {type(error).__name__}: {error}") from error

    async def _answer(self, response, path: RemotePath, start: int | None, length: int | None) -> tuple[int, bytes]:
        """The checked answer to one request; refusals come before any body byte is read."""
        status, reason = response.status, response.reason
        if status == 404:
            raise MissingFile(f"{path}: not found (HTTP 404)")
        if status in TRANSIENT_STATUS:
            raise _Transient(f"HTTP {status} {reason}")
        if start is None:  # a small file, whole
            if status != 200:
                raise CheckpointError(f"{path}: HTTP {status} {reason}")
            size = response.content_length
            if size is not None and size > SMALL_FILE_LIMIT:
                raise CheckpointError(f"{path}: {size} bytes; expected a small JSON file (limit {SMALL_FILE_LIMIT})")
            body = await _read_at_most(response, SMALL_FILE_LIMIT if size is None else size, path)
            if size is not None and len(body) != size:
                raise _Transient(f"truncated response: {len(body)} of {size} bytes")
            return len(body), body
        asked = _range_text(start, length)
        if status == 416:
            total = _content_range(response.headers.get("Content-Range", ""))[2]
            if start == 0 and total == 0:
                return 0, b""  # an empty file: the header check names it
            raise CheckpointError(f"{path}: {asked} lie beyond the end of the file (HTTP 416, size {total}); "
                                  "the file is shorter than its header says")
        if status == 200:
            size = response.content_length
            if start == 0 and size is not None and size <= length:  # the whole file is what was asked for
                body = await _read_at_most(response, size, path)
                if len(body) != size:
                    raise _Transient(f"truncated response: {len(body)} of {size} bytes")
                return size, body
            whole = f", {size} bytes" if size is not None else ""
            raise CheckpointError(
                f"{path}: the server ignored the Range request for {asked} and began sending the whole file "
                f"(HTTP 200{whole}, not 206 Partial Content); it was not read. moejax reads remote checkpoints by "
                "range requests only: serve the folder with a server that supports them (nginx, Apache, S3 and the "
                "Hugging Face Hub do), or download it")
        if status != 206:
            raise CheckpointError(f"{path}: HTTP {status} {reason} for {asked}")
        header = response.headers.get("Content-Range", "")
        first, last, total = _content_range(header)
        if first is None:
            raise CheckpointError(f"{path}: HTTP 206 for {asked} without a valid Content-Range header "
                                  f"({header!r}); refusing to guess which bytes came back")
        if total is None:
            raise CheckpointError(f"{path}: Content-Range {header!r} does not give the file's size, which is "
                                  "needed to check its header")
        if first != start or last != min(start + length, total) - 1:
            raise CheckpointError(f"{path}: asked for {asked}, the server answered with {header!r}")
        want = last - first + 1
        body = await _read_at_most(response, want, path)
        if len(body) != want:
            raise _Transient(f"truncated response: {len(body)} of {want} bytes")
        return total, body


async def _read_at_most(response, limit: int, path) -> bytes:
    """The body, refused as soon as it runs past `limit` bytes (what was announced or asked for)."""
    chunks, count = [], 0
    while True:
        chunk = await response.content.read(min(1 << 20, limit + 1 - count))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        count += len(chunk)
        if count > limit:
            raise CheckpointError(f"{path}: the server sent more than the {limit} bytes it announced")


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$")


def _content_range(header: str) -> tuple[int | None, int | None, int | None]:
    """'bytes 0-99/1234' -> (0, 99, 1234); '*' parts and a malformed header give None."""
    match = _CONTENT_RANGE.match(header or "")
    if not match:
        return None, None, None
    first, last, total = match.groups()
    return (None if first is None else int(first), None if last is None else int(last),
            None if total == "*" else int(total))


# --------------------------------------------------------------------------------------------
# hf:// through huggingface_hub's HfFileSystem
# --------------------------------------------------------------------------------------------

_HF_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?")  # the hub's rule for an owner or repository name
_HF_LOCATION = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>refs/pr/\d+|[^/]+))?(?:/(?P<sub>.*))?$")


def parse_hf_location(location: str) -> tuple[str, str | None, str]:
    """'hf://org/name@rev/sub' -> ('org/name', 'rev', 'sub'); the revision and subfolder are optional
    (a revision containing '/' other than refs/pr/N is given URL-encoded, refs%2Fconvert%2Fx)."""
    match = _HF_LOCATION.match(location.rstrip("/"))
    if not match or match["repo"].split("/")[0] in ("datasets", "spaces", "buckets"):
        raise ConfigError(f"{location}: expected hf://org/name[@revision][/subfolder], a model repository")
    bad = [part for part in match["repo"].split("/") if not _HF_NAME.fullmatch(part) or ".." in part or "--" in part]
    if bad:
        raise ConfigError(f"{location}: {bad[0]!r} is not a Hugging Face owner or repository name (letters, digits, "
                          "'-', '_' and '.', not starting or ending with '-' or '.', no '--' or '..', at most 96 "
                          "characters); expected hf://org/name[@revision][/subfolder]")
    sub = match["sub"] or ""
    if any(part in ("", ".", "..") for part in sub.split("/")) and sub:
        raise ConfigError(f"{location}: subfolder {sub!r} has an empty, '.' or '..' part; expected a path inside "
                          "the repository")
    return match["repo"], match["revision"], sub


def hub_path(location: str) -> str:
    """The HfFileSystem path of an hf:// location: 'org/name[@revision][/subfolder]', the revision
    URL-encoded as HfFileSystem expects (refs/pr/N as it is)."""
    repo, revision, sub = parse_hf_location(location)
    if revision is not None and not re.fullmatch(r"refs/pr/\d+", revision):
        revision = quote(revision, safe="%")
    return repo + (f"@{revision}" if revision else "") + (f"/{sub}" if sub else "")


class HubStorage(Storage):
    """A Hugging Face model repository (or a subfolder of one) at a revision, read through
    HfFileSystem; `storage_options` go to it (token=..., endpoint=...)."""

    remote = True

    def __init__(self, location: str, *, header_prefetch: int = HEADER_PREFETCH, **storage_options):
        self._root_path = hub_path(location)
        hub = _import("huggingface_hub", f"reading {location}")
        self.fs = hub.HfFileSystem(**storage_options)
        self.root = RemotePath(location.rstrip("/"))
        self.header_prefetch = header_prefetch
        self.stats = ReadStats()
        self._call(self.root, lambda: self.fs.resolve_path(self._root_path))  # the repo and revision exist

    def fs_path(self, path: RemotePath) -> str:
        return f"{self._root_path}/{path.relative}" if path.relative else self._root_path

    def read_prefix(self, path: RemotePath, length: int) -> tuple[int, bytes]:
        size = self._call(path, lambda: self.fs.info(self.fs_path(path))["size"])
        return size, self.read_range(path, 0, min(length, size))

    def read_range(self, path: RemotePath, start: int, length: int) -> bytes:
        if length == 0:
            return b""

        def read():
            with self.fs.open(self.fs_path(path), "rb", block_size=max(length, 1), cache_type="none") as handle:
                handle.seek(start)
                return handle.read(length)

        data = self._call(path, read)
        self.stats.requests += 1
        self.stats.bytes += len(data)
        if len(data) != length:
            raise CheckpointError(f"{path}: asked for {_range_text(start, length)}, got {len(data)} bytes "
                                  "(truncated response, or the file changed since its header was read)")
        return data

    def read_file(self, path: RemotePath) -> bytes | None:
        try:
            data = self._call(path, lambda: self.fs.cat_file(self.fs_path(path)))
        except MissingFile:
            return None
        self.stats.requests += 1
        self.stats.bytes += len(data)
        return data

    def shard_files(self, single_name: str) -> list:
        names = self._call(self.root, lambda: self.fs.ls(self._root_path, detail=False))
        names = sorted(name.rsplit("/", 1)[-1] for name in names)
        if single_name in names:
            return [self.root / single_name]
        return [self.root / name for name in names if name.endswith(".safetensors")]

    def _call(self, path, operation):
        """`operation()` with transient failures retried and the Hub's errors named by `path`."""
        attempts = len(RETRY_DELAYS) + 1
        for attempt in range(1, attempts + 1):
            try:
                return operation()
            except FileNotFoundError as error:
                raise MissingFile(f"{path}: not found ({error})") from error
            except Exception as error:  # noqa: BLE001 - sorted into transient / refused / not ours below
                status = getattr(getattr(error, "response", None), "status_code", None)
                if status == 404:
                    raise MissingFile(f"{path}: not found (HTTP 404)") from error
                if status in (401, 403):
                    raise CheckpointError(f"{path}: access denied (HTTP {status}); a private or gated repository? "
                                          "log in with `hf auth login` or set HF_TOKEN") from error
                if not _hub_transient(error, status):
                    if status is not None:
                        raise CheckpointError(f"{path}: HTTP {status}: {error}") from error
                    raise
                if attempt == attempts:
                    raise CheckpointError(f"{path}: {type(error).__name__}: {error}; "
                                          f"gave up after {attempts} attempts") from error
                time.sleep(RETRY_DELAYS[attempt - 1])
        raise AssertionError("unreachable")


def _hub_transient(error: Exception, status: int | None) -> bool:
    if status is not None:
        return status in TRANSIENT_STATUS
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__.split(".")[0]  # httpx / requests / urllib3 transport errors
    return module in ("httpx", "requests", "urllib3", "httpcore") and any(
        word in type(error).__name__ for word in ("Connect", "Timeout", "Network", "Protocol", "Read"))
