#!/usr/bin/env python3
"""The group's steps after a host gap (`epserve bench --gap-us`), from the bench's JSON files.

    python3 scripts/bench/gap-steps.py FILE.json [...]

A step's group time is its least time over the ranks (a rank that waited for a late peer's host
is not the step's own time). A step over 1.1x the median is put down to the host when the rank
that gave its least time spent over 30 µs more than its median between the first event's record
and the launch's return (`enqueue_us`): the GPU may have waited that long for the step. "Device
view" takes each rank's enqueue excess off its time first. Files of builds before `enqueue_us`
print "–" there.
"""
import json
import statistics as st
import sys

HOST_US = 30.0


def rows(path):
    for r in json.load(open(path)):
        ranks = r["ranks"]
        if not all(x.get("step_samples_us") for x in ranks):
            continue
        s = [x["step_samples_us"] for x in ranks]
        n = min(map(len, s))
        least = [min(v[i] for v in s) for i in range(n)]
        med = st.median(least)
        slow = [i for i in range(n) if least[i] > 1.1 * med]
        at = [x.get("launch_at_us", []) for x in ranks]
        off = [max(a[i] for a in at) - min(a[i] for a in at) for i in range(n)] if all(at) else []
        e = [x.get("enqueue_us", []) for x in ranks]
        host = device = view = "–"
        if all(e):
            em = [st.median(v) for v in e]
            k = [min(range(len(s)), key=lambda j: s[j][i]) for i in range(n)]
            host = sum(1 for i in slow if e[k[i]][i] > em[k[i]] + HOST_US)
            device = len(slow) - host
            adj = [min(s[j][i] - max(0.0, e[j][i] - em[j]) for j in range(len(s))) for i in range(n)]
            amed = st.median(adj)
            view = "%d (max %.2fx)" % (sum(1 for t in adj if t > 1.1 * amed), max(adj) / amed)
        yield (
            r["config"]["name"],
            r["backend"],
            r["config"]["expert_dtype"],
            n,
            med,
            sorted(least)[min(n - 1, int(n * 0.99))],
            max(least) / med,
            len(slow),
            host,
            device,
            view,
            "%.0f" % st.median(off) if off else "–",
        )


def main():
    print(
        "| file | config | backend | experts | steps | median µs | p99 | max / median | over 1.1x "
        "| host | not host | device view: over 1.1x | ranks' launches apart, median µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        for c, b, d, n, med, p99, mx, slow, host, dev, view, off in rows(path):
            name = "/".join(path.split("/")[-2:])
            print(
                f"| {name} | {c} | {b} | {d} | {n} | {med:.1f} | {p99:.1f} | {mx:.2f} | {slow} "
                f"| {host} | {dev} | {view} | {off} |"
            )


if __name__ == "__main__":
    main()
