"""Start-up costs of ``hybridspec``: import, engine load, serve-to-ready, first and later chat.

Run from the repository root with the environment's interpreter, e.g.::

    .venv/bin/python benchmarks/experiments/serving/startup.py  # warm caches
    .venv/bin/python benchmarks/experiments/serving/startup.py --fresh-numba  # fresh install

Each figure is measured in a fresh process: ``import hybridspec`` (in-process time, median of
``--repeats``), ``Engine()`` on the embedded model (median), then ``hybridspec serve`` from
launch to the first ``/health`` 200, followed by ``--chats`` identical chat requests, each
timed. ``--fresh-numba`` first deletes numba's on-disk cache (``*.nbi``/``*.nbc`` beside the
package's sources), which is what a fresh install starts from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from hybridspec.bench import free_port

ROOT = Path(__file__).resolve().parents[3]
IMPORT_SNIPPET = (
    "import time; t = time.perf_counter(); import hybridspec; print(time.perf_counter() - t)"
)
ENGINE_SNIPPET = (
    "import time; from hybridspec import Engine; t = time.perf_counter(); Engine(); "
    "print(time.perf_counter() - t)"
)
CHAT = {
    "messages": [{"role": "user", "content": "Rename x to count: def f(x): return x + 1"}],
    "max_tokens": 32,
    "temperature": 0,
    "proposer": "ngram",
}


def seconds_printed(snippet: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def delete_numba_cache() -> int:
    files = [*ROOT.glob("hybridspec/**/__pycache__/*.nbi"), *ROOT.glob("hybridspec/**/*.nbc")]
    for path in files:
        path.unlink()
    return len(files)


def get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def post_chat(base: str) -> float:
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(CHAT).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def serve_and_chat(num_chats: int, timeout_s: float) -> tuple[float, list[float], str]:
    """Seconds from launching ``hybridspec serve`` to /health 200, each chat's latency, and the
    server's ``ready:`` line (empty if it logged none)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "hybridspec"), "serve", "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while get_status(f"{base}/health") != 200:
                if server.poll() is not None or time.perf_counter() - start > timeout_s:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.05)
            ready_s = time.perf_counter() - start
            chats = [post_chat(base) for _ in range(num_chats)]
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    return ready_s, chats, next((line for line in lines if "ready:" in line), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of the import and load")
    parser.add_argument("--chats", type=int, default=3, help="chat requests after ready")
    parser.add_argument("--fresh-numba", action="store_true", help="delete numba's cache first")
    parser.add_argument("--skip-engine", action="store_true", help="skip the Engine() timing")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    args = parser.parse_args()
    if args.fresh_numba:
        print(f"deleted {delete_numba_cache()} numba cache files")
    imports = [seconds_printed(IMPORT_SNIPPET) for _ in range(args.repeats)]
    print(f"import hybridspec: median {statistics.median(imports):.2f} s of {_listed(imports)}")
    if not args.skip_engine:
        loads = [seconds_printed(ENGINE_SNIPPET) for _ in range(args.repeats)]
        print(f"Engine():          median {statistics.median(loads):.2f} s of {_listed(loads)}")
    if args.fresh_numba:
        delete_numba_cache()  # Engine() above may have compiled some kernels
    ready_s, chats, ready_line = serve_and_chat(args.chats, args.timeout)
    print(f"serve -> /health 200: {ready_s:.2f} s ({ready_line or 'no ready: line'})")
    print("chat requests: " + ", ".join(f"{s:.2f} s" for s in chats))


def _listed(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


if __name__ == "__main__":
    main()
