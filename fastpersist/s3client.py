"""The S3 client of fastpersist's object-storage layer: boto3 (botocore), configured the
standard AWS way, with S3's retries, and its errors turned into named ones.

Optional: ``pip install "fastpersist[s3]"``. Nothing in fastpersist imports boto3 until
an ``s3://`` URL is used; without it, :func:`client` raises ``ImportError`` saying how
to install it.

Configuration is boto3's own: credentials, region and endpoint from the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``) and the config and credentials files
(``endpoint_url`` and ``s3.addressing_style`` of a profile included). Against an
S3-compatible store (an endpoint is configured) addressing is path-style and payloads
are not SHA-256-signed (``payload_signing_enabled = false``: every part carries a
Content-MD5 instead, as botocore does over HTTPS) unless the profile's ``s3`` section
says otherwise, and request checksums are sent only when the operation needs them
(``when_required``) unless ``AWS_REQUEST_CHECKSUM_CALCULATION`` says otherwise. Retries follow botocore's
``standard`` mode (500, 502, 503, 504, throttling such as ``SlowDown``, connection
resets and timeouts; exponential backoff with jitter), 8 attempts unless
``AWS_MAX_ATTEMPTS``/``AWS_RETRY_MODE`` say otherwise.

Credentials that expire: those botocore refreshes itself (an assumed role, a web
identity token file as on EKS, the instance or container metadata service, SSO,
``credential_process``) are refreshed by the cached client; static keys are read again
when they change: a client is made anew when an ``AWS_*`` variable or the config or
credentials file changes (a sidecar that rewrites ``~/.aws/credentials`` before the old
session token expires), so the next request after the change signs with the new keys.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

from fastpersist.errors import ObjectStoreError

__all__ = ["ObjectNotFoundError", "client", "store_error"]

#: Attempts per request when AWS_MAX_ATTEMPTS does not say (botocore's standard mode).
DEFAULT_ATTEMPTS = 8

_lock = threading.Lock()
_clients: dict[tuple, Any] = {}


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """The object (or its bucket) does not exist."""


def _import_boto3() -> Any:
    try:
        import boto3  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError as e:
        raise ImportError("s3:// URLs need the s3 extra: pip install 'fastpersist[s3]' (boto3)") from e
    return boto3


def _endpoint_configured(session: Any) -> bool:
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        return True
    try:
        scoped = session._session.get_scoped_config()  # noqa: SLF001 - botocore's documented profile view
    except Exception:  # noqa: BLE001 - a missing profile is reported by the first request
        return False
    return bool(scoped.get("endpoint_url") or (scoped.get("s3") or {}).get("endpoint_url"))


def _profile_s3(session: Any) -> dict:
    """The ``s3`` section of the profile in use (empty when none)."""
    try:
        scoped = session._session.get_scoped_config()  # noqa: SLF001
    except Exception:  # noqa: BLE001
        return {}
    section = scoped.get("s3")
    return section if isinstance(section, dict) else {}


def _files_version() -> tuple:
    """What identifies the current contents of the config and credentials files
    (changed: keys rotated), without reading them."""
    out: list[Any] = []
    for var, default in (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")):
        try:
            st = os.stat(os.path.expanduser(os.environ.get(var) or default))
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def client(max_connections: int = 16, timeout: float = 60.0) -> Any:
    """A botocore S3 client from the standard AWS configuration (see the module
    docstring), cached per process, configuration, ``max_connections`` and ``timeout``
    (seconds to connect, and per read, before a request is retried)."""
    key = (os.getpid(), max_connections, timeout) + tuple(
        os.environ.get(n, "") for n in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                                         "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                                         "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                         "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_REQUEST_CHECKSUM_CALCULATION")
    ) + _files_version()
    with _lock:
        c = _clients.get(key)
        if c is not None:
            return c
        boto3 = _import_boto3()
        from botocore.config import Config  # noqa: PLC0415 - optional dependency

        session = boto3.session.Session()
        kwargs: dict[str, Any] = {"max_pool_connections": max_connections, "connect_timeout": timeout,
                                  "read_timeout": timeout}
        if not os.environ.get("AWS_MAX_ATTEMPTS") and not os.environ.get("AWS_RETRY_MODE"):
            kwargs["retries"] = {"mode": "standard", "max_attempts": DEFAULT_ATTEMPTS}
        if _endpoint_configured(session):
            profile_s3 = _profile_s3(session)
            s3: dict[str, Any] = {}
            if "addressing_style" not in profile_s3:
                s3["addressing_style"] = "path"
            if "payload_signing_enabled" not in profile_s3:
                # Over plain HTTP botocore would SHA-256 every part for the signature (and the
                # store would verify it): two more passes over every byte, which halved uploads
                # in docs/objectstore.md's measurement. Parts carry a Content-MD5 instead, as
                # botocore itself does over HTTPS.
                s3["payload_signing_enabled"] = False
            if s3:
                kwargs["s3"] = s3
            if not os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION"):
                kwargs["request_checksum_calculation"] = "when_required"
                kwargs["response_checksum_validation"] = "when_required"
        region = session.region_name or "us-east-1"
        c = session.client("s3", region_name=region, config=Config(**kwargs))
        for old in [k for k in _clients if k[:-2] == key[:-2]]:  # the same settings before the files changed
            del _clients[old]  # (operations under way keep their client)
        _clients[key] = c
        return c


_CREDENTIALS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                "TokenRefreshRequired", "AllAccessDisabled", "403")
_MISSING = ("NoSuchBucket", "NoSuchKey", "404", "NotFound")
_TRANSIENT = ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "500", "502", "503", "504",
              "Throttling", "ThrottlingException", "RequestTimeTooSkewed")


def error_code(e: BaseException) -> str:
    """The store's error code of a botocore exception, or its class name."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        if code:
            return str(code)
    return type(e).__name__


