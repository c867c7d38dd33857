//! Checks of the test harness itself (no NIXL runtime needed): the verifier
//! catches wrong bytes inside and outside the destination blocks, plans are
//! scattered subsets without repeats, patterns depend on the seed.
mod support;

use std::collections::HashSet;
use support::*;

#[test]
fn plans_are_scattered_without_repeats() {
    let p = Plan::standard(4096, 4096, 7);
    assert_eq!(p.len(), 4096);
    let s: HashSet<_> = p.src.iter().collect();
    let d: HashSet<_> = p.dst.iter().collect();
    assert_eq!(s.len(), 4096, "source blocks repeat");
    assert_eq!(d.len(), 4096, "destination blocks repeat");
    assert!(p
        .src
        .iter()
        .all(|o| o % 4096 == 0 && *o < blocks_for(4096) * 4096));
    assert_ne!(p.src, p.dst, "source and destination layouts should differ");
    let sorted = p.dst.windows(2).filter(|w| w[0] < w[1]).count();
    assert!(
        sorted < 3000 && sorted > 1000,
        "destination order is not shuffled"
    );
    assert_eq!(
        Plan::standard(4096, 4096, 7).dst,
        p.dst,
        "plans must be deterministic"
    );
    assert_ne!(Plan::standard(4096, 4096, 8).dst, p.dst, "seed must matter");
}

#[test]
fn patterns_depend_on_seed() {
    let a = pattern(1 << 16, 1);
    let b = pattern(1 << 16, 2);
    assert_eq!(a, pattern(1 << 16, 1));
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(
        same < (1 << 16) / 100,
        "patterns of different seeds too similar: {same}"
    );
    // Blocks of one pattern differ from each other (a block copied to the
    // wrong place is detected).
    assert_ne!(a[..4096], a[4096..8192]);
}

#[test]
fn verifier_catches_errors() {
    let n = 16;
    let plan = Plan::standard(n, 4096, 3);
    let len = blocks_for(n) * 4096;
    let src = pattern(len, 10);
    let before = pattern(len, 20);
    let good = plan.expected(&before, &src);
    plan.verify(&good, &before, &src)
        .expect("correct result rejected");

    // Wrong byte inside a destination block.
    let mut bad = good.clone();
    bad[plan.dst[5] + 17] ^= 1;
    let e = plan.verify(&bad, &before, &src).unwrap_err();
    assert!(e.contains("descriptor 5"), "{e}");

    // Byte changed outside every destination block.
    let used: HashSet<usize> = plan.dst.iter().map(|o| o / 4096).collect();
    let free = (0..blocks_for(n)).find(|b| !used.contains(b)).unwrap();
    let mut bad = good.clone();
    bad[free * 4096 + 4095] ^= 0x80;
    let e = plan.verify(&bad, &before, &src).unwrap_err();
    assert!(e.contains("OUTSIDE"), "{e}");

    // Two blocks swapped.
    let mut bad = good.clone();
    let (a, b) = (plan.dst[0], plan.dst[1]);
    let tmp = bad[a..a + 4096].to_vec();
    bad.copy_within(b..b + 4096, a);
    bad[b..b + 4096].copy_from_slice(&tmp);
    assert!(plan.verify(&bad, &before, &src).is_err());
}

#[test]
fn guard_zones_detect_overruns() {
    let mut b = DramBuffer::with_pattern(10_000, 1);
    assert_eq!(b.addr() % PAGE, 0, "buffer must be page-aligned");
    b.check_guards().unwrap();
    let p = b.as_mut_slice().as_mut_ptr();
    // SAFETY: writes one byte just past the buffer, inside its guard zone.
    unsafe { *p.add(10_000) = 0 };
    assert!(b.check_guards().unwrap_err().contains("AFTER"));
}

#[test]
fn hex_round_trip() {
    let v: Vec<u8> = (0..=255).collect();
    assert_eq!(unhex(&hex(&v)).unwrap(), v);
}
