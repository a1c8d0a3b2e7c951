# Every step's time from an `epserve launch` log (RUST_LOG=info,epserve::step_times=trace), rank 0:
# each step over the median of steps of its layer and size, overall and in the 2 s before and
# after each "placement applied". usage: python3 scripts/bench/eplb-steps.py LOG...
import re, sys, statistics
for f in sys.argv[1:]:
    steps, applied = [], []
    for line in open(f):
        if "rank=0 " not in line: continue
        m = re.search(r"(\d\d):(\d\d):(\d\d\.\d+)Z .*step_times: step layer=(\d+) tokens=(\d+) us=(\d+)", line)
        if m:
            t = int(m.group(1))*3600 + int(m.group(2))*60 + float(m.group(3))
            steps.append((t, int(m.group(4)), int(m.group(5)), int(m.group(6))))
        a = re.search(r"(\d\d):(\d\d):(\d\d\.\d+)Z .*placement applied", line)
        if a: applied.append(int(a.group(1))*3600 + int(a.group(2))*60 + float(a.group(3)))
    med = {}
    for n in sorted(set(s[1:3] for s in steps)):
        us = [s[3] for s in steps if s[1:3] == n]
        if len(us) > 20: med[n] = statistics.median(us)
    print(f, "steps", len(steps), "medians by (layer, tokens)", med)
    allr = sorted(s[3]/med[s[1:3]] for s in steps if s[1:3] in med)
    print("  all steps / their (layer, size)'s median: p50 %.2f p90 %.2f p99 %.2f p99.9 %.2f max %.2f; over 1.1x: %d of %d" % (allr[len(allr)//2], allr[int(.9*len(allr))], allr[int(.99*len(allr))], allr[int(.999*len(allr))], allr[-1], sum(r>1.1 for r in allr), len(allr)))
    for a in applied:
        near = [s for s in steps if a <= s[0] <= a + 2.0 and s[1:3] in med]
        r = sorted(s[3]/med[s[1:3]] for s in near)
        print("  placement at %.3f: %d steps in the next 2 s, ratio to their (layer, size)'s median p50 %.2f p90 %.2f max %.2f; over 1.1x: %d" % (a, len(near), r[len(r)//2], r[int(.9*len(r))], r[-1], sum(x>1.1 for x in r)))
        before = [s for s in steps if a - 2.0 <= s[0] < a and s[1:3] in med]
        r = sorted(s[3]/med[s[1:3]] for s in before)
        print("  the 2 s before: %d steps, p50 %.2f p90 %.2f max %.2f; over 1.1x: %d" % (len(before), r[len(r)//2], r[int(.9*len(r))], r[-1], sum(x>1.1 for x in r)))
