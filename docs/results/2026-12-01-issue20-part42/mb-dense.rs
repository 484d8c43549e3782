use std::time::Instant;
const NO: u32 = u32::MAX;
fn rng(s: &mut u64) -> u64 { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; *s }
struct G { gos: Vec<u32>, counts: Vec<i64>, groups: usize, idx: Vec<usize> }
impl G {
    fn new(slots: usize) -> Self { G { gos: vec![NO; slots], counts: Vec::new(), groups: 0, idx: Vec::new() } }
    fn add(&mut self, keys: &[i64], vals: &[i64]) {
        self.idx.clear();
        for &k in keys {
            let g = &mut self.gos[k as usize + 1];
            if *g == NO { *g = self.groups as u32; self.groups += 1; }
            self.idx.push(*g as usize);
        }
        self.counts.resize(self.groups, 0);
        for (&i, &v) in self.idx.iter().zip(vals) { self.counts[i] += v; }
    }
}
fn run(keys: &[i64], vals: &[i64], slots: usize, radix: Option<(usize, u32)>) -> f64 {
    let mut g = G::new(slots);
    let t = Instant::now();
    match radix {
        None => for (k, v) in keys.chunks(8192).zip(vals.chunks(8192)) { g.add(k, v); },
        Some((buf, shift)) => {
            let nb = (slots >> shift) + 1;
            let mut counts = vec![0usize; nb + 1];
            let mut kk = vec![0i64; buf]; let mut vv = vec![0i64; buf];
            for (k, v) in keys.chunks(buf).zip(vals.chunks(buf)) {
                counts.iter_mut().for_each(|c| *c = 0);
                for &x in k { counts[((x as usize + 1) >> shift) + 1] += 1; }
                for b in 1..=nb { counts[b] += counts[b - 1]; }
                for (&x, &y) in k.iter().zip(v) { let b = (x as usize + 1) >> shift; let p = counts[b]; kk[p] = x; vv[p] = y; counts[b] += 1; }
                let n = k.len();
                for (k2, v2) in kk[..n].chunks(8192).zip(vv[..n].chunks(8192)) { g.add(k2, v2); }
            }
        }
    }
    let e = t.elapsed().as_secs_f64();
    std::hint::black_box(&g.counts);
    e / keys.len() as f64 * 1e9
}
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let keyspace: usize = a[1].parse().unwrap();
    let rows: usize = a[2].parse().unwrap();
    let threads: usize = a[3].parse().unwrap();
    let hs = (0..threads).map(|t| std::thread::spawn(move || {
        let mut s = 88172645463325252u64 + t as u64;
        let keys: Vec<i64> = (0..rows).map(|_| (rng(&mut s) % keyspace as u64) as i64).collect();
        let vals: Vec<i64> = vec![1; rows];
        let slots = keyspace + 2;
        let d = run(&keys, &vals, slots, None);
        let mut c = vec![0i64; slots]; let t0 = Instant::now();
        for (&k, &v) in keys.iter().zip(&vals) { c[k as usize + 1] += v; }
        let ds = t0.elapsed().as_secs_f64() / rows as f64 * 1e9; std::hint::black_box(&c);
        let r1 = run(&keys, &vals, slots, Some((1 << 20, 16)));
        let r2 = run(&keys, &vals, slots, Some((1 << 22, 16)));
        let r3 = run(&keys, &vals, slots, Some((1 << 20, 14)));
        format!("slot-direct {ds:.1}; direct {d:.1} ns/row; radix 1M/64K {r1:.1}; 4M/64K {r2:.1}; 1M/16K {r3:.1}")
    })).collect::<Vec<_>>();
    for h in hs { println!("{}", h.join().unwrap()); }
}
