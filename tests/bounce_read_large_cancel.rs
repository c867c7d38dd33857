//! READ over the bounce path, streaming and cancellation:
//! - one READ larger than both arenas streams through them: arenas of
//!   4 MiB, chunks of 512 KiB, 16384 scattered 4 KiB blocks (64 MiB, 16
//!   arenas' worth), byte-exact, counted on both sides, over ZMQ and over
//!   NIXL notifications; also odd descriptor sizes that straddle chunks;
//! - a READ released (cancelled) while it runs: the release returns at
//!   once, the owner never gets the READ's notification, nothing is
//!   poisoned, and READs both ways succeed afterwards.
mod support;

use bounce::*;
use nixl_sys::ThreadSync;
use std::time::{Duration, Instant};
use support::*;

const SMALL_ARENA: [(&str, &str); 3] = [
    ("arena_size_bytes", "4MiB"),
    ("max_chunk_size_bytes", "512KiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
];

/// `r` READs `plan` from `o`, byte-exact; returns the chunks it took.
fn read(r: &mut Endpoint, o: &mut Endpoint, plan: &Plan, seeds: (u64, u64)) -> u64 {
    r.buf.fill_pattern(seeds.0);
    o.buf.fill_pattern(seeds.1);
    let (src, dst_before) = (o.buf.as_slice().to_vec(), r.buf.as_slice().to_vec());
    let (sr, so) = (stats(r.name()), stats(o.name()));
    let req = read_request(r, o, plan, None);
    let dt = r.node.post_and_wait(&req, wait_timeout()).or_fail("READ");
    drop(req);
    plan.verify(r.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    verify_bytes(o.buf.as_slice(), &src, |_| "source".into()).or_fail("source changed");
    r.buf.check_guards().or_fail("guards");
    let er = stats(r.name());
    let eo = stats_once(o.name(), &so, "reads_served", 1, wait_timeout());
    let chunks = eo.since(&so, "chunks_written");
    eprintln!(
        "{} <- {}: {} B in {dt:?} ({:.2} GB/s), {chunks} chunks; {} ; {}",
        r.name(),
        o.name(),
        plan.bytes(),
        plan.bytes() as f64 / dt.as_secs_f64() / 1e9,
        er.diff(&sr),
        eo.diff(&so)
    );
    assert_eq!(er.since(&sr, "bounce_submitted"), 1, "{}", er.diff(&sr));
    assert_eq!(er.since(&sr, "bounce_succeeded"), 1, "{}", er.diff(&sr));
    assert_eq!(eo.since(&so, "reads_served"), 1, "{}", eo.diff(&so));
    assert_eq!(
        er.since(&sr, "chunks_scattered"),
        chunks,
        "every chunk scattered once"
    );
    assert!(er.poisoned.is_none() && eo.poisoned.is_none());
    chunks
}

fn stream(extra: &[(&str, &str)], n: usize, block: usize, seed: u64) {
    let len = (n + n / 8 + 2) * block;
    let mut r = endpoint("rl-r", extra, len, seed, ThreadSync::Default);
    let mut o = endpoint("rl-o", extra, len, seed + 1, ThreadSync::Default);
    pair_up(&r.node, &o.node);
    let blocks = len / block;
    for round in 0..2u64 {
        let plan = Plan::scattered(n, block, blocks, blocks, seed * 10 + round);
        let chunks = read(
            &mut r,
            &mut o,
            &plan,
            (seed * 100 + round, seed * 100 + 50 + round),
        );
        assert!(
            chunks as usize >= (n * block).div_ceil(512 * KIB),
            "{chunks} chunks for {} B of 512 KiB chunks",
            n * block
        );
    }
}

#[test]
#[serial_test::serial]
fn read_16x_the_arena_streams() {
    if !ready("BOUNCE") {
        return;
    }
    let mut ex = vec![LOOPBACK];
    ex.extend(SMALL_ARENA);
    stream(&ex, 16384, BLOCK, 1);
}

#[test]
#[serial_test::serial]
fn read_16x_the_arena_streams_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    let mut ex = vec![NOTIF_CONTROL];
    ex.extend(SMALL_ARENA);
    stream(&ex, 16384, BLOCK, 2);
}

#[test]
#[serial_test::serial]
fn read_of_odd_sizes_straddles_chunks() {
    if !ready("BOUNCE") {
        return;
    }
    // 3000 B descriptors (not a divisor of 512 KiB, not 32-byte aligned):
    // 7001 of them, 21 MB, 5x the arena.
    let mut ex = vec![LOOPBACK];
    ex.extend(SMALL_ARENA);
    stream(&ex, 7001, 3000, 3);
}

#[test]
#[serial_test::serial]
fn read_released_while_running_then_keep_going() {
    if !ready("BOUNCE") {
        return;
    }
    const MANY: usize = 4096;
    let len = blocks_for(MANY) * BLOCK;
    // Small chunks, one in flight: the READ is still running when released.
    let ex = [
        LOOPBACK,
        ("max_chunk_size_bytes", "64KiB"),
        ("arena_size_bytes", "4MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
        ("max_inflight_chunks_per_request", "1"),
    ];
    let mut r = endpoint("rc-r", &ex, len, 5, ThreadSync::Default);
    let mut o = endpoint("rc-o", &ex, len, 6, ThreadSync::Default);
    pair_up(&r.node, &o.node);
    let msg = b"cancelled-read";
    for i in 0..3u64 {
        let plan = Plan::standard(MANY, BLOCK, 20 + i);
        let (sr, so) = (stats(r.name()), stats(o.name()));
        let req = read_request(&r, &o, &plan, Some(msg));
        post(&r.node, &req).or_fail("post");
        // Release once data flows (i chunks in), while the READ runs.
        let t0 = Instant::now();
        while stats(r.name()).since(&sr, "chunks_scattered") < i + 1 {
            check_deadline(t0, Duration::from_secs(20), &|| "no chunk arrived".into());
            std::thread::sleep(Duration::from_micros(100));
        }
        let t1 = Instant::now();
        drop(req);
        let dt = t1.elapsed();
        assert!(
            dt < Duration::from_secs(1),
            "releasing a running bounce READ took {dt:?}"
        );
        // Settle: the owner ends its serve once its writes ended.
        std::thread::sleep(Duration::from_millis(200));
        let (er, eo) = (stats(r.name()), stats(o.name()));
        eprintln!(
            "release #{i}: took {dt:?}; {} ; {}",
            er.diff(&sr),
            eo.diff(&so)
        );
        assert_eq!(er.since(&sr, "bounce_submitted"), 1);
        assert_eq!(er.since(&sr, "bounce_cancels"), 1, "{}", er.diff(&sr));
        assert_eq!(eo.since(&so, "reads_served"), 0, "{}", eo.diff(&so));
        assert!(
            er.since(&sr, "chunks_scattered") < (MANY * BLOCK / (64 * KIB)) as u64,
            "the READ ran to its end before the release"
        );
        let notifs = take_notifs(&o.node).or_fail("owner notifications");
        assert!(
            !notifs.iter().any(|(_, m)| m == msg),
            "the owner got the notification of a cancelled READ"
        );
    }
    // The pair still moves data, both ways.
    let plan = Plan::standard(MANY, BLOCK, 30);
    read(&mut r, &mut o, &plan, (31, 32));
    read(&mut o, &mut r, &plan, (33, 34));
}
