#!/usr/bin/env python3
"""Per-query SF 10 -> SF 100 table from four `sieve bench` reports:
sf10 sf100 sf10-bounded sf100-bounded (NDP mode)."""
import sys
def read(path):
    rows = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 5 and (cells[0].startswith('q') or cells[0] == 'total') and cells[1][0].isdigit():
            rows[cells[0]] = (float(cells[1]), cells[4])
    return rows
a, b, c, d = (read(p) for p in sys.argv[1:5])
print('| query | SF 10 ms | SF 100 ms | x | peak MB | bound: SF 10 ms | SF 100 ms | x | peak MB |')
print('|---|---|---|---|---|---|---|---|---|')
for q in a:
    print(f'| {q} | {a[q][0]:,.0f} | {b[q][0]:,.0f} | {b[q][0]/a[q][0]:.1f}x | {a[q][1]} / {b[q][1]} | '
          f'{c[q][0]:,.0f} | {d[q][0]:,.0f} | {d[q][0]/c[q][0]:.1f}x | {c[q][1]} / {d[q][1]} |')
