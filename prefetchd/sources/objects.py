"""Objects in a store, named by URL: ``s3://bucket/key``, ``gs://bucket/key``, ``https://host/path``.

Read through obstore (Rust's ``object_store`` underneath; the extra ``prefetchd[cloud]``), which
configures itself from the environment S3 and GCS tools already use: ``AWS_ENDPOINT_URL`` (an
S3-compatible store), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ALLOW_HTTP``, instance metadata;
``GOOGLE_APPLICATION_CREDENTIALS`` for GCS. An ``http://`` endpoint is allowed because it says so.

What this module promises its callers:

- every read names the object's identity as indexed (ObjectInfo: size, ETag, Last-Modified):
  the store is asked for the range *if it still matches* (``If-Match``, or
  ``If-Unmodified-Since`` without an ETag), and the answer's own identity is compared too (a
  server that ignores the condition); a changed object is ObjectChanged, never bytes of two
  versions;
- a fault of the store (no connection, a timeout, a reset, 429/5xx, a short body) is retried
  here, with exponential back-off and full jitter, bounded in tries and time (_RETRIES,
  _RETRY_WITHIN_S; here rather than in obstore, so each retry is counted); what is still failing
  after that is StoreUnreachable, which is not the sample's fault: the batch waits, it does not
  replace it;
- each store's requests, bytes, retries, errors and seconds waited are counted (``totals``):
  a worker's heartbeat carries them to the master, which shows them in ``status`` and metrics;
- what the store refuses for good (404, 403, a bad request) is ObjectError with one line naming
  the URL and what to check;
- no message carries a credential: URLs are shown without user info or query, and a store's
  error text is cut to its first line and before the answer's body, with any URL in it shown
  so and the environment's credentials masked (first_line).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

from prefetchd import stopsignals

SCHEMES = ("s3", "gs", "http", "https")
IN_FLIGHT = 32  # concurrent range requests per process: a batch's, so its latency is paid once
# A request that has not finished in this long is abandoned (an endless body, a lying
# Content-Length): below --worker-timeout's default 60 s, so the store is named, not a hung worker.
_REQUEST_TIMEOUT = "20s"
_CONNECT_TIMEOUT = "5s"
_NO_RETRY = {"max_retries": 0, "retry_timeout": timedelta(seconds=0)}  # obstore's own: retried here instead
_RETRIES = 6
_RETRY_WITHIN_S = 10.0  # no retry starts later than this after the first try
# Back-off before retry n: a random time up to min(_FIRST_BACKOFF_S * 2**n, _MAX_BACKOFF_S) ("full
# jitter": workers that failed together do not come back together). The cap is also how late a
# store that is back is noticed: the trainer resumes within it.
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.1, 1.0
_STREAM_CHUNK = 1 << 20
IO_FIELDS = ("requests", "bytes", "retries", "errors", "seconds")  # a store's counters, in this order
_URL_IN_TEXT = re.compile(r"\b(?:https?|s3|gs)://[^\s'\"<>]+")
_STATUS = re.compile(r"\b(?:status code|status): ?(\d{3})\b")
# obstore's "... Server returned non-2xx status code: 403 Forbidden: <the answer's body>": kept up to the reason
_STATUS_LINE = re.compile(r"status code: \d{3}[^:]*")
# Never shown, wherever a store's message might repeat them
_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_SERVICE_ACCOUNT_KEY")


class ObjectError(ValueError):
    """The store refuses an object for good (missing, denied, not what was asked): a data error."""


class ObjectChanged(Exception):
    """The object is not the one indexed any more (another size, ETag or Last-Modified). Not a ValueError: a
    reader's ``except ValueError`` (a bad sample, replaced) must not catch it; the job's data
    changed under it, which stops it."""


class StoreUnreachable(Exception):
    """The store did not answer, after the retries (Objects._retried): an outage, not the sample's fault."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{shown(url)}: {why}")
        self.url = url


