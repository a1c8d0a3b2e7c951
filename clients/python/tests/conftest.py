"""The service under test: `epserve launch` (cpu backend) from this checkout's release build
(EPSERVE_BIN overrides), on a checkpoint the tests make with transformers."""

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_checkpoint import tiny_model  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BINARY = os.environ.get("EPSERVE_BIN", os.path.join(ROOT, "target", "release", "epserve"))
SHM_PREFIX = "epserve-client-"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """`epserve launch ARGS` until stop(); `addr` is where it serves gRPC."""

    def __init__(self, *args, listen="127.0.0.1:0", wait=True):
        self.args = [BINARY, "launch", "--listen", listen, "--metrics-listen", "off",
                     "--http-listen", "off", *args]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self.log = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()
        self.addr = None
        if wait:
            self.wait()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait(self, budget=120):
        end = time.time() + budget
        while time.time() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "epserve exited before serving:\n" + "".join(self.log[-40:])
                continue
            m = re.search(r"serving gRPC on (\S+)", line)
            if m:
                self.addr = m.group(1)
                return self.addr
        raise AssertionError("epserve did not serve in time:\n" + "".join(self.log[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: (model, directory)}: each model saved as a Hugging Face checkpoint."""
    out = {}
    for arch in ("mixtral", "qwen3_moe", "deepseek_v3"):
        model = tiny_model(arch)
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(d)
        out[arch] = (model, str(d))
    return out


@pytest.fixture(scope="session")
def mixtral(checkpoints):
    """(its f64 reference, the service): the Mixtral checkpoint served on 2 ranks, with client shared memory allowed; requests up
    to 8 MiB (so that a batch of 40k tokens goes as several)."""
    from reference import Mixtral64

    _, d = checkpoints["mixtral"]
    s = Service("--model", d, "--ranks", "2", "--max-request-bytes", "8MiB", "--allow-client-shm",
                "--shm-regions-prefix", SHM_PREFIX)
    yield Mixtral64(d), s
    s.stop()
