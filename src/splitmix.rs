//! The crate's one pseudo-random generator (SplitMix64): seeded and
//! reproducible, for the simulation's scenarios, the tests' layouts and
//! patterns, and the benchmarks' plans. Nothing secret comes from it (the
//! arena's access keys come from the operating system).

/// SplitMix64 (Steele, Lea, Flood 2014): one 64-bit state, every seed good.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (modulo bias, irrelevant here); 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// As [`SplitMix64::below`] for indices.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p` (never when `p` is 0). Draws a number
    /// whatever `p` is, so that a scenario's later draws do not depend on it.
    pub fn chance(&mut self, p: f64) -> bool {
        let draw = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        p > 0.0 && draw <= p
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.index(i + 1));
        }
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// SplitMix64's output function: a good 64-bit mix of `z`.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_sequence() {
        // The first outputs for seed 1234567 of the reference implementation.
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn ranges_hold() {
        let mut r = SplitMix64::new(7);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            assert!((5..=9).contains(&r.range(5, 9)));
        }
        assert_eq!(r.below(0), 0);
        assert!(!r.chance(0.0));
        let mut v: Vec<u32> = (0..100).collect();
        r.shuffle(&mut v);
        v.sort();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
