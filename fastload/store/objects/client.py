"""The S3 client, and what a failed call means: retry it, the object is missing, or give up with one line.

Endpoint, region and credentials come only from the standard environment as boto3 reads it
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_DEFAULT_REGION``, the shared config files); fastload takes no option for them and never prints them.

Every request gives up on a server that does not answer within :data:`CONNECT_TIMEOUT_S` (connecting) or
:data:`READ_TIMEOUT_S` (between two packets of the answer), and a failed one is retried by :func:`with_retries`
for as long as a time budget allows (:class:`RetryPolicy`: ``retry_seconds=``, default ``$FASTLOAD_RETRY_SECONDS``,
else 10 minutes), so an outage shorter than the budget is only a wait. Reads get a client without botocore's
retries: a ranged read that fails resumes where it stopped instead of starting the range over. Writes use
botocore's standard retry mode for short faults (a PUT is all or nothing, redone whole), inside the budget.
"""
from __future__ import annotations

import functools
import http.client
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastload.store.base import StoreError
from fastload.store.objects.urls import ObjectUrl

T = TypeVar("T")

# S3 error codes that mean "try again" whatever the status (throttling, a timeout on the server's side)
_RETRY_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "503", "500"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}

CONNECT_TIMEOUT_S = 5.0  # a server that accepts no connection within this is down for this try
READ_TIMEOUT_S = 10.0  # a server that sends nothing for this long (stopped, hung) is down for this try
WRITE_ATTEMPTS = 4  # botocore's tries of one PUT (or one part of a multipart upload) before the budget's retry
RETRY_SECONDS_VARIABLE = "FASTLOAD_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 600.0  # a node restarting, a server failing over: minutes, not the seconds of a blip
REPORT_AFTER_S = 5.0  # a fault retried away sooner is not reported: blips stay quiet
REPORT_EVERY_S = 30.0  # at most one line on stderr per process this often while requests keep failing


class MissingObjectError(StoreError):
    """The object does not exist (its bucket does)."""


class UnavailableError(StoreError):
    """Requests that kept failing (the server down, hung or unreachable) for the whole retry budget."""


class ShortRead(ConnectionError):
    """A response body that ended before the bytes it promised (a dropped connection the client did not notice)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long a failing request is retried: while less than ``seconds`` have passed since it started failing
    (a retry that made progress starts the count again), waiting ``base_s`` before the first retry and twice as
    long before each next one, at most ``max_s``; ``seconds=0``: one try. ``setting`` names where ``seconds``
    came from, for the lines that report a wait."""

    seconds: float = DEFAULT_RETRY_SECONDS
    base_s: float = 0.25
    max_s: float = 8.0
    setting: str = ""

    def wait_s(self, retry: int) -> float:
        return min(self.max_s, self.base_s * 2 ** min(retry - 1, 30))

    def budget(self) -> str:
        return self.setting or f"{self.seconds:g} s"


def retry_policy(retry_seconds: float | None = None) -> RetryPolicy:
    """The policy for ``retry_seconds`` (>= 0), or when it is None, for ``$FASTLOAD_RETRY_SECONDS`` (default 600).
    A bad value is a StoreError (the environment's) or ValueError (the argument's) naming it."""
    if retry_seconds is not None:
        seconds = float(retry_seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"retry_seconds must be a number of seconds >= 0 (0: one try), got {retry_seconds!r}")
        return RetryPolicy(seconds, setting=f"retry_seconds={seconds:g}")
    text = os.environ.get(RETRY_SECONDS_VARIABLE, "").strip()
    if not text:
        unset = f"{RETRY_SECONDS_VARIABLE} unset: {DEFAULT_RETRY_SECONDS:g} s"
        return RetryPolicy(DEFAULT_RETRY_SECONDS, setting=unset)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds < 0:
        raise StoreError(f"{RETRY_SECONDS_VARIABLE}={text!r} in the environment: not a number of seconds >= 0 (how "
                         f"long a request to object storage is retried; 0: one try)")
    return RetryPolicy(seconds, setting=f"{RETRY_SECONDS_VARIABLE}={text}")