def store_error(e: BaseException, url: str, operation: str, saving: bool) -> ObjectStoreError:
    """A named error for a failed request ``operation`` on ``url``: what failed, the
    store's code, and what to do."""
    code = error_code(e)
    after = (" The previous object under this key, if any, is untouched and the multipart upload was aborted."
             if saving else "")
    if code in _MISSING or code == "NoSuchUpload":
        if code == "NoSuchKey" or (code in ("404", "NotFound") and not saving and operation != "HeadBucket"):
            what = f"no object at {url}"
        elif code == "NoSuchUpload":
            what = f"the multipart upload of {url} vanished (aborted by someone else, or by a lifecycle rule)"
        else:
            what = f"the bucket of {url} does not exist (or the endpoint is wrong): create it or fix the URL"
        return ObjectNotFoundError(f"{operation} failed: {what} [{code}].{after}", url, operation, code)
    if code in _CREDENTIALS or code in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        hint = ("the store refused the credentials or the request: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, the session token's expiry, and the bucket policy")
        if code.endswith("Error") and code.startswith(("NoCred", "Partial", "CredentialRet")):
            hint = "no usable credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        return ObjectStoreError(f"{operation} on {url} failed: {hint} [{code}: {e}].{after}", url, operation, code)
    if code in _TRANSIENT or code in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                                      "ConnectTimeoutError", "ResponseStreamingError", "ProtocolError"):
        return ObjectStoreError(
            f"{operation} on {url} failed after botocore's retries with backoff: the store or the network kept "
            f"failing [{code}: {e}]; try again later, or raise AWS_MAX_ATTEMPTS.{after}", url, operation, code)
    return ObjectStoreError(f"{operation} on {url} failed [{code}: {e}].{after}", url, operation, code)


def is_client_error(e: BaseException) -> bool:
    """Whether ``e`` came from botocore (a request that failed), as opposed to a bug or
    an interrupt on our side."""
    mod = type(e).__module__ or ""
    return mod.startswith(("botocore", "urllib3", "boto3"))


def head(c: Any, bucket: str, key: str, url: str) -> tuple[int, str]:
    """``(size, etag)`` of an object; :class:`ObjectNotFoundError` when there is none."""
    try:
        r = c.head_object(Bucket=bucket, Key=key)
    except Exception as e:  # noqa: BLE001 - turned into a named error
        if not is_client_error(e):
            raise
        raise store_error(e, url, "HeadObject", saving=False) from e
    return int(r["ContentLength"]), str(r.get("ETag", ""))


def client_version() -> str:
    """``boto3 X, botocore Y`` of the installed client."""
    boto3 = _import_boto3()
    import botocore  # noqa: PLC0415 - optional dependency

    return f"boto3 {boto3.__version__}, botocore {botocore.__version__}"


def max_attempts(default: Optional[int] = None) -> int:
    """Attempts per request as configured (for messages)."""
    v = os.environ.get("AWS_MAX_ATTEMPTS")
    return int(v) if v and v.isdigit() else (default or DEFAULT_ATTEMPTS)
