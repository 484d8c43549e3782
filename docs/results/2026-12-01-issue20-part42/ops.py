# Per-operator compute time of an EXPLAIN ANALYZE (psql output), in plan order.
import re, sys
def ops(f):
    text = open(f).read()
    # psql wraps plan lines with '+'; join and split on operators
    lines = [l.split('|', 1)[-1].rstrip(' +') for l in text.splitlines()]
    out = []
    for l in lines:
        m = re.search(r'(\w+Exec): (.{0,70})', l)
        if not m: continue
        name = m.group(1)
        if name in ('ProjectionExec','CoalescePartitionsExec','BuildKeysExec','EarlyStartExec','SortPreservingMergeExec'): continue
        desc = m.group(2)
        t = {}
        for k in ('elapsed_compute','build_time','join_time','output_rows'):
            mm = re.search(k + r'=([\d.]+) ?([a-zµA-Z]*)', l)
            if mm:
                v, u = float(mm.group(1)), mm.group(2)
                if k == 'output_rows':
                    v *= {'K':1e3,'M':1e6,'B':1e9}.get(u,1)
                else:
                    v *= {'ns':1e-6,'µs':1e-3,'us':1e-3,'ms':1,'s':1e3}.get(u,1)
                t[k] = v
        out.append((name, desc, t))
    return out
a, b = ops(sys.argv[1]), ops(sys.argv[2])
print(f"{'operator':<70} {'rows a':>10} {'rows b':>11} {'ms a':>9} {'ms b':>9} {'x':>6}")
for (n, d, ta), (_, _, tb) in zip(a, b):
    ea, eb = ta.get('elapsed_compute', 0), tb.get('elapsed_compute', 0)
    x = f"{eb/ea:.1f}" if ea > 1 else ''
    print(f"{(n+': '+d)[:70]:<70} {ta.get('output_rows',0):>10.0f} {tb.get('output_rows',0):>11.0f} {ea:>9.1f} {eb:>9.1f} {x:>6}")