def s3_client(*, botocore_retries: bool = False) -> Any:
    """A boto3 S3 client configured from the environment, with :data:`CONNECT_TIMEOUT_S` and
    :data:`READ_TIMEOUT_S`; ``botocore_retries``: botocore's standard retry mode, :data:`WRITE_ATTEMPTS` tries
    (for writes), else one try (reads: :func:`with_retries` resumes them). One client per process and
    environment (clients are thread-safe, and making one costs about 0.1 s; a forked worker makes its own, since
    the parent's open connections must not be shared)."""
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    attempts = WRITE_ATTEMPTS if botocore_retries else 1
    return _client(attempts, CONNECT_TIMEOUT_S, READ_TIMEOUT_S, environment, os.getpid())


@functools.lru_cache(maxsize=8)
def _client(attempts: int, connect_timeout: float, read_timeout: float, environment: tuple[tuple[str, str], ...],
            pid: int) -> Any:
    try:
        import boto3  # the optional `s3` extra: imported only when an s3:// URL is used
        from botocore.config import Config
    except ImportError:
        raise StoreError("s3:// URLs need boto3: pip install 'fastload[s3]'") from None
    config = Config(retries={"mode": "standard", "total_max_attempts": attempts}, max_pool_connections=32,
                    connect_timeout=connect_timeout, read_timeout=read_timeout)
    return boto3.session.Session().client("s3", config=config)


def _status_and_code(exc: BaseException) -> tuple[int, str] | None:
    response = getattr(exc, "response", None)  # botocore's ClientError carries the parsed error response
    if not isinstance(response, dict):
        return None
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return status, str(response.get("Error", {}).get("Code", ""))


def _cause(exc: BaseException) -> BaseException:
    """The error that decides: boto3's upload_file wraps the one it met (S3UploadFailedError) in its own."""
    if type(exc).__name__ == "S3UploadFailedError" and exc.__context__ is not None:
        return exc.__context__
    return exc


def retryable(exc: BaseException) -> bool:
    """A dropped or refused connection, a timeout, a body cut short, or a 5xx / throttling answer."""
    exc = _cause(exc)
    sc = _status_and_code(exc)
    if sc is not None:
        status, code = sc
        return status >= 500 or code in _RETRY_CODES
    # boto3 is the optional `s3` extra: imported only when an s3:// URL is used
    from botocore import exceptions as bx

    transient = (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, ConnectionError, TimeoutError,
                 http.client.HTTPException)
    return isinstance(exc, transient)


# This process's outage: since when its requests have been failing with none answered in between (None: the last
# one was answered), and its latest failure. A request that starts failing during an outage counts its budget from
# the outage's start, so the reads that come one after another (the shards of a batch, the batches a worker has
# queued) fail together once the server has been out for the budget, not each after a budget of its own.
_outage: list[float | None] = [None, -math.inf]
OUTAGE_GAP_S = 60.0  # no request failed for this long: the outage is over (a waiting one fails every 8 + 15 s at most)


def _outage_start(now: float) -> float:
    """When this process's outage began, given a failure ``now``: a new one unless a request failed recently."""
    since, latest = _outage
    if since is None or now - latest > OUTAGE_GAP_S:
        since = now
    _outage[:] = [since, now]
    return since


