# Session 65: when rank 0 submitted the next step, µs after a step's own submit (each submit taken
# as its completion log time less its host time `us`), for the group's slow steps (over 1.1x the
# median of the least device time over the ranks) and the rest, among the steps that were still
# running when the next was submitted; and how often steps submitted while the one before still
# ran were slow; and the share over 1.1x of the steps still running at the next submit against the
# rest (a split that selects the slow steps, which run longer: docs/benchmarks.md, session 65).
# usage: python3 offsets.py SERVE-MOVES-LOG...
import re, sys, statistics as st
L = re.compile(r"rank=(\d) .*?T(\d\d):(\d\d):(\d\d\.\d+)Z .*step_times: step step=(\d+) layer=(\d+) "
               r"tokens=(\d+) us=(\d+) device_us=(\d+)")
for f in sys.argv[1:]:
    d, seen = {}, set()
    for line in open(f):
        m = L.search(line)
        if not m or (m[1], m[5]) in seen: continue
        seen.add((m[1], m[5]))
        t = int(m[2]) * 3600 + int(m[3]) * 60 + float(m[4])
        d.setdefault(int(m[5]), {})[int(m[1])] = (t - int(m[8]) / 1e6, t, int(m[9]), (m[6], m[7]))
    full = {s: v for s, v in d.items() if len(v) == 2}
    # Each step against the median of its (layer, tokens), as eplb-steps.py measures them.
    by = {}
    for s, v in full.items(): by.setdefault(v[0][3], []).append(min(v[0][2], v[1][2]))
    med = {k: st.median(v) for k, v in by.items() if len(v) > 20}
    full = {s: v for s, v in full.items() if v[0][3] in med}
    g = {s: min(v[0][2], v[1][2]) / med[v[0][3]] for s, v in full.items()}
    off, after = {False: [], True: []}, {False: 0, True: 0}
    for s in sorted(full):
        sub, end, _, _ = full[s][0]
        n = full.get(s + 1)
        if n and n[0][0] < end: off[g[s] > 1.1].append((n[0][0] - sub) * 1e6)
        p = full.get(s - 1)
        if p and p[0][1] > sub: after[g[s] > 1.1] += 1
    print(f, "medians by (layer, tokens)", med)
    for k, v in off.items():
        v.sort()
        if v: print("  %s: %d steps still running at the next submit, which came p10 %.0f, p50 %.0f, p90 %.0f us after theirs"
                    % ("slow" if k else "others", len(v), v[len(v) // 10], v[len(v) // 2], v[9 * len(v) // 10]))
    run = len(off[False]) + len(off[True])
    rest = len(g) - run
    slow_rest = sum(1 for s in g if g[s] > 1.1) - len(off[True])
    if run and rest: print("  over 1.1x: %.2f%% of the steps still running at the next submit, %.2f%% of the rest"
                           % (100.0 * len(off[True]) / run, 100.0 * slow_rest / rest))
    n = after[False] + after[True]
    if n: print("  submitted while the step before still ran: %d steps, over 1.1x: %d (%.2f%%)" % (n, after[True], 100.0 * after[True] / n))
