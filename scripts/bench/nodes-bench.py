#!/usr/bin/env python3
"""A group on two simulated nodes against the same ranks on one node, on this machine, in one run
(#38): `epserve launch --ranks R [--nodes 2]` on the cpu backend, `epserve-loadtest` at the leader,
the two alternated REPEATS times. Prints the median row of each and where a step's time goes
(each rank's mean phase times from `epserve_step_phase_seconds` over the measured window, and
the bytes it sent to the other node).

Usage: scripts/bench/nodes-bench.py [OUTDIR] (default docs/results/serving/nodes); BIN=dir
for binaries built elsewhere (default: cargo build --release here)."""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs/results/serving/nodes")
REPEATS = int(os.environ.get("REPEATS", "3"))
RANKS = int(os.environ.get("RANKS", "4"))
PHASES = ["gating", "prepare", "dispatch", "experts", "combine"]
CONFIGS = [
    # name, model, loadtest flags
    ("tiny-c16-t16", "synthetic:tiny", ["--concurrency", "16", "--tokens", "16"]),
    ("small-deepseek-c16-t64", "synthetic:small-deepseek", ["--concurrency", "16", "--tokens", "64"]),
]


def binaries():
    if os.environ.get("BIN"):
        return os.environ["BIN"]
    for p in ["epserve", "epserve-loadtest"]:
        subprocess.run(["cargo", "build", "--release", "--quiet", "-p", p], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target/release")


def scrape(addr):
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(epserve_step_phase_seconds_(?:sum|count))\{phase="(\w+)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
        m = re.match(r'^epserve_cross_node_bytes_total\{rank="\d+"\} (\S+)', line)
        if m:
            out["cross"] = float(m.group(1))
        m = re.match(r'^epserve_steps_total\{kind="work"\} (\S+)', line)
        if m:
            out["steps"] = float(m.group(1))
    return out


def run(bin_dir, name, model, nodes, flags, i):
    shm = tempfile.mkdtemp(prefix="epserve-nodes-")
    log = tempfile.NamedTemporaryFile("w+", delete=False)
    group = subprocess.Popen(
        [f"{bin_dir}/epserve", "launch", "--ranks", str(RANKS), "--nodes", str(nodes),
         "--model", model, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
         "--http-listen", "off", "--shm-dir", shm],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        addr, metrics = None, {}
        for _ in range(600):
            text = open(log.name).read()
            for r, a in re.findall(r"rank (\d+) metrics on http://([\d.:]+)/metrics", text):
                metrics[int(r)] = a
            m = re.search(r"serving gRPC on ([\d.:]+)", text)
            if m and len(metrics) == RANKS:
                addr = m.group(1)
                break
            time.sleep(0.2)
        if not addr:
            raise SystemExit(open(log.name).read())
        # The phase figures cover the measured window alone: before and after.
        out = f"{OUT}/{name}-nodes{nodes}-{i}.json"
        lt = [f"{bin_dir}/epserve-loadtest", "--target", addr, "--api", "unary", "--dtype", "bf16",
              "--warmup", "0s"] + flags
        # A warm-up run of its own, so that the scrapes bracket the measured run alone.
        subprocess.run(lt + ["--duration", "1s"], check=True, stdout=subprocess.DEVNULL)
        before = {r: scrape(a) for r, a in metrics.items()}
        subprocess.run(lt + ["--duration", "5s", "--json", out], check=True, stdout=subprocess.DEVNULL)
        after = {r: scrape(a) for r, a in metrics.items()}
    finally:
        group.terminate()
        group.wait(timeout=60)
        subprocess.run(["rm", "-rf", shm, log.name])
    res = json.load(open(out))
    if set(res["statuses"]) != {"OK"} or res["ok"] != res["sent"]:
        raise SystemExit(f"{out}: not every request answered OK: {res['statuses']}, {res['ok']} of {res['sent']}")
    per_rank = {}
    for r in sorted(after):
        d = lambda k: after[r].get(k, 0.0) - before[r].get(k, 0.0)
        per_rank[r] = {
            p: 1e6 * d(("epserve_step_phase_seconds_sum", p))
            / max(1.0, d(("epserve_step_phase_seconds_count", p)))
            for p in PHASES
        }
        per_rank[r]["cross_mib"] = d("cross") / 2**20
    return res, per_rank


def main():
    os.makedirs(OUT, exist_ok=True)
    bin_dir = binaries()
    print(f"{RANKS} cpu ranks, unary bf16, 5 s per run, medians of {REPEATS} (1 node and 2 alternated)\n")
    print("| config | nodes | req/s | tokens/s | p50 / p99 ms |")
    print("|---|---|---|---|---|")
    phases = {}
    for name, model, flags in CONFIGS:
        runs = {1: [], 2: []}
        for i in range(1, REPEATS + 1):
            for nodes in (1, 2):
                runs[nodes].append(run(bin_dir, name, model, nodes, flags, i))
        for nodes in (1, 2):
            med = lambda f: statistics.median(f(res) for res, _ in runs[nodes])
            print(f"| {name} | {nodes} | {med(lambda r: r['requests_per_s']):.0f} | "
                  f"{med(lambda r: r['tokens_per_s']):.0f} | "
                  f"{med(lambda r: r['latency_ms']['p50']):.2f} / {med(lambda r: r['latency_ms']['p99']):.2f} |")
            phases[(name, nodes)] = {
                r: {k: statistics.median(pr[r][k] for _, pr in runs[nodes]) for k in PHASES + ["cross_mib"]}
                for r in range(RANKS)
            }
    print("\nMean phase times per step (µs) and MiB sent across nodes in the 5 s window, median of the runs:\n")
    print("| config | nodes | rank | " + " | ".join(PHASES) + " | MiB across |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 1))
    for (name, nodes), ranks in phases.items():
        for r, v in ranks.items():
            cells = " | ".join(f"{v[p]:.0f}" for p in PHASES)
            print(f"| {name} | {nodes} | {r} | {cells} | {v['cross_mib']:.1f} |")


if __name__ == "__main__":
    main()
