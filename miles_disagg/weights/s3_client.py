"""The object-store port: the few S3 calls the version store makes, over boto3.

Endpoint, region and credentials come from the standard AWS configuration (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_PROFILE``, the shared config and credentials files), a location's own
``endpoint``/``region`` overriding the first two. botocore signs every request; nothing here
handles a secret, and no message names one.

Retries: every call goes through botocore's ``standard`` retry mode (5xx, ``SlowDown``,
throttling, connection errors: exponential backoff with jitter, ``max_attempts``). A body that
breaks off mid-read (a reset, a timeout) is retried here, per part, with backoff and jitter, within
``attempts``; an exhausted bound is :class:`StoreUnavailable` naming the object.

Downloads stream into a file by parallel ranged GETs: memory is ``part_bytes`` read buffers of
``READ_BYTES`` each per worker, never the object's size. Uploads go through boto3's managed
transfer (multipart above ``part_bytes``, parts in parallel).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from miles_disagg.types import InvalidInput, StoreAccessDenied, StoreUnavailable
from miles_disagg.weights.location import ObjectLocation

PART_BYTES = 8 * 1024 * 1024
READ_BYTES = 1024 * 1024
CONCURRENCY = 8
ATTEMPTS = 6
BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                          "InvalidToken", "AllAccessDisabled", "InvalidClientTokenId", "Forbidden", "403"})
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class ConditionFailed(Exception):
    """A conditional write lost: the object exists (``If-None-Match: *``) or changed (``If-Match``)."""


class NoSuchBucket(InvalidInput):
    """The store URL names a bucket the endpoint does not have."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified_unix: float


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(endpoint_url: str | None, region: str | None, attempts: int, connect_timeout_s: float,
            read_timeout_s: float, pool: int) -> Any:
    """One boto3 S3 client per setting per process (they are thread-safe; making one costs ~0.1 s of CPU).
    The environment's credentials and endpoint are part of the key: a changed environment gets a new one."""
    import os

    env = tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                            "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_REGION"))
    key = (endpoint_url, region, attempts, connect_timeout_s, read_timeout_s, pool, hash(env))
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            import boto3
            from botocore.config import Config

            config = Config(retries={"mode": "standard", "max_attempts": attempts}, connect_timeout=connect_timeout_s,
                            read_timeout=read_timeout_s, max_pool_connections=pool,
                            s3={"addressing_style": "path"} if endpoint_url else None)
            _CLIENTS[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region,
                                                           config=config)
        return _CLIENTS[key]


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code or status


def backoff_s(attempt: int) -> float:
    """Full jitter: a uniform wait up to ``BACKOFF_S * 2**attempt`` (at most ``MAX_BACKOFF_S``)."""
    return random.uniform(0, min(MAX_BACKOFF_S, BACKOFF_S * 2 ** attempt))


