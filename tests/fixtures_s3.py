"""A real S3 endpoint on loopback for the session: moto in server mode, spoken to over HTTP by s3fs.

Import the fixture into a test module (``from tests.fixtures_s3 import s3  # noqa: F401``). Each
importing module gets its own instance, and moto's state is global to the process, so every instance
makes a bucket of its own name.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dist_harness import free_port

SECRET = "zeroray-test-secret-never-written"  # tests look for it in everything a save writes


@pytest.fixture(scope="session")
def s3() -> Iterator[dict[str, Any]]:
    """Yields {"bucket": URL of a fresh bucket, "options": fsspec storage options for it}."""
    import s3fs
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="zeroray-test", AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "zeroray-test", "secret": SECRET}
    try:
        bucket = f"zeroray-test-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield {"bucket": f"s3://{bucket}", "options": options}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
