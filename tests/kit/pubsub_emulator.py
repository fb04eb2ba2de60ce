"""The real Pub/Sub emulator (google-cloud-cli-pubsub-emulator, Java) for the tests.

Started on a free loopback port with its data in a temp dir; ready when it logs "Server started";
killed (its whole process group) and removed when the context exits, also on failure.
``topic_and_subscription`` makes a fresh topic and a subscription on it there for one test.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.ports import free_port

START_TIMEOUT_S = 90  # a JVM start on a loaded 2-core machine


def emulator_bin() -> Path | None:
    for pattern in (
        "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator",
        "/usr/share/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator",
        "/opt/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator",
    ):
        for p in glob.glob(pattern):
            return Path(p)
    return None


def unavailable() -> str | None:
    if emulator_bin() is None:
        return "no Pub/Sub emulator (apt-get install google-cloud-cli-pubsub-emulator)"
    if shutil.which("java") is None:
        return "the Pub/Sub emulator needs Java (apt-get install default-jre-headless)"
    try:
        import google.cloud.pubsub_v1  # noqa: F401
    except ImportError:
        return "google-cloud-pubsub is not installed (the [pubsub] extra)"
    return None


@contextmanager
def pubsub_emulator() -> Iterator[str]:
    """Yield the emulator's ``host:port`` (for PUBSUB_EMULATOR_HOST)."""
    binary = emulator_bin()
    assert binary is not None
    root = Path(tempfile.mkdtemp(prefix="gcewd-pubsub-"))
    port = free_port()
    log = root / "emulator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(binary), "--host=127.0.0.1", f"--port={port}", f"--dir={root / 'data'}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the JVM and its wrapper die together
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Server started" not in log.read_bytes():
            if proc.poll() is not None:
                raise RuntimeError(f"the emulator exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the emulator did not start in {START_TIMEOUT_S}s")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class TopicSub:
    """A topic and its subscription (full resource names), with the clients that made them."""

    publisher: Any  # google.cloud.pubsub_v1.PublisherClient
    subscriber: Any  # google.cloud.pubsub_v1.SubscriberClient
    topic: str
    subscription: str


@contextmanager
def topic_and_subscription(
    project: str, topic: str, subscription: str, ack_deadline_s: int = 10
) -> Iterator[TopicSub]:
    """A fresh topic ``<topic>-<pid>-<random>`` and subscription ``<subscription>-<same>`` on it,
    on the emulator that PUBSUB_EMULATOR_HOST names (set it before: the clients read it when
    made). ``ack_deadline_s``: 10, the minimum and the default (pubsub.v1.json
    ``Subscription.ackDeadlineSeconds``). Both are deleted, and the subscriber closed, on exit."""
    from google.cloud import pubsub_v1

    n = f"{os.getpid()}-{random.getrandbits(32):x}"
    pub, sub = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    t = pub.topic_path(project, f"{topic}-{n}")
    s = sub.subscription_path(project, f"{subscription}-{n}")
    pub.create_topic(request={"name": t})
    sub.create_subscription(request={"name": s, "topic": t, "ack_deadline_seconds": ack_deadline_s})
    try:
        yield TopicSub(pub, sub, t, s)
    finally:
        sub.delete_subscription(request={"subscription": s})
        pub.delete_topic(request={"topic": t})
        sub.close()


def publish_all(publisher: Any, topic: str, datas: list[bytes]) -> None:
    """Publish every message of ``datas`` to ``topic`` and wait until the emulator took each."""
    for f in [publisher.publish(topic, d) for d in datas]:
        f.result(timeout=30)
