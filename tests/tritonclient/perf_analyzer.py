"""Triton's own perf_analyzer (tritonclient 2.41's wheel) against `epserve launch`, with no glue
but a data file of hidden states: synchronous, asynchronous and streaming gRPC, synchronous and
asynchronous HTTP (KServe REST), and with its tensors in system shared memory over both, each
with zero errors and with the server-side statistics it reads from ModelStatistics.

perf_analyzer's own data is random bytes for every input, the optional routing inputs
included; random bytes are not finite floats nor expert ids, so it is given real rows of
hidden_states (its --input-data JSON), and leaves the optional inputs out.

Usage: perf_analyzer.py path/to/epserve cache-dir
"""

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

import numpy as np

from check import launch

HERE = os.path.dirname(os.path.abspath(__file__))
# Debian bookworm's libb64 (perf_analyzer links libb64.so.0d); snapshot.debian.org keeps it if
# the mirror drops it.
LIBB64 = "libb64-0d_1.2-5+b1_amd64.deb"
LIBB64_SHA256 = "b0e1d6fde8bdccc18c3884144aede064dc82464dd4777275fa80e74c05583e82"
LIBB64_URLS = [
    f"https://deb.debian.org/debian/pool/main/libb/libb64/{LIBB64}",
    f"https://snapshot.debian.org/archive/debian/20240101T000000Z/pool/main/libb/libb64/{LIBB64}",
]


def fetch_libb64(lib):
    for url in LIBB64_URLS:
        try:
            data = urllib.request.urlopen(url.replace("+", "%2B"), timeout=60).read()
        except OSError as e:
            print(f"perf_analyzer: {url}: {e}")
            continue
        got = hashlib.sha256(data).hexdigest()
        if got != LIBB64_SHA256:
            raise SystemExit(f"{url}: sha256 {got}, pinned {LIBB64_SHA256}")
        return extract_deb(data, "libb64.so.0d", lib)
    raise SystemExit("libb64: no mirror answered")


def extract_deb(deb, name, lib):
    """The file `name` from a .deb's data archive (an ar archive holding a tarball)."""
    assert deb[:8] == b"!<arch>\n", "not an ar archive"
    at = 8
    while at < len(deb):
        member, size = deb[at:at + 16].decode().strip(), int(deb[at + 48:at + 58])
        body = deb[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                for m in tar.getmembers():
                    if os.path.basename(m.name) == name:
                        f = tar.extractfile(m) or tar.extractfile(tar.getmember(m.linkpath))
                        with open(os.path.join(lib, name), "wb") as out:
                            out.write(f.read())
                        return
    raise SystemExit(f"{name} not in the .deb")


def install(cache, pip):
    """perf_analyzer and its libraries under `cache` (bin/, lib/), fetched once."""
    exe = os.path.join(cache, "bin", "perf_analyzer")
    lib = os.path.join(cache, "lib")
    if os.path.exists(exe) and os.path.exists(os.path.join(lib, "libb64.so.0d")):
        return exe, lib
    wheels = os.path.join(cache, "wheels")
    for d in (wheels, lib, os.path.dirname(exe)):
        os.makedirs(d, exist_ok=True)
    subprocess.run([pip, "download", "-q", "--no-deps", "--require-hashes", "-d", wheels,
                    "-r", os.path.join(HERE, "perf_analyzer.txt")], check=True)
    for whl in os.listdir(wheels):
        with zipfile.ZipFile(os.path.join(wheels, whl)) as z:
            for n in z.namelist():
                if n.endswith("/bin/perf_analyzer"):
                    with open(exe, "wb") as out:
                        out.write(z.read(n))
                    os.chmod(exe, 0o755)
                elif n.endswith("/libcudart.so.12"):
                    with open(os.path.join(lib, "libcudart.so.12"), "wb") as out:
                        out.write(z.read(n))
    fetch_libb64(lib)
    return exe, lib


def server_stats(out):
    """perf_analyzer's server-side report: the successful request count and its breakdown."""
    count = re.search(r"Server:\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+)\s*\n"
                      r"\s*Successful request count: (\d+)", out)
    latency = re.search(r"Avg request latency: (\d+) usec \(overhead \d+ usec \+ queue (\d+) usec "
                        r"\+ compute input \d+ usec \+ compute infer (\d+) usec", out)
    return count, latency


def main(binary, cache):
    exe, lib = install(cache, os.path.join(os.path.dirname(sys.executable), "pip"))
    env = dict(os.environ, LD_LIBRARY_PATH=lib)
    shm = tempfile.mkdtemp(prefix="epserve-shm-")
    proc, addr, http = launch(binary, shm)
    passed = 0
    try:
        hidden = 64  # synthetic:tiny
        rng = np.random.default_rng(41)
        data = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"data": [{"hidden_states": {
            "content": rng.uniform(-1, 1, 4 * hidden).round(4).tolist(), "shape": [4, hidden]}}
            for _ in range(4)]}, data)
        data.close()
        # perf_analyzer 2.41 takes no optional input with shared memory: the -gated model
        # declares none.
        for model, proto, mode in (("layer-0", "grpc", []), ("layer-0", "grpc", ["--async"]),
                                   ("layer-0", "grpc", ["--streaming"]),
                                   ("layer-0-gated", "grpc", ["--shared-memory", "system"]),
                                   ("layer-0", "http", []), ("layer-0", "http", ["--async"]),
                                   ("layer-0-gated", "http", ["--shared-memory", "system"])):
            url = addr if proto == "grpc" else http
            # What is checked is each mode's protocol and the server's statistics, not latency:
            # perf_analyzer's default stability (three windows within 10%) failed once on CI's
            # two busy cores ("Failed to obtain stable measurement", http --async).
            cmd = [exe, "-m", model, "-u", url, "-i", proto, "--input-data", data.name,
                   "--measurement-interval", "500", "--concurrency-range", "1:2",
                   "--stability-percentage", "100", *mode]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            out = r.stdout + r.stderr
            label = " ".join([proto, *mode]) if mode else f"{proto} sync"
            if r.returncode != 0 or "error" in out.lower() or "unable" in out.lower():
                print(out)
                raise AssertionError(f"perf_analyzer {label}: exit {r.returncode}")
            count, latency = server_stats(out)
            if not count or int(count.group(3)) == 0 or not latency:
                print(out)
                raise AssertionError(f"perf_analyzer {label}: no server-side statistics")
            print(f"perf_analyzer {label}: ok, server counted {count.group(3)} requests, "
                  f"avg {latency.group(1)} us (queue {latency.group(2)}, compute infer "
                  f"{latency.group(3)})")
            passed += 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"perf_analyzer: {passed} modes passed, 0 failed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
