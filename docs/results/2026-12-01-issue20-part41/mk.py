# Writes K orderkey-range variants of Q21 and Q3 (range-local joins) for psql.
import sys, re
sf, k = float(sys.argv[1]), int(sys.argv[2])
top = int(6_000_000 * sf) + 100
bounds = [i * top // k for i in range(k + 1)]
q21 = open('/work/main/queries/tpch/q21.sql').read().rstrip().rstrip(';')
q3 = open('/work/main/queries/tpch/q3.sql').read().rstrip().rstrip(';')
q9 = open('/work/main/queries/tpch/q9.sql').read().rstrip().rstrip(';')
def ranged(q, cols, a, b):
    extra = ''.join(f"\n    and {c} >= {a} and {c} < {b}" for c in cols)
    # put range predicates right after the first 'where'
    i = q.index('where') + len('where')
    for t in ('l2', 'l3'):
        q = q.replace(f'{t}.l_orderkey = l1.l_orderkey', f'{t}.l_orderkey = l1.l_orderkey and {t}.l_orderkey >= {a} and {t}.l_orderkey < {b}')
    i = q.index('where') + len('where')
    return q[:i] + extra.replace('\n    and', '\n   ', 1) + '\n    and' + q[i:]
for name, q, cols in [('q21', q21, ['l1.l_orderkey', 'o_orderkey']), ('q3', q3, ['l_orderkey', 'o_orderkey']), ('q9', q9, ['l_orderkey', 'o_orderkey'])]:
    with open(f'{name}-whole.sql', 'w') as f:
        f.write('\\timing on\n' + q + ';\n')
    with open(f'{name}-k{k}.sql', 'w') as f:
        f.write('\\timing on\n')
        for a, b in zip(bounds, bounds[1:]):
            f.write(ranged(q, cols, a, b) + ';\n')
# The EXPLAIN ANALYZE files: `explain analyze` before q21-whole.sql's query
# (q21-ea-sf10-*.txt, q21-ea-sf100-*.txt), before the 4th query of
# `mk.py 100 8`'s q21-k8.sql (range 3 of 8) and the 11th of `mk.py 100 32`'s
# q21-k32.sql (range 10 of 32), each run through psql against `sieve serve`.
