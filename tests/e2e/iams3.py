"""An S3-compatible server that enforces IAM: moto with ``INITIAL_NO_AUTH_ACTION_COUNT``.

The first actions (the bucket, then one IAM user, inline policy and access key per principal) run unchecked;
every later request must be signed by one of those users and is allowed only by its policy, resource ARNs
included. So the object-store policy ``vlmq acl`` prints is tested as the store applies it.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from vlmq.embedded import Server, free_port, wait_for_port

BUCKET = "vlmq-iam"
FULL = "full"  # the principal holding the whole bucket (workers, the operator)


def full_policy(bucket: str) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}


def start(policies: Mapping[str, dict[str, Any]]) -> tuple[Server, dict[str, dict[str, str]]]:
    """A moto server with ``BUCKET`` and one user per entry of ``policies`` (plus ``FULL``).

    Returns:
        The server and, per principal, the ``AWS_*`` variables that sign as it.
    """
    import boto3

    users = {FULL: full_policy(BUCKET), **policies}
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "INITIAL_NO_AUTH_ACTION_COUNT": str(1 + 3 * len(users))}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    wait_for_port(port, proc=proc)
    server = Server(f"http://127.0.0.1:{port}", port, proc)
    kw = {"endpoint_url": server.url, "region_name": "us-east-1", "aws_access_key_id": "test",
          "aws_secret_access_key": "test"}
    boto3.client("s3", **kw).create_bucket(Bucket=BUCKET)
    iam, creds = boto3.client("iam", **kw), {}
    for user, policy in users.items():
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="vlmq", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        creds[user] = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                       "AWS_DEFAULT_REGION": "us-east-1"}
    return server, creds


@contextlib.contextmanager
def signing_as(creds: Mapping[str, str]) -> Iterator[None]:
    """Environment credentials for the boto3 clients created inside (a fresh default session reads them)."""
    import boto3

    saved = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    boto3.DEFAULT_SESSION = None  # a session keeps the credentials it first resolved
    try:
        yield
    finally:
        boto3.DEFAULT_SESSION = None
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