def with_retries(call: Callable[[], T], url: ObjectUrl, what: str, policy: RetryPolicy | None = None, *,
                 on_retry: Callable[[BaseException], None] | None = None, cancelled: threading.Event | None = None,
                 progress: Callable[[], int] = lambda: 0) -> T:
    """``call()``, retried with backoff while it fails with a :func:`retryable` error, for at most
    ``policy.seconds`` after its first failure, or after the first failure of this process's outage when it
    starts failing during one (``policy`` default: :func:`retry_policy`, read from the environment now); the last
    try starts before then, so it gives up within the budget and one try's timeouts. ``call`` resumes from its
    own state; ``progress()`` says how far it got: a failed try that got further than the one before starts the
    count again (the server answered: a slow, flaky link is not an outage). While it waits, a line on stderr says
    so (:data:`REPORT_AFTER_S`, :data:`REPORT_EVERY_S`). A retryable failure past the budget is raised as
    :class:`UnavailableError` (its line names the tries and the time); any other, or one once ``cancelled`` is
    set, as :func:`object_error`."""
    policy = policy or retry_policy()
    tries, retry, reached = 0, 0, 0
    failing_since: float | None = None
    while True:
        tries += 1
        try:
            answer = call()
        except Exception as exc:
            if not retryable(exc):
                raise object_error(exc, url, what) from exc
            now = time.monotonic()
            if progress() != reached:  # the server answered part of it: no outage until now
                reached, failing_since, retry, _outage[0] = progress(), None, 0, None
            outage_began = _outage_start(now)
            if failing_since is None:
                failing_since = outage_began
            failed_for = now - failing_since
            if failed_for < policy.seconds and not (cancelled is not None and cancelled.is_set()):
                retry += 1
                if on_retry is not None:
                    on_retry(exc)
                _report_wait(url, exc, failed_for, policy)
                pause = min(policy.wait_s(retry), policy.seconds - failed_for)  # the last try at the budget's end
                if cancelled is None:
                    time.sleep(pause)
                    continue
                if not cancelled.wait(pause):  # woken early when cancelled: no try after that
                    continue
            tried = f"{tries} {'try' if tries == 1 else 'tries'}"
            error = object_error(exc, url, what, after=f" after {tried} in {failed_for:.0f} s (retry budget: "
                                                       f"{policy.budget()})")
            raise (UnavailableError(str(error)) if failed_for >= policy.seconds else error) from exc
        _outage[0] = None
        return answer


# The last time this process said that a request keeps failing: the ranged reads of a shard, the objects of a
# staging, the loader's read-ahead all wait on the same server, and one line says it for all of them.
_last_report = [-math.inf]
_report_lock = threading.Lock()


def _reset_reports_after_fork() -> None:
    global _report_lock
    _report_lock = threading.Lock()  # a thread of the parent may have held it across the fork


os.register_at_fork(after_in_child=_reset_reports_after_fork)


def _report_wait(url: ObjectUrl, exc: BaseException, failed_for: float, policy: RetryPolicy) -> None:
    """One line on stderr saying that requests to ``url`` keep failing and for how long they will be retried: once
    one has failed for :data:`REPORT_AFTER_S`, then at most every :data:`REPORT_EVERY_S` in this process."""
    if failed_for < REPORT_AFTER_S:
        return
    with _report_lock:
        now = time.monotonic()
        if now - _last_report[0] < REPORT_EVERY_S:
            return
        _last_report[0] = now
    print(f"fastload: {url} unavailable for {failed_for:.0f} s ({_fault_name(exc)}); retrying for up to "
          f"{max(0.0, policy.seconds - failed_for):.0f} s more (retry budget: {policy.budget()})", file=sys.stderr,
          flush=True)


def _fault_name(exc: BaseException) -> str:
    """What went wrong, in a word or two: the error's class, and an answer's status and code (never its text)."""
    exc = _cause(exc)
    sc = _status_and_code(exc)
    return type(exc).__name__ if sc is None else f"HTTP {sc[0]} {sc[1]}".strip()


def missing_bucket(url: ObjectUrl) -> StoreError:
    """The error for a bucket that does not exist (as S3 answers: or that these credentials cannot see)."""
    return StoreError(f"{url}: the bucket {url.bucket} does not exist (or these credentials cannot see it)")


def object_error(exc: BaseException, url: ObjectUrl, what: str, *, after: str = "") -> StoreError:
    """One line for a failed request about ``url``: missing object or bucket, no credentials, access denied,
    or the last error ``after`` the tries that were made. Never the credentials or the request's signature."""
    if isinstance(exc, StoreError):
        return exc
    exc = _cause(exc)
    sc = _status_and_code(exc)
    if sc is not None:
        status, code = sc
        if code == "NoSuchBucket":
            return missing_bucket(url)
        if code in _MISSING_CODES:
            return MissingObjectError(f"{url}: no such object")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(f"{url}: access denied ({code or status}); check the credentials in the environment "
                              f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return StoreError(f"{url}: no usable credentials for object storage ({exc}); set AWS_ACCESS_KEY_ID and "
                          f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")
    return StoreError(f"{url}: {what} failed{after}: {type(exc).__name__}: {' '.join(str(exc).split())}")
