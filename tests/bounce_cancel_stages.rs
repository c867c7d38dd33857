//! `releaseReqH` on a bounce request at each stage of its life, through the
//! plugin, the stage hit deterministically with a failpoint:
//! - before GRANT (the receiver reserves regions but withholds its GRANTs);
//! - during gather (each gather waits 300 ms);
//! - during write (each chunk write waits 300 ms before it is posted);
//! - during scatter (each scatter on the receiver waits 300 ms).
//!
//! Each round asserts: the release returns at once; the request reaches its
//! terminal state (counted as cancelled) within its bound; both arenas end
//! with nothing held and every byte accounted for; no byte outside the
//! transfer's destinations changed; then the next transfer is byte-exact.
mod support;

use bounce::*;
use faults::*;
use nixl_sys::ThreadSync;
use std::time::{Duration, Instant};
use support::*;

const MANY: usize = 4096;
const ARENA: u64 = 4 << 20;
/// 16 chunks of 1 MiB per request; 4 MiB arena.
const EX: [(&str, &str); 4] = [
    LOOPBACK,
    ("max_chunk_size_bytes", "1MiB"),
    ("arena_size_bytes", "4MiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
];
/// A cancelled request is terminal once its running gathers end (<= one
/// 300 ms delay); the arenas are idle once running writes and scatters end
/// and the CANCEL was handled. Generous for a loaded 2-core machine.
const TERMINAL_BOUND: Duration = Duration::from_secs(5);

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

#[derive(Clone, Copy, Debug)]
enum Stage {
    BeforeGrant,
    DuringGather,
    DuringWrite,
    DuringScatter,
}

/// Runs one round; returns (release time, time to terminal, time to idle).
fn cancel_at(stage: Stage) -> (Duration, Duration, Duration) {
    let (sender_fp, receiver_fp) = match stage {
        Stage::BeforeGrant => ("", "withhold_grant"),
        Stage::DuringGather => ("delay_gather_ms=300", ""),
        Stage::DuringWrite => ("delay_write_ms=300", ""),
        Stage::DuringScatter => ("", "delay_scatter_ms=300"),
    };
    let mut a = with_failpoints(sender_fp, || {
        endpoint("cs-a", &EX, len(), 1, ThreadSync::Default)
    });
    let mut b = with_failpoints(receiver_fp, || {
        endpoint("cs-b", &EX, len(), 2, ThreadSync::Default)
    });
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(MANY, BLOCK, 7);
    let b_before = b.buf.as_slice().to_vec();
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let req = write_request(&a, &b, &plan);
    post(&a.node, &req).or_fail("post");

    // Until the stage is reached.
    let reached = || {
        let (ea, eb) = (stats(a.name()), stats(b.name()));
        match stage {
            // The receiver granted (and withheld the GRANT): its regions
            // are reserved for a sender that never hears of them.
            Stage::BeforeGrant => eb.since(&sb, "grants") > 0,
            // Gathers start eagerly at submission and take 300 ms each.
            Stage::DuringGather => ea.get("arena_local_bytes") > 0,
            // Gathered, credited, handed to the (delayed) writer.
            Stage::DuringWrite => eb.since(&sb, "grants") > 0 && ea.since(&sa, "gather_ns") > 0,
            // A chunk landed and its scatter (300 ms) runs.
            Stage::DuringScatter => ea.since(&sa, "chunks_written") > 0,
        }
    };
    wait_for(
        Duration::from_secs(10),
        || format!("{stage:?} never reached"),
        reached,
    );
    let t0 = Instant::now();
    drop(req); // releaseReqH
    let released = t0.elapsed();
    let terminal = wait_for(
        TERMINAL_BOUND,
        || {
            format!(
                "{stage:?}: the cancelled request is not terminal: {}",
                stats(a.name()).diff(&sa)
            )
        },
        || stats(a.name()).since(&sa, "bounce_cancels") == 1,
    );
    let idle_a = wait_arena_idle(a.name(), ARENA, TERMINAL_BOUND);
    let idle_b = wait_arena_idle(b.name(), ARENA, TERMINAL_BOUND);
    let (ea, eb) = (stats(a.name()), stats(b.name()));
    eprintln!(
        "{stage:?}: release {released:?}, terminal after {terminal:?}, arenas idle after {:?}; {} ; {}",
        idle_a.max(idle_b),
        ea.diff(&sa),
        eb.diff(&sb)
    );
    assert!(
        released < Duration::from_millis(500),
        "{stage:?}: releaseReqH took {released:?}"
    );
    assert_eq!(ea.since(&sa, "bounce_succeeded"), 0, "{stage:?}");
    assert!(
        ea.poisoned.is_none() && eb.poisoned.is_none(),
        "{stage:?}: poisoned"
    );
    outside_destinations_unchanged(b.buf.as_slice(), &b_before, &plan)
        .or_fail(&format!("{stage:?}: receiver buffer"));
    b.buf.check_guards().or_fail("guards");

    // The next transfer: byte-exact. A receiver that withholds its GRANTs
    // still sends: the pair is used the other way round.
    let (from, to) = match stage {
        Stage::BeforeGrant => (&mut b, &mut a),
        _ => (&mut a, &mut b),
    };
    let plan = Plan::standard(MANY, BLOCK, 8);
    from.buf.fill_pattern(9);
    let (src, dst_before) = (from.buf.as_slice().to_vec(), to.buf.as_slice().to_vec());
    let (s0, r0) = (stats(from.name()), stats(to.name()));
    let req = write_request(from, to, &plan);
    from.node
        .post_and_wait(&req, wait_timeout())
        .or_fail(&format!("{stage:?}: the next transfer"));
    drop(req);
    plan.verify(to.buf.as_slice(), &dst_before, &src)
        .or_fail(&format!("{stage:?}: the next transfer"));
    let (s1, r1) = (stats(from.name()), stats(to.name()));
    assert_sender_bounced(&s0, &s1, 1);
    assert_receiver_scattered(&r0, &r1, s1.since(&s0, "chunks_written"));
    wait_arena_idle(from.name(), ARENA, TERMINAL_BOUND);
    wait_arena_idle(to.name(), ARENA, TERMINAL_BOUND);
    (released, terminal, idle_a.max(idle_b))
}

#[test]
#[serial_test::serial]
fn cancel_before_grant() {
    if ready("BOUNCE") {
        cancel_at(Stage::BeforeGrant);
    }
}

#[test]
#[serial_test::serial]
fn cancel_during_gather() {
    if ready("BOUNCE") {
        let (_, terminal, _) = cancel_at(Stage::DuringGather);
        // Failure is reported only once no gather reads the source.
        assert!(
            terminal > Duration::from_millis(50),
            "terminal after {terminal:?}, while gathers still ran"
        );
    }
}

#[test]
#[serial_test::serial]
fn cancel_during_write() {
    if ready("BOUNCE") {
        cancel_at(Stage::DuringWrite);
    }
}

#[test]
#[serial_test::serial]
fn cancel_during_scatter() {
    if ready("BOUNCE") {
        cancel_at(Stage::DuringScatter);
    }
}
