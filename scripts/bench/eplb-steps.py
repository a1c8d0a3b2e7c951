# Every step's time from an `epserve launch` log (RUST_LOG=info,epserve::step_times=trace): each
# step over the median of steps of its layer and size, overall and in the 2 s before and after
# each "placement applied" (rank 0's), and every gap of over 30 ms between rank 0's steps, for
# - host: rank 0's time from submit to completion (two steps in flight);
# - device: rank 0's step on its GPU (`device_us`: from its first wait to its output), which
#   includes its wait in the exchange for a rank whose host started the step later;
# - group: the least device time of any rank for the step (joined by `step=`): the step timed
#   from the rank that started it last, so without that wait; what a slower step on any rank
#   (a rebalance's copies, say) makes longer, as every rank waits for it in combine;
# - group, graph only: the same without each rank's wait before its graph (`wait_us`: its host
#   still enqueueing the step, or a placement's copies); every step over 1.1x in the group
#   measure is listed with each rank's wait and host enqueue time (`enqueue_us`);
# - group, graph alone: the same less also each rank's small copies in and out (`in_us`,
#   `out_us`: the routing in ahead of the graph, the counts out behind it), where logged;
# - causes: each group step over 1.1x put down to a host stall (a rank took over 250 us and 3x
#   its median to enqueue it: the GPU ran out of work mid-step), else, with
#   `--step-phase-times on`, to the phase that took the most over its median summed over the
#   ranks (`phases_us`), else unattributed; `switches` (the host's voluntary/involuntary
#   context switches while enqueueing) says whether a stalled host had lost its core, and
#   `parts_us` (the enqueue's start, copies in, graph launch, copies out) which part it stalled in.
# - beside the copies: per placement that moved weights, the group steps from the one after
#   rank 0 applied it to two after its last copies were enqueued (two steps in flight).
# With RUST_LOG=...,epserve::staging=trace, each gap also names the staging phases of rank 0's
# batches (load, upload, free: each batch's line ends its free) that overlap it, and by how much.
# usage: python3 scripts/bench/eplb-steps.py LOG...
import re, sys, statistics
from collections import defaultdict, namedtuple

def stamp(m):
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))

def pct(r, q):
    return r[min(len(r) - 1, int(q * len(r)))]

LINE = re.compile(r"rank=(\d+) .*?(\d\d):(\d\d):(\d\d\.\d+)Z .*step_times: step (?:step=(\d+) )?"
                  r"layer=(\d+) tokens=(\d+) us=(\d+)(?: device_us=(\d+))?(?: wait_us=(\d+))?"
                  r"(?: enqueue_us=(\d+))?(?: switches=(\d+)/(\d+))?(?: parts_us=([\d,]+))?(?: in_us=(\d+))?"
                  r"(?: out_us=(\d+))?(?: phases_us=([\d,]+))?")
PHASES = ["gating", "prepare", "dispatch", "experts", "combine"]
# The host's enqueue of a step in its parts (`parts_us`), where logged.
PARTS = ["start", "copies in", "graph launch", "copies out"]
# One rank's figures for one step, from its trace line (0 where the line has no such field).
Rank = namedtuple("Rank", "layer tokens wait enq inn out lost ph parts")
APPLIED = re.compile(r"rank=0 .*?(\d\d):(\d\d):(\d\d\.\d+)Z .*placement applied")
# The steps a placement's copies run beside: from its apply to its last copies enqueued.
APPLIED_AT = re.compile(r"rank=0 .*step=(\d+) .*placement applied epoch=(\d+) moved_bytes=(\d+)")
ENQUEUED_AT = re.compile(r"rank=0 .*step=(\d+) .*copies enqueued.* epoch=(\d+)")
BATCH = re.compile(r"rank=0 .*?(\d\d):(\d\d):(\d\d\.\d+)Z .*batch staged .*load_ms=([\d.]+) "
                   r"upload_ms=([\d.]+) free_ms=([\d.]+)")

def phases(m):
    """A batch line's three phases as (name, start, end) in seconds: they end at its stamp."""
    end = stamp(m)
    load, upload, free = (float(m.group(i)) / 1e3 for i in (4, 5, 6))
    t0 = end - free - upload - load
    return [("load", t0, t0 + load), ("upload", t0 + load, end - free), ("free", end - free, end)]

def beside(a, b, staged):
    """What of the staging overlaps the interval (a, b): 'load 12 ms, upload 30 ms', or none."""
    over = defaultdict(float)
    for name, lo, hi in staged:
        over[name] += max(0.0, min(b, hi) - max(a, lo))
    said = ", ".join("%s %.0f ms" % (n, v * 1e3) for n, v in over.items() if v > 0)
    return said or "no staging"

