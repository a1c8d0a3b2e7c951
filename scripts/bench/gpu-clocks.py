# Samples each GPU's SM clock, clock event (throttle) reasons and power through NVML while a
# load runs, so that slow steps in a step log can be set beside what the GPU's clocks did then.
# usage: python3 scripts/bench/gpu-clocks.py OUT.tsv SECONDS [GPU...]   (from the driver's
# libnvidia-ml; no Python packages). Lines: unix time, gpu, SM MHz, reasons bitmask, mW.
import ctypes, sys, time

nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0, "nvmlInit failed"
out, secs = sys.argv[1], float(sys.argv[2])
gpus = [int(g) for g in sys.argv[3:]] or [0]
handles = []
for g in gpus:
    h = ctypes.c_void_p()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(g, ctypes.byref(h)) == 0
    handles.append(h)
reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
clk, rs, mw = ctypes.c_uint(), ctypes.c_ulonglong(), ctypes.c_uint()
rows, end, n = [], time.time() + secs, 0
while time.time() < end:
    for g, h in zip(gpus, handles):
        nvml.nvmlDeviceGetClockInfo(h, 1, ctypes.byref(clk))  # NVML_CLOCK_SM
        reasons_fn(h, ctypes.byref(rs))
        p = -1
        if n % 10 == 0 and nvml.nvmlDeviceGetPowerUsage(h, ctypes.byref(mw)) == 0:
            p = mw.value
        rows.append("%.6f\t%d\t%d\t%d\t%d" % (time.time(), g, clk.value, rs.value, p))
    n += 1
    time.sleep(0.0005)
with open(out, "w") as f:
    f.write("\n".join(rows) + "\n")
print("gpu-clocks: %d samples over %.0f s to %s" % (len(rows), secs, out))
