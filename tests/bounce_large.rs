//! One request larger than the whole arena streams through it: arenas of
//! 4 MiB, chunks of 512 KiB, one WRITE of 16384 scattered 4 KiB blocks
//! (64 MiB, 16 arenas' worth), byte-exact, bounce path counted, and the
//! process' resident memory during the transfer grows by far less than the
//! transfer (nothing stages the whole request). Variants: a size that does
//! not fill its last chunk and straddles chunk boundaries (odd descriptor
//! size), descriptors larger than a chunk (split into pieces), and the
//! same 64 MiB over the NIXL-notification control channel and with the
//! IO threads' reading passes cut after every message or never.
mod support;

use bounce::*;
use nixl_sys::ThreadSync;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

const ARENA: (&str, &str) = ("arena_size_bytes", "4MiB");
const CHUNK: (&str, &str) = ("max_chunk_size_bytes", "512KiB");
const GRAN: (&str, &str) = ("arena_allocation_granularity_bytes", "64KiB");

struct Case<'a> {
    what: &'a str,
    n: usize,
    block: usize,
    chunk: usize,
    extra: Vec<(&'a str, &'a str)>,
}

/// Runs `case` (twice, with different data and layouts) and returns the
/// largest RSS growth seen during a transfer.
fn stream(case: &Case<'_>, seed: u64) -> usize {
    let total = case.n * case.block;
    let len = (case.n + case.n / 8 + 2) * case.block;
    let mut a = endpoint("lg-a", &case.extra, len, seed, ThreadSync::Default);
    let mut b = endpoint("lg-b", &case.extra, len, seed + 1, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let blocks = len / case.block;
    let mut worst = 0usize;
    for round in 0..2u64 {
        let plan = Plan::scattered(case.n, case.block, blocks, blocks, seed * 10 + round);
        a.buf.fill_pattern(seed * 100 + round);
        b.buf.fill_pattern(seed * 100 + 50 + round);
        let (src, dst_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
        let req = write_request(&a, &b, &plan);
        let (sa, sb) = (stats(a.name()), stats(b.name()));

        // Sample the RSS every millisecond while the request runs.
        let base = rss_bytes();
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicUsize::new(base));
        let sampler = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let t0 = Instant::now();
        let r = a.node.post_and_wait(&req, wait_timeout());
        let dt = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        sampler.join().expect("sampler");
        r.or_fail(&format!("{}: round {round}", case.what));
        let growth = peak.load(Ordering::Relaxed).saturating_sub(base);
        worst = worst.max(growth);
        drop(req);

        plan.verify(b.buf.as_slice(), &dst_before, &src)
            .or_fail(case.what);
        verify_bytes(a.buf.as_slice(), &src, |_| "source".into()).or_fail("source changed");
        a.buf.check_guards().or_fail("guards");
        b.buf.check_guards().or_fail("guards");

        let (ea, eb) = (stats(a.name()), stats(b.name()));
        let chunks = ea.since(&sa, "chunks_written");
        eprintln!(
            "{} round {round}: {total} B in {dt:?} ({:.2} GB/s), {chunks} chunks, RSS +{} KiB during the transfer; {} ; {}",
            case.what,
            total as f64 / dt.as_secs_f64() / 1e9,
            growth / 1024,
            ea.diff(&sa),
            eb.diff(&sb)
        );
        assert_sender_bounced(&sa, &ea, 1);
        assert_receiver_scattered(&sb, &eb, chunks);
        assert!(
            ea.since(&sa, "bytes_written") as usize >= total,
            "bytes_written < {total}"
        );
        // Every chunk is at most one max chunk: the request cannot have
        // gone in fewer pieces (and each went through the 4 MiB arena).
        assert!(
            chunks as usize >= total.div_ceil(case.chunk),
            "{chunks} chunks for {total} B of {} B chunks",
            case.chunk
        );
        assert_eq!(
            eb.since(&sb, "chunks_scattered"),
            chunks,
            "every chunk scattered once"
        );
    }
    worst
}

fn assert_bounded(what: &str, growth: usize, total: usize) {
    // Both arenas (2 x 4 MiB, first touched by the first transfer: about
    // 9-10 MiB seen) plus per-request bookkeeping and transport buffers;
    // staging the request would need the whole request (64 MiB) once more.
    let bound = (total / 2).min(2 * 4 * MIB + 16 * MIB);
    assert!(
        growth < bound,
        "{what}: resident memory grew by {growth} B during a {total} B transfer (bound {bound} B): the request is not streamed through the arena"
    );
}

#[test]
#[serial_test::serial]
fn request_16x_the_arena_streams() {
    if !ready("BOUNCE") {
        return;
    }
    let c = Case {
        what: "16384 x 4 KiB through a 4 MiB arena",
        n: 16384,
        block: BLOCK,
        chunk: 512 * KIB,
        extra: vec![LOOPBACK, ARENA, CHUNK, GRAN],
    };
    let g = stream(&c, 1);
    assert_bounded(c.what, g, c.n * c.block);
}

#[test]
#[serial_test::serial]
fn odd_sizes_straddle_chunks_and_leave_a_partial_last_chunk() {
    if !ready("BOUNCE") {
        return;
    }
    // 3000 B descriptors (not a divisor of 512 KiB, not 32-byte aligned):
    // 7001 of them, 21 MB, 5x the arena.
    let c = Case {
        what: "7001 x 3000 B through a 4 MiB arena",
        n: 7001,
        block: 3000,
        chunk: 512 * KIB,
        extra: vec![LOOPBACK, ARENA, CHUNK, GRAN],
    };
    stream(&c, 2);
}

#[test]
#[serial_test::serial]
fn descriptors_larger_than_a_chunk_are_split() {
    if !ready("BOUNCE") {
        return;
    }
    // 20000 B descriptors, 16 KiB chunks: every descriptor is split across
    // two chunks. The routing limit is raised to let 20000 B average in.
    let c = Case {
        what: "1100 x 20000 B in 16 KiB chunks",
        n: 1100,
        block: 20000,
        chunk: 16 * KIB,
        extra: vec![
            LOOPBACK,
            ARENA,
            ("max_chunk_size_bytes", "16KiB"),
            ("arena_allocation_granularity_bytes", "16KiB"),
            ("max_average_descriptor_size_bytes", "32KiB"),
        ],
    };
    stream(&c, 3);
}

/// The IO threads' passes of reading control messages cut short after
/// each message (`receive_pass_us` 1) and not cut at all (0): every chunk's
/// DATA and ACK still arrive, in any number of passes, byte-exact.
#[test]
#[serial_test::serial]
fn request_16x_the_arena_streams_whatever_the_receive_pass() {
    if !ready("BOUNCE") {
        return;
    }
    for (seed, pass) in [(6, "1"), (7, "0")] {
        let c = Case {
            what: "16384 x 4 KiB through a 4 MiB arena, receive_pass_us",
            n: 16384,
            block: BLOCK,
            chunk: 512 * KIB,
            extra: vec![LOOPBACK, ARENA, CHUNK, GRAN, ("receive_pass_us", pass)],
        };
        let g = stream(&c, seed);
        assert_bounded(c.what, g, c.n * c.block);
    }
}

#[test]
#[serial_test::serial]
fn request_16x_the_arena_streams_over_zmq() {
    if !ready("BOUNCE") {
        return;
    }
    let c = Case {
        what: "16384 x 4 KiB through a 4 MiB arena, ZMQ control",
        n: 16384,
        block: BLOCK,
        chunk: 512 * KIB,
        extra: vec![LOOPBACK, ZMQ_CONTROL, ARENA, CHUNK, GRAN],
    };
    let g = stream(&c, 4);
    assert_bounded(c.what, g, c.n * c.block);
}

#[test]
#[serial_test::serial]
fn request_16x_the_arena_streams_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    let c = Case {
        what: "16384 x 4 KiB through a 4 MiB arena, NIXL-notification control",
        n: 16384,
        block: BLOCK,
        chunk: 512 * KIB,
        extra: vec![NOTIF_CONTROL, ARENA, CHUNK, GRAN],
    };
    let g = stream(&c, 4);
    assert_bounded(c.what, g, c.n * c.block);
}
