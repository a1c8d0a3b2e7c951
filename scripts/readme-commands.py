"""Runs README.md's example commands as written (called from .ci/run, after the Triton client step,
whose venv and perf_analyzer the Python and perf_analyzer examples use).

Every ```sh and ```python block must follow a marker comment saying what CI does with it:
- `<!-- ci: serve -->`: started in the background; the blocks after it run against it, and it
  must exit 0 on SIGINT at the end;
- `<!-- ci: run -->`: run with bash (python blocks with the Triton client venv's python), and must
  exit 0; `<!-- ci: run needs=TOOL -->` runs where TOOL is on PATH and is skipped, with the reason,
  where it is not;
- `<!-- ci: skip REASON -->`: not run here (REASON says why and what covers it).
`python=VENV` on a run marker runs the block with that venv (a checkout path: its python for a
python block, its bin/ first on PATH for a sh block); the default is the Triton client's venv.
Several serve blocks may run at once (each on its own ports); all are stopped at the end.
A block without a marker fails the check, so none goes unchecked silently. Files and folders the
blocks create in the checkout (rows.json, tiny-mixtral/) are removed afterwards."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = re.compile(r"^<!-- ci: (serve|run|skip)(.*?)-->$")
VENV = os.path.join(ROOT, ".venv-tritonclient")
# perf_analyzer and its libraries, where tests/tritonclient/perf_analyzer.py fetched them.
PERF = os.path.join(VENV, "perf_analyzer")


def blocks(text):
    """(line, language, marker, extra, body) of every fenced block."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i + 1, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev)
        out.append((start, lang, mark.group(1) if mark else None, (mark.group(2) if mark else "").strip(),
                    "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


def env(venv=VENV):
    e = dict(os.environ)
    e["PATH"] = os.pathsep.join([os.path.join(PERF, "bin"), os.path.join(venv, "bin"), e["PATH"]])
    e["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.join(PERF, "lib"), e.get("LD_LIBRARY_PATH")]))
    return e


def untracked():
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    return {l[3:] for l in r.stdout.splitlines() if l.startswith("?? ")}


def main():
    with open(os.path.join(ROOT, "README.md")) as f:
        found = [b for b in blocks(f.read()) if b[1] in ("sh", "python")]
    unmarked = [line for line, _, mark, _, _ in found if mark is None]
    if unmarked:
        sys.exit(f"README.md: blocks at lines {unmarked} carry no <!-- ci: ... --> marker")
    before = untracked()
    servers = []
    passed = skipped = 0
    try:
        for line, lang, mark, extra, body in found:
            where = f"README.md:{line} ({lang})"
            if mark == "skip":
                print(f"== {where}: skipped: {extra}", flush=True)
                skipped += 1
                continue
            need = re.findall(r"needs=(\S+)", extra)
            missing = [t for t in need if shutil.which(t, path=env()["PATH"]) is None]
            if missing:
                print(f"== {where}: skipped: {', '.join(missing)} not installed (not in the registries CI reaches)",
                      flush=True)
                skipped += 1
                continue
            venv = next((os.path.join(ROOT, v) for v in re.findall(r"python=(\S+)", extra)), VENV)
            cmd = ["bash", "-euo", "pipefail", "-c", body] if lang == "sh" else [os.path.join(venv, "bin", "python"), "-c", body]
            print(f"== {where}: {mark}\n{body}", flush=True)
            if mark == "serve":
                log = open(os.path.join(ROOT, "target", f"readme-serve-{len(servers)}.log"), "w+")
                server = subprocess.Popen(cmd, cwd=ROOT, env=env(venv), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
                servers.append((server, log))
                wait_serving(server, log, where)
            else:
                r = subprocess.run(cmd, cwd=ROOT, env=env(venv), timeout=600)
                if r.returncode != 0:
                    sys.exit(f"{where} exited {r.returncode}")
            passed += 1
    finally:
        for server, log in reversed(servers):
            stop(server, log)
        made = untracked() - before
        for f in made:
            os.remove(os.path.join(ROOT, f))
        # The folders those files were in, deepest first, where they are now empty.
        for d in sorted({os.path.dirname(f) for f in made if os.path.dirname(f)}, key=len, reverse=True):
            if not os.listdir(os.path.join(ROOT, d)):
                os.rmdir(os.path.join(ROOT, d))
    print(f"README commands: {passed} passed, {skipped} skipped, 0 failed")


def wait_serving(server, log, where):
    for _ in range(3000):
        log.seek(0)
        if "serving gRPC on" in log.read():
            return
        if server.poll() is not None:
            break
        time.sleep(0.2)
    log.seek(0)
    sys.exit(f"{where} did not come up:\n{log.read()[-4000:]}")


def stop(server, log):
    # SIGINT to the block's process group: `cargo run` and the service under it.
    os.killpg(server.pid, signal.SIGINT)
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        code = None
    if code != 0:
        log.seek(0)
        sys.exit(f"the served block did not exit 0 on SIGINT ({code}):\n{log.read()[-4000:]}")


if __name__ == "__main__":
    main()