@dataclass(frozen=True)
class ObjectInfo:
    """An object's identity as the store gives it: its size, ETag and Last-Modified. A store
    that gives no ETag (a plain HTTP server) is held to the size and Last-Modified; one that
    gives neither is refused (head), as a rewrite of it could not be told."""

    size: int
    etag: str  # "" when the store gives none
    modified: str  # Last-Modified, ISO 8601; "" when the store gives none

    def to_json(self) -> list:
        return [self.size, self.etag, self.modified]

    @classmethod
    def from_json(cls, value) -> ObjectInfo:
        size, etag, modified = value
        if type(size) is not int or size < 0 or not isinstance(etag, str) or not isinstance(modified, str):
            raise ValueError(f"an object's identity is [size, etag, modified], got {value!r}")
        return cls(size, etag, modified)

    @classmethod
    def of(cls, meta: dict) -> ObjectInfo:
        """From obstore's ObjectMeta."""
        modified = meta.get("last_modified")
        return cls(int(meta["size"]), meta.get("e_tag") or "", modified.isoformat() if modified else "")

    def same_as(self, other: ObjectInfo) -> bool:
        """Whether ``other`` (what a read was answered with) is this object: the ETag decides
        where both have one, else the Last-Modified (to the second: a rewrite within the same
        second, of the same size, on a server without ETags, is not seen)."""
        if self.size != other.size:
            return False
        if self.etag and other.etag:
            return self.etag == other.etag
        return not (self.modified and other.modified) or self.modified == other.modified


def is_url(text: str) -> bool:
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def shown(url: str) -> str:
    """A URL as messages show it: without user info, query or fragment (where credentials go)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:  # an IPv6 host without its "]", a port that is no port
        return "<a URL that does not parse>"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def check_url(url: str) -> str | None:
    """Why ``url`` cannot name an object, or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- read now: a port that is no port raises here, not in a worker
    except ValueError as exc:
        return f"it is not a URL that parses ({exc})"
    if parts.scheme.lower() not in SCHEMES:
        return f"the scheme {parts.scheme!r} is not one of {', '.join(SCHEMES)}"
    if parts.username is not None or parts.password is not None:
        return "credentials in a URL are not accepted: give them in the environment (AWS_ACCESS_KEY_ID, ...)"
    if parts.query or parts.fragment:
        return "a URL with a query or fragment (a presigned URL?) is not accepted: name the object itself"
    if not parts.netloc:
        return "it names no bucket or host"
    if not parts.path.strip("/"):
        return "it names a bucket or host but no object in it"
    return None


def _split(url: str) -> tuple[tuple[str, str], str]:
    """((scheme, bucket or host), the object's path in that store)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    path = parts.path.lstrip("/")
    if scheme in ("http", "https"):
        path = urllib.parse.unquote(path)  # obstore encodes the path itself: not twice
    return (scheme, parts.netloc), path


def first_line(exc: BaseException) -> str:
    """A store's error in one line without credentials: URLs shown without user info or query,
    the answer's body left out (a store may echo the request, its headers included), and any
    credential of the environment masked wherever it still appears."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    status = _STATUS_LINE.search(text)
    if status:
        text = text[: status.end()]
    text = _URL_IN_TEXT.sub(lambda m: shown(m.group(0)), text)
    for name in _SECRETS:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text[:400]


