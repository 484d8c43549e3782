# Per query SF 100 / SF 10 on three machines: part 44 (Xeon), part 45 (Zen 3), part 46 (this run).
import json, sys, re
xeon = {}
for line in open(sys.argv[1]):
    c = [s.strip() for s in line.strip().strip('|').split('|')]
    if c and re.fullmatch(r'q\d+', c[0]):
        xeon[c[0]] = (float(c[1]), float(c[4]))
zen3 = {}
for line in open(sys.argv[2]):
    c = line.split()
    if c and re.fullmatch(r'q\d+', c[0]):
        zen3[c[0]] = (float(c[1]), float(c[2]))
def load(path):
    return {q['name']: q['modes'][0]['wall_ms_median'] / 1e3 for q in json.load(open(path))['queries']}
a, b = load(sys.argv[3]), load(sys.argv[4])
print("| query | SF 10 s | SF 100 s | x, this machine (Zen 4) | x, part 45 (Zen 3) | x, part 44 (Xeon) |")
print("|---|---|---|---|---|---|")
for q in a:
    x, z = xeon[q], zen3[q]
    print(f"| {q} | {a[q]:.2f} | {b[q]:.2f} | {b[q]/a[q]:.2f}x | {z[1]/z[0]:.2f}x | {x[1]/x[0]:.2f}x |")
