"""A real S3 endpoint for tests: moto's server over HTTP on a loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``moto_server`` on 127.0.0.1 (never 0.0.0.0); yield its endpoint URL.

    ``env``: extra settings for the server, e.g. ``INITIAL_NO_AUTH_ACTION_COUNT=0``
    for one that checks credentials (moto accepts any by default).
    """
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment that points botocore (and subprocess nodes) at the endpoint."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def make_bucket(endpoint: str, bucket: str, *, versioned: bool = True) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs())
    client.create_bucket(Bucket=bucket)
    if versioned:
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})


def upload_dir(endpoint: str, bucket: str, prefix: str, root: Path) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs())
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes()
            )


def put_object(endpoint: str, bucket: str, key: str, body: bytes) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs()).put_object(
        Bucket=bucket, Key=key, Body=body
    )


def _boto_kwargs() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def apply_env(endpoint: str) -> dict[str, str | None]:
    """Set the S3 environment in this process; returns what to restore."""
    saved = {k: os.environ.get(k) for k in s3_env(endpoint)}
    os.environ.update(s3_env(endpoint))
    return saved
