"""The S3 client, and what a failed call means: retry it, the object is missing, or give up with one line.

Endpoint, region and credentials come only from the standard environment as boto3 reads it
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_DEFAULT_REGION``, the shared config files); fastload takes no option for them and never prints them.

Reads get a client without botocore's retries: a ranged read that fails is retried here (:func:`with_retries`),
resuming where it stopped instead of starting the range over. Writes use botocore's standard retry mode: a PUT
is all or nothing, redone whole.
"""
from __future__ import annotations

import functools
import http.client
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastload.store.base import StoreError
from fastload.store.objects.urls import ObjectUrl

T = TypeVar("T")

# S3 error codes that mean "try again" whatever the status (throttling, a timeout on the server's side)
_RETRY_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "503", "500"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class MissingObjectError(StoreError):
    """The object does not exist (its bucket does)."""


class ShortRead(ConnectionError):
    """A response body that ended before the bytes it promised (a dropped connection the client did not notice)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request is retried: ``attempts`` tries in all, waiting ``base_s`` before
    the first retry and twice as long before each next one, at most ``max_s``."""

    attempts: int = 6
    base_s: float = 0.25
    max_s: float = 8.0

    def wait_s(self, retry: int) -> float:
        return min(self.max_s, self.base_s * 2 ** (retry - 1))


DEFAULT_RETRY = RetryPolicy()


def s3_client(*, botocore_retries: bool = False) -> Any:
    """A boto3 S3 client configured from the environment; ``botocore_retries``: botocore's standard retry mode
    (for writes), else none (reads: :func:`with_retries` resumes them). One client per process and environment
    (clients are thread-safe, and making one costs about 0.1 s; a forked worker makes its own, since the
    parent's open connections must not be shared)."""
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    return _client(botocore_retries, environment, os.getpid())


@functools.lru_cache(maxsize=8)
def _client(botocore_retries: bool, environment: tuple[tuple[str, str], ...], pid: int) -> Any:
    try:
        import boto3  # the optional `s3` extra: imported only when an s3:// URL is used
        from botocore.config import Config
    except ImportError:
        raise StoreError("s3:// URLs need boto3: pip install 'fastload[s3]'") from None
    retries = {"mode": "standard", "total_max_attempts": DEFAULT_RETRY.attempts if botocore_retries else 1}
    return boto3.session.Session().client("s3", config=Config(retries=retries, max_pool_connections=32))


def _status_and_code(exc: BaseException) -> tuple[int, str] | None:
    response = getattr(exc, "response", None)  # botocore's ClientError carries the parsed error response
    if not isinstance(response, dict):
        return None
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return status, str(response.get("Error", {}).get("Code", ""))


def retryable(exc: BaseException) -> bool:
    """A dropped or refused connection, a timeout, a body cut short, or a 5xx / throttling answer."""
    sc = _status_and_code(exc)
    if sc is not None:
        status, code = sc
        return status >= 500 or code in _RETRY_CODES
    # boto3 is the optional `s3` extra: imported only when an s3:// URL is used
    from botocore import exceptions as bx

    transient = (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, ConnectionError, TimeoutError,
                 http.client.HTTPException)
    return isinstance(exc, transient)


def with_retries(call: Callable[[], T], url: ObjectUrl, what: str, policy: RetryPolicy = DEFAULT_RETRY, *,
                 on_retry: Callable[[BaseException], None] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> T:
    """``call()``, retried with backoff while it fails with a :func:`retryable` error (``call`` resumes from its
    own state); any other failure, or the last retryable one, is raised as :func:`object_error`."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not retryable(exc) or attempt == policy.attempts or cancelled():
                raise object_error(exc, url, what, attempts=attempt) from exc
            if on_retry is not None:
                on_retry(exc)
            time.sleep(policy.wait_s(attempt))
    raise AssertionError("unreachable: the loop returns or raises")


def object_error(exc: BaseException, url: ObjectUrl, what: str, *, attempts: int = 1) -> StoreError:
    """One line for a failed request about ``url``: missing object or bucket, no credentials, access denied,
    or the last error after ``attempts`` tries. Never the credentials or the request's signature."""
    if isinstance(exc, StoreError):
        return exc
    sc = _status_and_code(exc)
    if sc is not None:
        status, code = sc
        if code == "NoSuchBucket":
            return StoreError(f"{url}: the bucket {url.bucket} does not exist (or these credentials cannot see it)")
        if code in _MISSING_CODES:
            return MissingObjectError(f"{url}: no such object")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(f"{url}: access denied ({code or status}); check the credentials in the environment "
                              f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return StoreError(f"{url}: no usable credentials for object storage ({exc}); set AWS_ACCESS_KEY_ID and "
                          f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return StoreError(f"{url}: {what} failed{tries}: {type(exc).__name__}: {' '.join(str(exc).split())}")
