//! The seeded plans and byte patterns both processes compute.

use nixl_bounce::splitmix::SplitMix64;

/// A random order of `0..n`.
fn perm(r: &mut SplitMix64, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    r.shuffle(&mut v);
    v
}

pub(super) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut r = SplitMix64::new(seed ^ 0x5eed);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// One or more plans, as both processes rebuild them from a command line:
/// `parts` plans of `n` moves each, part `t` over slots
/// `[t*slots, (t+1)*slots)` with seed `seed + t`.
pub(super) fn plans(
    parts: usize,
    n: usize,
    size: usize,
    slots: usize,
    seed: u64,
    mixed: bool,
) -> Vec<Plan> {
    (0..parts)
        .map(|t| plan(n, size, slots, t * slots * size, seed + t as u64, mixed))
        .collect()
}

/// The destination buffer after applying `plans` from source pattern `sseed`
/// over destination pattern `dseed`.
pub(super) fn expected(len: usize, plans: &[Plan], sseed: u64, dseed: u64) -> Vec<u8> {
    let src = pattern(len, sseed);
    let mut want = pattern(len, dseed);
    for p in plans {
        for &(s, d, l) in &p.moves {
            want[d..d + l].copy_from_slice(&src[s..s + l]);
        }
    }
    want
}

/// `n` moves of `size` bytes: source block i -> destination block, both
/// scattered over `slots` blocks of `size` starting at `base` (bytes) of each
/// buffer. Mixed mode varies the length per descriptor (1..=size).
#[derive(Clone)]
pub(super) struct Plan {
    pub(super) moves: Vec<(usize, usize, usize)>, // (src off, dst off, len)
}

pub(super) fn plan(
    n: usize,
    size: usize,
    slots: usize,
    base: usize,
    seed: u64,
    mixed: bool,
) -> Plan {
    let mut r = SplitMix64::new(seed);
    let src = perm(&mut r, slots);
    let dst = perm(&mut r, slots);
    let moves = (0..n)
        .map(|i| {
            let len = if mixed {
                1 + (r.next_u64() as usize % size)
            } else {
                size
            };
            (base + src[i] * size, base + dst[i] * size, len)
        })
        .collect();
    Plan { moves }
}
