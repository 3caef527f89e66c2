"""moto's S3 server, with its objects kept on disk across restarts.

moto keeps objects in memory only. In deploy/compose.host.yaml the S3 origin also holds
the registry, while every node keeps its cache on a volume: a restarted stack came back
with full caches and an empty registry, and the next `edgecache publish` of a dataset made
a second, different NAME@1 beside the one the caches held. Here the buckets are saved to
STATE_DIR (a volume) within a second of every write and at stop (SIGTERM), and loaded at
start, ETags and all (a multipart object keeps its "-N" ETag, which manifests record).

    python3 s3-origin.py [-H 127.0.0.1] [-p 17000] [--state-dir /var/lib/s3-origin]

A state file this moto cannot load stops the server (exit 2) rather than start it empty.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.s3.models import s3_backends
from werkzeug.serving import make_server

ACCOUNT, PARTITION = "123456789012", "aws"  # moto's default account
MUTATING = {"PUT", "POST", "DELETE"}
HEALTH_PATH = "/_health"  # no bucket name starts with "_": never an S3 request
log = logging.getLogger("s3-origin")


class Saved:
    """The S3 backend's buckets, pickled to ``path`` when a write has changed them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()  # writes and saves never overlap
        self.saving = threading.Lock()  # one save at a time: the saver's and the last one
        self.dirty = threading.Event()
        self.failing: str | None = None  # why the last save failed, until one succeeds

    @property
    def backend(self):  # noqa: ANN201 - moto's S3Backend
        """The S3 backend of moto's default account."""
        return s3_backends[ACCOUNT][PARTITION]

    def load(self) -> int:
        """Put the saved buckets back; how many. Exits on a state it cannot load."""
        if not self.path.exists():
            return 0
        try:
            buckets = pickle.loads(self.path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - any failure: refuse to start empty
            print(
                f"s3-origin: cannot load {self.path} ({exc!r}); it was written by another "
                "moto version or is damaged. Move it away to start empty (the registry goes "
                "with it: clear the nodes' cache volumes too)",
                file=sys.stderr,
            )
            sys.exit(2)  # as the docstring says (sys.exit with a message exits 1)
        self.backend.buckets.update(buckets)
        for name in buckets:
            s3_backends.bucket_accounts[name] = (PARTITION, ACCOUNT)
        return len(buckets)

    def save(self) -> None:
        """Write the buckets, atomically (a temporary file, fsync, rename).

        The saver thread and the save at stop may run at once: both would write the one
        temporary file, so saves take turns.
        """
        with self.saving:
            with self.lock:
                self.dirty.clear()
                data = pickle.dumps(dict(self.backend.buckets), protocol=pickle.HIGHEST_PROTOCOL)
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)

    def saver(self) -> None:
        """Save soon after writes, in a thread, until a save succeeds.

        A failed save (a full or unwritable volume) is logged and tried again each second:
        it once ended this thread, and the server went on acknowledging writes that no
        later save would keep, until a kill lost them.
        """
        while True:
            self.dirty.wait()
            time.sleep(0.2)  # one save for a burst of writes
            try:
                self.save()
            except Exception as exc:  # noqa: BLE001 - any failure: say so, keep the writes, retry
                self.dirty.set()
                self.failing = f"cannot save to {self.path}: {exc!r}; trying again each second"
                log.exception("cannot save to %s; trying again in 1 s", self.path)
                time.sleep(1)
            else:
                self.failing = None

    def middleware(self, app):  # noqa: ANN001, ANN201 - WSGI
        """``app`` with writes serialised against saves, each marking the state dirty."""

        def wrapped(environ, start_response):  # noqa: ANN001, ANN202
            if environ.get("PATH_INFO") == HEALTH_PATH:
                # The healthcheck's: unhealthy while writes are acknowledged but not saved
                # (a kill would lose them), not merely while the server answers.
                failing = self.failing
                status = "503 Service Unavailable" if failing else "200 OK"
                start_response(status, [("Content-Type", "text/plain")])
                return [(failing or "ok").encode() + b"\n"]
            if environ.get("REQUEST_METHOD") not in MUTATING:
                return app(environ, start_response)
            with self.lock:
                body = list(app(environ, start_response))
            self.dirty.set()
            return body

        return wrapped


def main() -> None:
    """Serve until SIGTERM or Ctrl-C, then save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/s3-origin"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.state_dir.mkdir(parents=True, exist_ok=True)
    saved = Saved(args.state_dir / "s3.pickle")
    count = saved.load()
    log.info("loaded %d bucket(s) from %s", count, saved.path)
    app = saved.middleware(DomainDispatcherApplication(create_backend_app))
    server = make_server(args.host, args.port, app, threaded=True)
    threading.Thread(target=saved.saver, daemon=True).start()

    def stop(signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("S3 on http://%s:%d, objects kept in %s", args.host, args.port, args.state_dir)
    server.serve_forever()
    saved.save()
    log.info("stopped; objects saved to %s", saved.path)


if __name__ == "__main__":
    main()
