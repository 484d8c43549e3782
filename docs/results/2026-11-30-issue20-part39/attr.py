import re,sys,collections
def load(sf):
    walls=[]
    for l in open(f'pf-{sf}.err'):
        m=re.match(r'(q\d+): ndp ([\d.]+) ms',l)
        if m: walls.append((m.group(1),float(m.group(2))/1000))
    rows=[]
    for l in open(f'ps-{sf}.tsv'):
        p=l.rstrip('\n').split('\t')
        if len(p)<3: continue
        rows.append((float(p[0]),p[1],p[2].strip()))
    act=[r[0] for r in rows if r[1] in('tokio-rt-worker','sieve-pushdown')]
    end=max(act)
    # windows backwards from end
    bounds={};t=end
    for q,w in reversed(walls):
        bounds[q]=(t-w,t); t-=w
    out=collections.defaultdict(collections.Counter)
    for ts,c,s in rows:
        for q,(a,b) in bounds.items():
            if a<=ts<b:
                cc={'tokio-rt-worker':'C','sieve-pushdown':'S'}.get(c,'O')
                out[q][(cc,s[:90])]+=1;break
    return out,walls
a,w=load(10);b,_=load(100)
want=sys.argv[1:]
for q,_ in w:
    ca=a[q];cb=b[q]
    tc=lambda d,c:sum(v for k,v in d.items() if k[0]==c)
    print(f"{q:4} C {tc(ca,'C'):5} {tc(cb,'C'):6} {tc(cb,'C')/max(tc(ca,'C'),1):5.1f}  S {tc(ca,'S'):5} {tc(cb,'S'):6} {tc(cb,'S')/max(tc(ca,'S'),1):5.1f}")
    if q in want:
        ks=sorted(set(ca)|set(cb),key=lambda k:-(cb[k]-11*ca[k]))
        for k in ks[:14]: print(f"     {cb[k]-11*ca[k]:6} {ca[k]:5} {cb[k]:6} {k[0]} {k[1]}")