class Objects:
    """A process's stores (one per bucket or host) and its pool of requests in flight.

    One per process: obstore's stores hold connections and a runtime, which do not survive a
    fork; workers make theirs after they start."""

    def __init__(self) -> None:
        self._stores: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._totals: dict[str, list] = {}  # "scheme://bucket" -> IO_FIELDS

    def totals(self) -> dict[str, list]:
        """Each store's counters since this was made: IO_FIELDS."""
        with self._lock:
            return {store: list(values) for store, values in self._totals.items()}

    def head(self, url: str) -> ObjectInfo:
        import obstore

        store, path = self._store(url)
        info = ObjectInfo.of(self._retried(url, lambda: obstore.head(store, path)))
        if not (info.etag or info.modified):
            raise ObjectError(
                f"{shown(url)}: the server gives it neither an ETag nor a Last-Modified, so a rewrite of it "
                "could not be told from the object indexed; serve it from a store that does (any S3 or GCS "
                "bucket, most HTTP servers)"
            )
        return info

    def _retried(self, url: str, request):
        """``request()``'s result, retried while the store does not answer (StoreUnreachable)."""
        first = time.monotonic()
        for attempt in range(_RETRIES + 1):
            began = time.monotonic()
            try:
                try:
                    result = request()
                except Exception as exc:  # noqa: BLE001 - obstore's errors are sorted by _failure
                    raise _failure(url, exc) from None
                self._count(url, began, size=len(result) if isinstance(result, bytes) else 0)
                return result
            except StoreUnreachable:
                self._count(url, began, error=True)
                backoff = random.uniform(0, min(_FIRST_BACKOFF_S * 2**attempt, _MAX_BACKOFF_S))
                if attempt == _RETRIES or time.monotonic() + backoff - first > _RETRY_WITHIN_S:
                    raise
                self._count(url, began, retry=True)
                stopsignals.check_starting()  # a stop during a start's indexing need not wait for the retries
                time.sleep(backoff)
            except (ObjectError, ObjectChanged):
                self._count(url, began, error=True)
                raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _count(self, url: str, began: float, size: int = 0, error: bool = False, retry: bool = False) -> None:
        key = store_name(url)
        with self._lock:
            values = self._totals.setdefault(key, [0, 0, 0, 0, 0.0])
            if retry:
                values[2] += 1
                return
            values[0] += 1
            values[1] += size
            values[3] += error
            values[4] += time.monotonic() - began

    def read(self, url: str, start: int, end: int, info: ObjectInfo) -> bytes:
        """Bytes [start, end) of the object ``info`` says it is; ObjectChanged when it is not."""
        if not 0 <= start <= end <= info.size:
            raise ObjectError(f"{shown(url)}: bytes {start}-{end} lie outside its {info.size} bytes")
        if start == end:
            return b""
        import obstore

        store, path = self._store(url)
        options: dict = {"range": (start, end)}
        if info.etag:
            options["if_match"] = info.etag
        elif info.modified:
            options["if_unmodified_since"] = datetime.fromisoformat(info.modified)

        def get() -> bytes:
            result = obstore.get(store, path, options=options)
            meta = result.meta
            got = ObjectInfo.of(meta)
            if not info.same_as(got):
                raise ObjectChanged(
                    f"{shown(url)} changed under the running job: indexed as {info.size} bytes, ETag "
                    f"{info.etag or '-'}, modified {info.modified or '-'}; now {got.size} bytes, ETag "
                    f"{got.etag or '-'}, modified {got.modified or '-'}; start the job again to index it anew"
                )
            if tuple(result.range) != (start, end):
                raise ObjectError(
                    f"{shown(url)}: asked for bytes {start}-{end}, the store answers with bytes {result.range[0]}-"
                    f"{result.range[1]}: it does not serve ranges as S3 and HTTP/1.1 servers do"
                )
            # Streamed, never result.bytes(): that allocates what the answer's Content-Length
            # claims before a byte arrives (a lying header of 1 PiB aborts the process).
            chunks, held = [], 0
            for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                chunks.append(chunk)
                held += len(chunk)
                if held > end - start:
                    raise ObjectError(f"{shown(url)}: the store sends more than the {end - start} bytes asked for")
            if held != end - start:  # a body cut short that the client took for whole
                raise StoreUnreachable(url, f"asked for {end - start} bytes at {start}, the store sent {held}")
            return b"".join(chunks)

        return self._retried(url, get)

    def submit(self, url: str, start: int, end: int, info: ObjectInfo):
        """A Future of ``read``; IN_FLIGHT of them run at a time, in the order submitted."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="prefetchd-read")
        return self._pool.submit(self.read, url, start, end, info)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._stores.clear()

    def _store(self, url: str):
        why = check_url(url)
        if why:
            raise ObjectError(f"{shown(url)}: {why}")
        key, path = _split(url)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = _make_store(*key)
        return store, path


def store_name(url: str) -> str:
    """The store a URL is in, as counters name it: scheme://bucket or scheme://host."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")