for f in sys.argv[1:]:
    rank0, applied, dev_by_step, staged = [], [], defaultdict(dict), []
    per_rank = defaultdict(dict)
    moved, enqueued = [], {}
    for line in open(f):
        a = APPLIED_AT.search(line)
        if a and int(a.group(3)) > 0: moved.append((int(a.group(1)), int(a.group(2)), int(a.group(3))))
        a = ENQUEUED_AT.search(line)
        if a: enqueued[int(a.group(2))] = int(a.group(1))
        m = LINE.search(line)
        if m:
            rank = int(m.group(1))
            t = int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4))
            step = int(m.group(5)) if m.group(5) else None
            layer, tokens, us = int(m.group(6)), int(m.group(7)), int(m.group(8))
            dev = int(m.group(9)) if m.group(9) else None
            if rank == 0:
                rank0.append([t, layer, tokens, us, dev, step])
            if step is not None and dev is not None:
                dev_by_step[step][rank] = dev
                if m.group(10):
                    wait, enq, inn, out = (int(m.group(i) or 0) for i in (10, 11, 15, 16))
                    lost = m.group(13) is not None and int(m.group(13)) > 0
                    ph = [int(x) for x in m.group(17).split(",")] if m.group(17) else None
                    parts = [int(x) for x in m.group(14).split(",")] if m.group(14) else None
                    per_rank[step][rank] = Rank(layer, tokens, wait, enq, inn, out, lost, ph, parts)
        a = APPLIED.search(line)
        if a: applied.append(stamp(a))
        m = BATCH.search(line)
        if m: staged += phases(m)
    # The pipeline stopping: no step completing on rank 0 for more than 30 ms.
    done = sorted((s[0], s[5]) for s in rank0)
    for (a, _), (b, step) in zip(done, done[1:]):
        if b - a > 0.030:
            what = "; beside it: " + beside(a, b, staged) if staged else ""
            print(f, "gap: no step completed on rank 0 for %.0f ms before step %s%s" % ((b - a) * 1e3, step, what))
    ranks = max((len(v) for v in dev_by_step.values()), default=0)
    for s in rank0:
        d = dev_by_step.get(s[5], {})
        s.append(min(d.values()) if ranks > 0 and len(d) == ranks else None)
        w = per_rank.get(s[5], {})
        s.append(min(d[r] - w[r].wait for r in d) if s[6] is not None and len(w) == ranks else None)
        s.append(min(d[r] - w[r].wait - w[r].inn - w[r].out for r in d)
                 if s[6] is not None and len(w) == ranks and any(w[r].inn for r in w) else None)
    # Each rank's median enqueue, and each (layer, tokens, rank)'s median phases, for `cause`.
    enq_med, ph_med = {}, {}
    for r in range(ranks):
        e = [v[r].enq for v in per_rank.values() if r in v]
        if e: enq_med[r] = statistics.median(e)
    by = defaultdict(list)
    for v in per_rank.values():
        for r, x in v.items():
            if x.ph: by[(x.layer, x.tokens, r)].append(x.ph)
    ph_med = {k: [statistics.median(p[i] for p in v) for i in range(5)] for k, v in by.items() if len(v) > 20}
    part_med = {}
    for r in range(ranks):
        p = [v[r].parts for v in per_rank.values() if r in v and v[r].parts]
        if p: part_med[r] = [statistics.median(x[i] for x in p) for i in range(4)]
    def stalled_in(v, stalled):
        """The enqueue part that ran the most over its median on the stalled ranks, where logged."""
        over = [0] * 4
        for r in stalled:
            if v[r].parts and r in part_med:
                for i in range(4): over[i] += max(0, v[r].parts[i] - part_med[r][i])
        return " in " + PARTS[over.index(max(over))] if max(over) > 0 else ""
    def cause(step):
        v = per_rank.get(step, {})
        stalled = [r for r, x in v.items() if x.enq > max(250, 3 * enq_med.get(r, 0))]
        if stalled:
            return ("host stall (a core lost)" if any(v[r].lost for r in stalled) else "host stall") + stalled_in(v, stalled)
        if len(v) == ranks and all(x.ph and (x.layer, x.tokens, r) in ph_med for r, x in v.items()):
            over = [sum(max(0, x.ph[i] - ph_med[(x.layer, x.tokens, r)][i]) for r, x in v.items()) for i in range(5)]
            return PHASES[over.index(max(over))] if max(over) > 0 else "unattributed"
        return "unattributed"
    def causes(steps):
        c = defaultdict(int)
        for st in steps: c[cause(st)] += 1
        return ", ".join("%s %d" % kv for kv in sorted(c.items(), key=lambda kv: -kv[1])) or "none"
    for col, what in [(3, "host, rank 0 submit to completion"), (4, "device, rank 0's stream time"),
                      (6, "group, least device time over the %d ranks" % ranks),
                      (7, "group, graph only: least over the %d ranks of device time less its wait" % ranks),
                      (8, "group, graph alone: least over the %d ranks of device time less its wait and small copies" % ranks)]:
        timed = [s for s in rank0 if s[col] is not None]
        if not timed: continue
        med = {}
        for n in sorted(set(tuple(s[1:3]) for s in timed)):
            us = [s[col] for s in timed if tuple(s[1:3]) == n]
            if len(us) > 20: med[n] = statistics.median(us)
        ratio = lambda s: s[col] / med[tuple(s[1:3])]
        print(f, what, "steps", len(timed), "medians by (layer, tokens)", med)
        allr = sorted(ratio(s) for s in timed if tuple(s[1:3]) in med)
        print("  all steps / their (layer, size)'s median: p50 %.2f p90 %.2f p99 %.2f p99.9 %.2f max %.2f; over 1.1x: %d of %d" % (pct(allr, .5), pct(allr, .9), pct(allr, .99), pct(allr, .999), allr[-1], sum(r > 1.1 for r in allr), len(allr)))
        if col == 6 and per_rank:
            print("  causes of the steps over 1.1x: " + causes(s[5] for s in timed if tuple(s[1:3]) in med and ratio(s) > 1.1))
        if col == 6:
            # Rank 0's GPU idle before each step (its completion less the one before, less its
            # device time): steps after a longer idle run over 1.1x more often.
            seq = sorted((s for s in timed if tuple(s[1:3]) in med), key=lambda s: s[0])
            bins = [(0, 600), (600, 1500), (1500, 1e9)]
            for lo, hi in bins:
                r = [ratio(b) for a, b in zip(seq, seq[1:]) if lo <= (b[0] - a[0]) * 1e6 - b[4] < hi]
                if r:
                    print("  after %s us of idle on rank 0: %d steps, over 1.1x: %d (%.2f%%)" % (
                        "%d-%s" % (lo, int(hi) if hi < 1e9 else ""), len(r), sum(x > 1.1 for x in r),
                        100.0 * sum(x > 1.1 for x in r) / len(r)))
        if col in (6, 7) and moved:
            by_step = {s[5]: s for s in timed if tuple(s[1:3]) in med}
            beside, listed = [], 0
            for s0, epoch, nbytes in moved:
                if epoch not in enqueued: continue
                sel = [by_step[k] for k in range(s0 + 1, enqueued[epoch] + 3) if k in by_step]
                if not sel: continue
                beside += sel; listed += 1
                print("  beside placement %d's copies (%.2f GB over the group, steps %d-%d): %s" % (
                    epoch, nbytes / 1e9, s0 + 1, enqueued[epoch] + 2,
                    ", ".join("%.2f" % ratio(s) for s in sel)))
            if beside:
                r = sorted(ratio(s) for s in beside)
                print("  every step beside the copies of %d placements: %d steps, max %.2f; over 1.1x: %d" % (
                    listed, len(r), r[-1], sum(x > 1.1 for x in r)))
                if col == 6 and per_rank:
                    print("    their causes: " + causes(s[5] for s in beside if ratio(s) > 1.1))
        if col == 6 and per_rank:
            for s in timed:
                if tuple(s[1:3]) in med and ratio(s) > 1.1:
                    w = per_rank.get(s[5], {})
                    print("    over: step %s layer %d tokens %d %.2fx (%d us); per rank wait / enqueue / in / out us: %s" % (
                        s[5], s[1], s[2], ratio(s), s[col], ", ".join("%d / %d / %d / %d" % (w[r].wait, w[r].enq, w[r].inn, w[r].out) for r in sorted(w))))
        if len(applied) > 1:
            near = lambda s: any(a <= s[0] < a + 2.0 for a in applied)
            for label, sel in [("the 2 s after any of the %d placements" % len(applied), True), ("every other step", False)]:
                r = sorted(ratio(s) for s in timed if tuple(s[1:3]) in med and near(s) == sel)
                if r:
                    print("  %s: %d steps, p50 %.2f p90 %.2f p99 %.2f max %.2f; over 1.1x: %d" % (label, len(r), pct(r, .5), pct(r, .9), pct(r, .99), r[-1], sum(x > 1.1 for x in r)))
        for a in applied:
            for label, lo, hi in [("the 2 s after the placement at %.3f" % a, a, a + 2.0), ("the 2 s before it", a - 2.0, a)]:
                sel = [s for s in timed if lo <= s[0] < hi and tuple(s[1:3]) in med]
                r = sorted(ratio(s) for s in sel)
                if r:
                    print("  %s: %d steps, p50 %.2f p90 %.2f p99 %.2f max %.2f; over 1.1x: %d" % (label, len(r), pct(r, .5), pct(r, .9), pct(r, .99), r[-1], sum(x > 1.1 for x in r)))
                    if col == 6 and per_rank:
                        print("    causes: " + causes(s[5] for s in sel if ratio(s) > 1.1))
                    if lo == a:
                        top = sorted(sel, key=ratio)[-3:]
                        print("    the slowest: " + ", ".join("step %s layer %d at +%.1f ms %.2fx" % (s[5], s[1], (s[0] - a) * 1e3, ratio(s)) for s in top))
