"""`spike-whale push --timeout S` bounds each answer as a whole, not only each read of it: a server that sends its
headers and then a byte now and then (never S seconds apart) must not hold the push open."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from _tiny_folder import write_tiny_folder
from spike_whale.hub_export.folder import write_provenance

TRICKLE_GAP_S = 0.5  # well under --timeout: no single read ever waits that long
TRICKLE_BYTES = 40  # then the server hangs up, so an unbounded client returns after 20 s (not never)
MAX_CONNECTIONS = 4


def export_folder(path):
    """A folder that passes push's checks (every export file, checksums in provenance.json); no weights are sent."""
    write_tiny_folder(path)
    (path / "README.md").write_text("---\nlibrary_name: transformers\n---\n", encoding="utf-8")
    write_provenance(path, source={}, conversion={}, verification=None)
    return path


def trickling_server(stop_at: float, stop: threading.Event):
    """127.0.0.1 server answering each request with headers, then one byte every TRICKLE_GAP_S; it serves at most
    MAX_CONNECTIONS connections and none after `stop_at` (it stops by itself), or ends early once `stop` is set."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)

    def trickle(conn):
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
                for _ in range(TRICKLE_BYTES):
                    if stop.wait(TRICKLE_GAP_S):
                        break
                    conn.sendall(b" ")
            except OSError:  # the client gave up and closed the connection
                pass

    def serve():
        served = 0
        with server:
            while served < MAX_CONNECTIONS and time.monotonic() < stop_at and not stop.is_set():
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                served += 1
                threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def test_push_gives_up_on_a_hub_that_trickles_its_answer(tmp_path):
    folder = export_folder(tmp_path / "export")
    stop = threading.Event()
    port, server = trickling_server(time.monotonic() + 60, stop)
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN="hf_test", HF_HUB_OFFLINE="0",
               HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "spike_whale", "push", str(folder), "me/x", "--timeout", "2",
                               "--retries", "0"], capture_output=True, text=True, env=env, timeout=120)
    finally:
        elapsed = time.monotonic() - t0
        stop.set()
        server.join(timeout=5)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert err[0] == "spike-whale push: error: push to me/x failed: ReadTimeout: no complete answer within 2s of the " \
                     "request (--timeout)", err
    # 2 s for the answer plus the interpreter's start and the folder's checks, far from the 20 s of trickling
    assert elapsed < 12, elapsed
