# Every step's time from an `epserve launch` log (RUST_LOG=info,epserve::step_times=trace), rank 0:
# each step over the median of steps of its layer and size, overall and in the 2 s before and
# after each "placement applied"; for the time from submit to completion on the host (`us`, two
# steps in flight) and, where the log has it, the step's own time on the GPU (`device_us`).
# usage: python3 scripts/bench/eplb-steps.py LOG...
import re, sys, statistics

def stamp(m):
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))

def pct(r, q):
    return r[min(len(r) - 1, int(q * len(r)))]

for f in sys.argv[1:]:
    steps, applied = [], []
    for line in open(f):
        if "rank=0 " not in line: continue
        m = re.search(r"(\d\d):(\d\d):(\d\d\.\d+)Z .*step_times: step layer=(\d+) tokens=(\d+) us=(\d+)(?: device_us=(\d+))?", line)
        if m:
            dev = int(m.group(7)) if m.group(7) else None
            steps.append((stamp(m), int(m.group(4)), int(m.group(5)), int(m.group(6)), dev))
        a = re.search(r"(\d\d):(\d\d):(\d\d\.\d+)Z .*placement applied", line)
        if a: applied.append(stamp(a))
    for col, what in [(3, "host, submit to completion"), (4, "device, the step's own stream time")]:
        timed = [s for s in steps if s[col] is not None]
        if not timed: continue
        med = {}
        for n in sorted(set(s[1:3] for s in timed)):
            us = [s[col] for s in timed if s[1:3] == n]
            if len(us) > 20: med[n] = statistics.median(us)
        ratio = lambda s: s[col] / med[s[1:3]]
        print(f, what, "steps", len(timed), "medians by (layer, tokens)", med)
        allr = sorted(ratio(s) for s in timed if s[1:3] in med)
        print("  all steps / their (layer, size)'s median: p50 %.2f p90 %.2f p99 %.2f p99.9 %.2f max %.2f; over 1.1x: %d of %d" % (pct(allr, .5), pct(allr, .9), pct(allr, .99), pct(allr, .999), allr[-1], sum(r > 1.1 for r in allr), len(allr)))
        for a in applied:
            for label, lo, hi in [("the 2 s after the placement at %.3f" % a, a, a + 2.0), ("the 2 s before it", a - 2.0, a)]:
                r = sorted(ratio(s) for s in timed if lo <= s[0] < hi and s[1:3] in med)
                if r:
                    print("  %s: %d steps, p50 %.2f p90 %.2f p99 %.2f max %.2f; over 1.1x: %d" % (label, len(r), pct(r, .5), pct(r, .9), pct(r, .99), r[-1], sum(x > 1.1 for x in r)))
