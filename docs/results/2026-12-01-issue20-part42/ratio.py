# SF 10 -> SF 100 per query and in total from two bench results.json files.
import json, sys
def load(path):
    d = json.load(open(path))
    r = {}
    for q in d['queries']:
        m = q['modes'][0]
        r[q['name']] = (m['wall_ms_median'] / 1e3, m['compute_cpu_seconds'], m['storage_cpu_seconds'],
                        m['compute_peak_rss_bytes'] / 1e6, m['storage_peak_rss_bytes'] / 1e6)
    return r
a, b = load(sys.argv[1]), load(sys.argv[2])
print(f"{'query':6} {'SF10 s':>8} {'SF100 s':>8} {'x':>6} | {'cCPU x':>7} {'sCPU x':>7}")
for q in a:
    if q not in b: continue
    w1, c1, s1, _, _ = a[q]; w2, c2, s2, _, _ = b[q]
    print(f"{q:6} {w1:8.2f} {w2:8.2f} {w2/w1:6.2f} | {c2/c1:7.2f} {s2/s1:7.2f}")
tot = lambda r, i: sum(v[i] for k, v in r.items() if k in a and k in b)
mx = lambda r, i: max(v[i] for k, v in r.items() if k in a and k in b)
for name, i in (("time", 0), ("compute CPU", 1), ("storage CPU", 2)):
    print(f"{name:12} {tot(a,i):8.2f} {tot(b,i):8.2f} {tot(b,i)/tot(a,i):6.2f}x")
for name, i in (("compute peak MB", 3), ("storage peak MB", 4)):
    print(f"{name:16} {mx(a,i):6.0f} {mx(b,i):6.0f} {mx(b,i)/mx(a,i):6.2f}x")