def _make_store(scheme: str, where: str):
    try:
        from obstore.store import GCSStore, HTTPStore, S3Store
    except ImportError:
        raise ObjectError(
            f"reading {scheme}:// URLs needs obstore: pip install 'prefetchd[cloud]' (in the daemon's environment)"
        ) from None

    options = {"timeout": _REQUEST_TIMEOUT, "connect_timeout": _CONNECT_TIMEOUT}
    try:
        if scheme == "s3":
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
            if endpoint.lower().startswith("http://"):  # a local S3-compatible store says so itself
                options["allow_http"] = True
            if os.environ.get("AWS_PROFILE") and not os.environ.get("AWS_ACCESS_KEY_ID"):
                provider = _profile_credentials(os.environ["AWS_PROFILE"])
                return S3Store(where, credential_provider=provider, client_options=options, retry_config=_NO_RETRY)
            return S3Store(where, client_options=options, retry_config=_NO_RETRY)
        if scheme == "gs":
            return GCSStore(where, client_options=options, retry_config=_NO_RETRY)
        options["allow_http"] = scheme == "http"
        return HTTPStore.from_url(f"{scheme}://{where}/", client_options=options, retry_config=_NO_RETRY)
    except Exception as exc:  # noqa: BLE001 - a bad configuration, named by obstore
        raise ObjectError(f"{scheme}://{where}: the store cannot be configured: {first_line(exc)}") from None


def _profile_credentials(profile: str):
    """The credentials of an AWS CLI profile (~/.aws/credentials and config, SSO, roles), read as
    the AWS CLI reads them, by boto3: obstore's own reader knows no profiles."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise ObjectError(
            f"AWS_PROFILE={profile} is set: reading a profile needs boto3 (pip install boto3), or give "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead"
        ) from None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception as exc:  # noqa: BLE001 - botocore's ProfileNotFound, no credentials in it, ...
        why = first_line(exc)
        raise ObjectError(f"AWS_PROFILE={profile}: {why}; check ~/.aws/credentials and ~/.aws/config") from None


def _failure(url: str, exc: BaseException) -> Exception:
    """obstore's exception as ObjectError (for good), ObjectChanged or StoreUnreachable (for now)."""
    from obstore import exceptions as ox

    if isinstance(exc, ObjectError | ObjectChanged | StoreUnreachable):  # sorted already (a check of ours)
        return exc
    why = first_line(exc)
    if isinstance(exc, ox.PreconditionError):
        return ObjectChanged(
            f"{shown(url)} changed under the running job (its ETag is not the one indexed); "
            "start the job again to index it anew"
        )
    if isinstance(exc, ox.NotSupportedError):
        return ObjectError(
            f"{shown(url)}: {why}: the server does not serve byte ranges as S3, GCS and HTTP/1.1 servers do; "
            "prefetchd reads each sample by its range"
        )
    if isinstance(exc, FileNotFoundError | ox.NotFoundError):
        return ObjectError(f"{shown(url)} does not exist in the store; check the URL (bucket, key, endpoint)")
    if isinstance(exc, ox.PermissionDeniedError | ox.UnauthenticatedError):
        return ObjectError(
            f"{shown(url)}: the store refuses access ({why}); check the credentials in the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) and the "
            "bucket's policy"
        )
    status = _STATUS.search(str(exc))
    if status and status.group(1)[0] == "4" and status.group(1) not in ("408", "429"):
        return ObjectError(f"{shown(url)}: the store answers {status.group(1)}: {why}")
    return StoreUnreachable(url, why)
