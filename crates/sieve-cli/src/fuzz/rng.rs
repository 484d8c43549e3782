//! A small deterministic pseudo-random number generator, written here so that
//! the fuzzer's tables and queries depend on the seed alone (no dependency
//! whose stream could change between versions).
//!
//! The generator is SplitMix64 (Steele, Lea and Flood, "Fast splittable
//! pseudorandom number generators", 2014): a 64-bit counter advanced by the
//! golden-ratio increment and scrambled by two multiply-xorshift rounds. It
//! passes BigCrush, needs no warm-up, and every seed, zero included, is a
//! good one, which is all a fuzzer asks for.

/// The golden-ratio increment of SplitMix64's counter.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A deterministic stream of pseudo-random numbers: the same seed gives the
/// same stream on every machine and every build.
///
/// ```
/// use sieve_cli::fuzz::SeededRandom;
/// let mut first = SeededRandom::new(7);
/// let mut second = SeededRandom::new(7);
/// assert_eq!(first.next_u64(), second.next_u64());
/// assert!(first.below(10) < 10);
/// ```
#[derive(Debug, Clone)]
pub struct SeededRandom {
    state: u64,
}

impl SeededRandom {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The seed of an independent stream for `label` (a schema or query
    /// index), derived from `seed` without advancing any stream, so that
    /// schema 5 is the same whether or not schemas 0 to 4 ran.
    pub fn derive_seed(seed: u64, label: u64) -> u64 {
        let mut derived = Self::new(seed ^ label.wrapping_mul(GOLDEN_GAMMA).rotate_left(17));
        derived.next_u64();
        derived.next_u64()
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        let mut mixed = self.state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        mixed ^ (mixed >> 31)
    }

    /// A number in `0..bound`; `bound` must be positive (zero gives zero).
    /// The modulo bias is below 2⁻⁴⁰ for the small bounds the fuzzer uses.
    pub fn below(&mut self, bound: usize) -> usize {
        if bound == 0 {
            return 0;
        }
        (self.next_u64() % bound as u64) as usize
    }

    /// A number in `low..=high` (`high` below `low` gives `low`).
    pub fn between(&mut self, low: i64, high: i64) -> i64 {
        if high <= low {
            return low;
        }
        let span = (high as i128 - low as i128 + 1) as u128;
        (low as i128 + (self.next_u64() as u128 % span) as i128) as i64
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u32) -> bool {
        self.below(100) < percent as usize
    }

    /// A float uniformly in `[0, 1)`, from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// One element of `items`, which must not be empty.
    pub fn pick<'items, T>(&mut self, items: &'items [T]) -> &'items T {
        &items[self.below(items.len())]
    }

    /// The index of one of `weights`, chosen with probability proportional
    /// to its weight (all zero: the first).
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|&weight| u64::from(weight)).sum();
        if total == 0 {
            return 0;
        }
        let mut point = self.next_u64() % total;
        for (index, &weight) in weights.iter().enumerate() {
            if point < u64::from(weight) {
                return index;
            }
            point -= u64::from(weight);
        }
        weights.len() - 1
    }

    /// Shuffle `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for index in (1..items.len()).rev() {
            let other = self.below(index + 1);
            items.swap(index, other);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeededRandom;

    #[test]
    fn the_stream_depends_on_the_seed_alone() {
        let first: Vec<u64> = {
            let mut random = SeededRandom::new(42);
            (0..4).map(|_| random.next_u64()).collect()
        };
        let second: Vec<u64> = {
            let mut random = SeededRandom::new(42);
            (0..4).map(|_| random.next_u64()).collect()
        };
        assert_eq!(first, second);
        assert_ne!(
            SeededRandom::derive_seed(42, 1),
            SeededRandom::derive_seed(42, 2)
        );
    }

    #[test]
    fn bounded_draws_stay_in_bounds() {
        let mut random = SeededRandom::new(0);
        for _ in 0..1000 {
            assert!(random.below(7) < 7);
            let value = random.between(-3, 3);
            assert!((-3..=3).contains(&value));
            let unit = random.unit();
            assert!((0.0..1.0).contains(&unit));
            assert!(random.weighted(&[0, 5, 0, 1]) % 2 == 1);
        }
    }
}
