// Part 46: dense aggregation by key value, rows in input order against rows
// grouped by key range first (a counting sort of each chunk of C rows by
// key >> SHIFT, stable), on this machine. One `count` per row and the
// touched bit, as DenseAggregateExec's by-slot path does (Q13: 148 M order
// rows into 10 M customer keys at SF 100, 15 M rows into 1 M keys at SF 10).
// rustc -O -C target-cpu=native mb_sorted.rs && ./mb_sorted
use std::time::Instant;

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn apply(keys: &[u32], counts: &mut [u64], touched: &mut [u64], values: &[u64]) -> u64 {
    let mut groups = 0;
    for (i, &k) in keys.iter().enumerate() {
        let slot = k as usize + 1;
        let w = &mut touched[slot / 64];
        let bit = 1u64 << (slot % 64);
        if *w & bit == 0 {
            *w |= bit;
            groups += 1;
        }
        counts[slot] += values[i];
    }
    groups
}

fn main() {
    const SHIFT: u32 = 10;
    for &(name, slots, rows) in &[("SF 10 (1.5 M keys, 7.5 M rows)", 1_500_000usize, 7_500_000usize),
                                  ("SF 100 (15 M keys, 75 M rows)", 15_000_000, 75_000_000)] {
        let mut s = 0x9E3779B97F4A7C15u64;
        let keys: Vec<u32> = (0..rows).map(|_| (xorshift(&mut s) % slots as u64) as u32).collect();
        let values: Vec<u64> = vec![1; rows];
        // In input order.
        let mut counts = vec![0u64; slots + 1];
        let mut touched = vec![0u64; (slots + 1).div_ceil(64)];
        let t = Instant::now();
        let g = apply(&keys, &mut counts, &mut touched, &values);
        let base = t.elapsed().as_secs_f64() * 1e9 / rows as f64;
        println!("{name}: input order {base:.1} ns/row ({g} groups)");
        for &chunk in &[65_536usize, 262_144, 1 << 20, 4 << 20] {
            let mut counts = vec![0u64; slots + 1];
            let mut touched = vec![0u64; (slots + 1).div_ceil(64)];
            let buckets = (slots >> SHIFT) + 1;
            let mut hist = vec![0u32; buckets + 1];
            let mut order = vec![0u32; chunk];
            let mut sk = vec![0u32; chunk];
            let mut sv = vec![0u64; chunk];
            let t = Instant::now();
            let mut g = 0;
            for start in (0..rows).step_by(chunk) {
                let ks = &keys[start..(start + chunk).min(rows)];
                let vs = &values[start..(start + chunk).min(rows)];
                hist.iter_mut().for_each(|h| *h = 0);
                for &k in ks { hist[(k >> SHIFT) as usize + 1] += 1; }
                for b in 1..=buckets { hist[b] += hist[b - 1]; }
                for (i, &k) in ks.iter().enumerate() {
                    let b = (k >> SHIFT) as usize;
                    order[hist[b] as usize] = i as u32;
                    hist[b] += 1;
                }
                let n = ks.len();
                for j in 0..n { let i = order[j] as usize; sk[j] = ks[i]; sv[j] = vs[i]; }
                g += apply(&sk[..n], &mut counts, &mut touched, &sv[..n]);
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / rows as f64;
            println!("{name}: chunks of {chunk} rows sorted by key >> {SHIFT}: {ns:.1} ns/row ({g} groups), {:.2}x", base / ns);
        }
    }
}
