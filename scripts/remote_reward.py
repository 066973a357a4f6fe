"""A reward served by another process over HTTP: the stand-in for a remote OCR / VLM service whose latency costs the
trainer's cores nothing (the work happens elsewhere; here it is a sleep).

The server answers POST /score {"images": [base64 PNG, ...]} after sleeping `--latency` seconds per request (one
request = one micro-batch) with {"scores": [-JPEG kB at quality 95, ...]} — the jpeg_compressibility score, about
1 ms per 64 px image, so the request costs the local machine almost no CPU. It serves requests concurrently.

    python scripts/remote_reward.py --latency 0.25 [--port 0]     # prints "PORT <n>" once listening
    gerl train recipes/tiny_cpu.yaml reward.name=scripts.remote_reward:remote_reward \\
        "reward.kwargs={url: http://127.0.0.1:<n>}"               # from the repository root
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


def _jpeg_kb(image: Image.Image) -> float:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000


class RemoteReward:
    """Client: one POST per call (micro-batch); scores = the server's. Picklable (holds only its arguments)."""

    name = "remote"

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def __call__(self, images, prompts, metadata) -> list[float]:
        encoded = []
        for im in images:
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            encoded.append(base64.b64encode(buf.getvalue()).decode())
        req = urllib.request.Request(f"{self.url}/score", data=json.dumps({"images": encoded}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return [float(s) for s in json.loads(r.read())["scores"]]

    def validate(self, prompts, metadata) -> None:
        from gerl.errors import UserError

        try:
            urllib.request.urlopen(f"{self.url}/health", timeout=5).read()
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"remote reward server {self.url} is not answering ({e}); start it with "
                            "`python scripts/remote_reward.py --latency 0.25` and pass its URL") from None


def remote_reward(url: str, timeout_s: float = 30.0) -> RemoteReward:
    """Factory (reward.name=scripts.remote_reward:remote_reward). Args: url of the server; timeout_s per request."""
    return RemoteReward(url, timeout_s)


def serve(latency: float, port: int = 0) -> ThreadingHTTPServer:
    """A server on 127.0.0.1 (port 0 = any free port: read server.server_address[1]); call serve_forever()."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply({"ok": True, "latency_s": latency})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            images = [Image.open(io.BytesIO(base64.b64decode(s))) for s in body["images"]]
            self._reply({"scores": [-_jpeg_kb(im) for im in images]})

        def _reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # one line per request would swamp a benchmark's output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--latency", type=float, default=0.25, help="seconds slept per request (one micro-batch)")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (printed as 'PORT <n>')")
    args = ap.parse_args(argv)
    if args.latency < 0:
        print("remote_reward: --latency must be ≥ 0 seconds", file=sys.stderr)
        return 2
    server = serve(args.latency, args.port)
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
