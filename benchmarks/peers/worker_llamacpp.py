"""llama.cpp worker: drives a local llama-server (parallel slots, continuous batching).

Run with the main venv's python; see ../_common.py for the protocol. The server
is started here on 127.0.0.1 with ``-np N -cb -t 2``, the GGUF's own 4-bit
weights, and stopped by its PID. Requests go to its native ``/completion``
endpoint as token ids (greedy, ``ignore_eos``, fixed ``n_predict``), all at
once; slots are erased before every timed run so no run reuses a cached prompt.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import run_all, wait_healthy, worker_args  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def main() -> None:
    ap = worker_args(__doc__.splitlines()[0])
    ap.add_argument("--server", required=True, help="path to llama-server")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--parallel", type=int, default=32, help="slots (-np)")
    ap.add_argument("--slot-ctx", type=int, default=1024, help="context per slot")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [args.server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(args.parallel), "-cb", "-t", str(args.threads)]
    cmd += ["-c", str(args.parallel * args.slot_ctx), "--no-webui"]
    log = open(Path(args.out).with_suffix(".server.log"), "w")  # open while the server runs
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base, proc, "llama-server")
        load_s = time.perf_counter() - t0

        def one(r: dict) -> int:
            body = {
                "prompt": r["prompt_token_ids"],
                "n_predict": r["max_tokens"],
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "cache_prompt": True,
                "return_tokens": True,
            }
            out = post(base + "/completion", body)
            tokens = out.get("tokens")
            return len(tokens) if tokens is not None else int(out.get("tokens_predicted", 0))

        def run_once(workload: list[dict]) -> tuple[list[int], int]:
            with ThreadPoolExecutor(max_workers=len(workload)) as pool:
                return list(pool.map(one, workload)), 0

        def reset() -> None:
            for slot in range(args.parallel):
                try:
                    post(f"{base}/slots/{slot}?action=erase", {})
                except urllib.error.URLError:
                    pass

        # Its own per-token decode time, beside the common wall-clock arithmetic.
        own_decode_ms: list[float] = []

        def generate_one(prompt: list[int], max_tokens: int) -> int:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1}
            out = post(
                base + "/completion", {**body, "ignore_eos": True, "cache_prompt": False}
            )  # no reuse
            if max_tokens > 1:
                own_decode_ms.append(float(out["timings"]["predicted_per_token_ms"]))
            return int(out.get("tokens_predicted", 0))

        config = {"cmd": cmd[1:], "gguf": args.gguf, "own_decode_ms_per_token": own_decode_ms}
        run_all(args, run_once, reset, "llama.cpp", config, load_s, generate_one)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    main()