class ObjectClient:
    """One location's bucket: get, conditional put, ranged download, upload, list, delete."""

    def __init__(self, location: ObjectLocation, *, attempts: int = ATTEMPTS, part_bytes: int = PART_BYTES,
                 concurrency: int = CONCURRENCY, connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0):
        self.location = location
        self.attempts, self.part_bytes, self.concurrency = attempts, part_bytes, concurrency
        self._s3 = _client(location.endpoint_url, location.region, attempts, connect_timeout_s, read_timeout_s,
                           max(10, 2 * concurrency))

    # ------------------------------------------------------------- errors

    def _fail(self, exc: Exception, doing: str, key: str) -> Exception:
        """The typed error for a botocore failure ``doing`` something to ``key``."""
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        where = f"{self.location.display} ({doing} {self.location.relative(key) if key else 'the bucket'})"
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoreAccessDenied(f"{where}: no AWS credentials found (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                                     "AWS_SECRET_ACCESS_KEY, or the shared credentials file)")
        code = _error_code(exc)
        if isinstance(exc, ClientError) and code in DENIED_CODES:
            return StoreAccessDenied(f"{where}: the object store refused the credentials or the permission ({code})")
        if isinstance(exc, ClientError) and code == "NoSuchBucket":
            return NoSuchBucket(f"{where}: the endpoint has no bucket {self.location.bucket!r}")
        kind = code or type(exc).__name__
        return StoreUnavailable(f"{where}: the object store did not answer after {self.attempts} tries ({kind})")

    # ------------------------------------------------------------- small objects

    def get(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """``(body, etag)``, or ``None`` when the object does not exist; ``InvalidInput`` past ``max_bytes``."""
        for attempt in range(self.attempts):
            try:
                answer = self._s3.get_object(Bucket=self.location.bucket, Key=key)
                size = int(answer.get("ContentLength", 0))
                if size > max_bytes:
                    answer["Body"].close()
                    raise InvalidInput(f"{self.location.display}: {self.location.relative(key)} is {size} bytes, "
                                       f"more than the {max_bytes} such an object may hold")
                return answer["Body"].read(), str(answer["ETag"])
            except InvalidInput:
                raise
            except Exception as exc:  # noqa: BLE001 - botocore's errors have no common base worth naming
                if _error_code(exc) in MISSING_CODES:
                    return None
                if not self._transient(exc) or attempt + 1 == self.attempts:
                    raise self._fail(exc, "reading", key) from None
                time.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")

    def put(self, key: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write ``body``; the new ETag. ``ConditionFailed`` when the condition does not hold."""
        extra: dict[str, Any] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        try:
            answer = self._s3.put_object(Bucket=self.location.bucket, Key=key, Body=body, **extra)
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise ConditionFailed(key) from None
            raise self._fail(exc, "writing", key) from None
        return str(answer["ETag"])

    def head(self, key: str) -> int | None:
        """The object's size, or ``None`` when it does not exist."""
        try:
            return int(self._s3.head_object(Bucket=self.location.bucket, Key=key)["ContentLength"])
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc) in MISSING_CODES:
                return None
            raise self._fail(exc, "checking", key) from None

    def check_bucket(self) -> None:
        """The bucket answers with these credentials (``StoreAccessDenied``, ``NoSuchBucket``, ``StoreUnavailable``)."""
        try:
            self._s3.list_objects_v2(Bucket=self.location.bucket, Prefix=self.location.key(""), MaxKeys=1)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "listing", "") from None

    # ------------------------------------------------------------- large objects

    def upload_file(self, key: str, path: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.part_bytes, multipart_chunksize=self.part_bytes,
                                max_concurrency=self.concurrency, use_threads=True)
        try:
            self._s3.upload_file(str(path), self.location.bucket, key, Config=config)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "uploading", key) from None

    def download(self, key: str, dest: Path, size: int) -> int:
        """Write the object's first ``size`` bytes into ``dest`` by ranged GETs (parallel above one part).
        Returns the object's size as the store reports it; the caller compares it and the checksum."""
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            ranges = [(start, min(size, start + self.part_bytes)) for start in range(0, size, self.part_bytes)] or [(0, 0)]
            if len(ranges) == 1:
                totals = [self._fetch_range(key, fd, *ranges[0])]
            else:
                with ThreadPoolExecutor(min(self.concurrency, len(ranges)), thread_name_prefix="s3-get") as pool:
                    totals = list(pool.map(lambda r: self._fetch_range(key, fd, *r), ranges))
            os.fsync(fd)
        finally:
            os.close(fd)
        return max(totals)

    def download_any(self, key: str, dest: Path) -> int:
        """The whole object, its size not known ahead: the first part's answer tells it (no HEAD round trip),
        the rest comes in parallel ranges. Returns the size; ``FileNotFoundError`` when there is no such object."""
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            total = self._fetch_range(key, fd, 0, self.part_bytes)
            if total < 0:
                raise FileNotFoundError(key)
            rest = [(start, min(total, start + self.part_bytes)) for start in range(self.part_bytes, total, self.part_bytes)]
            if rest:
                with ThreadPoolExecutor(min(self.concurrency, len(rest)), thread_name_prefix="s3-get") as pool:
                    list(pool.map(lambda r: self._fetch_range(key, fd, *r), rest))
            os.ftruncate(fd, total)
            os.fsync(fd)
        finally:
            os.close(fd)
        return total

    def _fetch_range(self, key: str, fd: int, start: int, end: int) -> int:
        """Bytes [start, end) of the object into ``fd`` at ``start``; the object's total size."""
        for attempt in range(self.attempts):
            try:
                return self._read_range_once(key, fd, start, end)
            except (InvalidInput, StoreAccessDenied):
                raise
            except Exception as exc:  # noqa: BLE001
                if _error_code(exc) in MISSING_CODES:
                    return -1
                if _error_code(exc) == "InvalidRange":
                    return 0  # the object is empty (or shorter than the range): the size check says so
                if not self._transient(exc) or attempt + 1 == self.attempts:
                    raise self._fail(exc, "downloading", key) from None
                time.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")

    def _read_range_once(self, key: str, fd: int, start: int, end: int) -> int:
        ranged = {"Range": f"bytes={start}-{end - 1}"} if end > start else {}
        answer = self._s3.get_object(Bucket=self.location.bucket, Key=key, **ranged)
        total = _total_size(answer)
        body, offset = answer["Body"], start
        try:
            while offset < end:
                chunk = body.read(min(READ_BYTES, end - offset))
                if not chunk:
                    break  # shorter than the manifest says: the size check refuses it
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
        finally:
            body.close()
        if offset < end and total >= end:
            raise ConnectionError(f"the body ended after {offset - start} of {end - start} bytes")
        return total

    @staticmethod
    def _transient(exc: Exception) -> bool:
        code = _error_code(exc)
        if code in DENIED_CODES or code in MISSING_CODES or code in ("NoSuchBucket", "InvalidRange"):
            return False
        return True

    # ------------------------------------------------------------- listing

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a relative key), for cleanup only: readers never list."""
        paginator = self._s3.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.key(prefix)):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "listing", self.location.key(prefix)) from None

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            try:
                self._s3.delete_objects(Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as exc:  # noqa: BLE001
                raise self._fail(exc, "deleting", batch[0]["Key"]) from None


def _total_size(answer: dict[str, Any]) -> int:
    """The whole object's size from a (ranged) GET answer."""
    content_range = str(answer.get("ContentRange") or "")
    if "/" in content_range:
        tail = content_range.rsplit("/", 1)[1]
        if tail.isdigit():
            return int(tail)
    return int(answer.get("ContentLength", 0))
