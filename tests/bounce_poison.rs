//! Fail-closed poisoning and capability negotiation, through the plugin:
//! - a chunk write that never ends (`stuck_chunk_writes`) keeps the arena
//!   from ever being proven quiescent once its peer is forgotten: the arena
//!   is poisoned, the process-wide report (`nixl_bounce_poisoned`,
//!   `stats::plugin_poisoned`) names it and why, new transfers take UCX
//!   (`fallback_poisoned`) byte-exact, and the peer's arena recovers;
//! - a panic on an instance's IO thread (`panic_in_io_thread`) fails the
//!   request at once and poisons the arena (reported, leaked);
//! - a peer that does not advertise CANCEL (`no_cancel_capability`) is
//!   served through UCX, counted by reason.
mod support;

use bounce::*;
use faults::*;
use nixl_sys::ThreadSync;
use std::time::Duration;
use support::*;

const MANY: usize = 4096;
const ARENA: u64 = 4 << 20;
const EX: [(&str, &str); 4] = [
    LOOPBACK,
    ("max_chunk_size_bytes", "1MiB"),
    ("arena_size_bytes", "4MiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
];

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// A new WRITE from `a`, whose arena is poisoned, to `b` takes UCX
/// (`fallback_poisoned`), byte-exact.
fn write_falls_back_poisoned(a: &mut Endpoint, b: &Endpoint, what: &str) {
    let plan = Plan::standard(MANY, BLOCK, 4);
    a.buf.fill_pattern(5);
    let (src, dst_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let s0 = stats(a.name());
    let req = write_request(a, b, &plan);
    a.node.post_and_wait(&req, wait_timeout()).or_fail(what);
    drop(req);
    plan.verify(b.buf.as_slice(), &dst_before, &src)
        .or_fail(what);
    assert_fell_back(&s0, &stats(a.name()), 1, "fallback_poisoned");
}

#[test]
#[serial_test::serial]
fn a_write_that_never_ends_poisons_the_arena_and_the_process_reports_it() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = with_failpoints("stuck_chunk_writes", || {
        endpoint("po-a", &EX, len(), 1, ThreadSync::Default)
    });
    let b = endpoint("po-b", &EX, len(), 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let ours = |r: &nixl_bounce::stats::PoisonedArena| r.arena.starts_with(a.name());
    let before = nixl_bounce::stats::plugin_poisoned().or_fail("poison report");
    assert!(!before.iter().any(ours), "{before:?}");

    let plan = Plan::standard(MANY, BLOCK, 3);
    let b_before = b.buf.as_slice().to_vec();
    let req = write_request(&a, &b, &plan);
    post(&a.node, &req).or_fail("post");
    // Writes handed out (and stuck): the receiver granted, we staged.
    wait_for(
        Duration::from_secs(10),
        || format!("no write handed out: {:?}", stats(a.name()).map),
        || stats(b.name()).get("grants") > 0 && stats(a.name()).get("arena_local_bytes") > 0,
    );
    std::thread::sleep(Duration::from_millis(50));
    // Forgetting the peer tears the data path down; the stuck write can
    // never be proven over (bound: runtime::QUIESCE_BOUND, 5 s).
    a.node
        .agent
        .invalidate_remote_md(b.name())
        .unwrap_or_else(|e| panic!("invalidate: {e:?}"));
    let dt = wait_for(
        Duration::from_secs(20),
        || "the arena with a stuck write was not reported poisoned".into(),
        || {
            nixl_bounce::stats::plugin_poisoned()
                .unwrap_or_default()
                .iter()
                .any(ours)
        },
    );
    let (outcome, _) = terminal_within(&a.node, &req, Duration::from_secs(5), "the stuck request");
    drop(req);
    let report = nixl_bounce::stats::plugin_poisoned().or_fail("poison report");
    let mine: Vec<_> = report.iter().filter(|r| ours(r)).collect();
    let sa = stats(a.name());
    eprintln!(
        "poisoned {dt:?} after the peer was forgotten; request: {outcome:?}; report: {mine:?}; stats: {:?}",
        sa.poisoned
    );
    assert!(
        outcome.is_err(),
        "a request whose write never ended succeeded"
    );
    assert_eq!(mine.len(), 1, "one record per poisoned arena: {report:?}");
    assert!(mine[0].reason.contains("never"), "the reason: {mine:?}");
    assert!(
        sa.poisoned.is_some(),
        "the engine's stats do not say it is poisoned"
    );
    assert!(dt < Duration::from_secs(10), "poisoned only after {dt:?}");
    // Nothing outside the destinations changed at the receiver.
    outside_destinations_unchanged(b.buf.as_slice(), &b_before, &plan).or_fail("receiver");

    load(&a.node, &b.node);
    write_falls_back_poisoned(&mut a, &b, "WRITE from a poisoned agent");

    // The receiver gets its regions back once it forgets the sender whose
    // write may still land (its flow was quarantined or still held).
    b.node
        .agent
        .invalidate_remote_md(a.name())
        .unwrap_or_else(|e| panic!("invalidate: {e:?}"));
    wait_arena_idle(b.name(), ARENA, Duration::from_secs(10));
    assert!(stats(b.name()).poisoned.is_none());
    a.buf.fill_pattern(0);
}

/// A panic on an instance's IO thread (a bug) is contained: the request
/// fails at once instead of hanging, the arena is poisoned and reported
/// (so it is leaked, never freed under copies or writes that may still
/// run), later transfers take UCX byte-exact, and the process lives on.
#[test]
#[serial_test::serial]
fn a_panic_on_the_io_thread_fails_requests_and_poisons_the_arena() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = with_failpoints("panic_in_io_thread", || {
        endpoint("pp-a", &EX, len(), 1, ThreadSync::Default)
    });
    let b = endpoint("pp-b", &EX, len(), 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(MANY, BLOCK, 3);
    let b_before = b.buf.as_slice().to_vec();
    let req = write_request(&a, &b, &plan);
    post(&a.node, &req).or_fail("post");
    let (outcome, dt) = terminal_within(&a.node, &req, Duration::from_secs(5), "the request");
    drop(req);
    assert!(outcome.is_err(), "a request whose IO thread died succeeded");
    let report = nixl_bounce::stats::plugin_poisoned().or_fail("poison report");
    let mine: Vec<_> = report
        .iter()
        .filter(|r| r.arena.starts_with(a.name()))
        .collect();
    eprintln!("request failed after {dt:?}; report: {mine:?}");
    assert_eq!(mine.len(), 1, "{report:?}");
    assert!(mine[0].reason.contains("panicked"), "{mine:?}");
    outside_destinations_unchanged(b.buf.as_slice(), &b_before, &plan).or_fail("receiver");

    write_falls_back_poisoned(&mut a, &b, "WRITE after the IO thread died");
}

#[test]
#[serial_test::serial]
fn a_peer_without_the_cancel_capability_is_served_through_ucx() {
    if !ready("BOUNCE") {
        return;
    }
    let mut old = with_failpoints("no_cancel_capability", || {
        endpoint("nc-old", &EX, len(), 1, ThreadSync::Default)
    });
    let mut a = endpoint("nc-a", &EX, len(), 2, ThreadSync::Default);
    let s0 = stats(a.name());
    pair_up(&a.node, &old.node);
    let s1 = stats(a.name());
    assert!(
        s1.since(&s0, "peer_incompatible_no_cancel") >= 1,
        "the missing capability was not noticed: {}",
        s1.diff(&s0)
    );
    let plan = Plan::standard(MANY, BLOCK, 6);
    a.buf.fill_pattern(7);
    let (src, dst_before) = (a.buf.as_slice().to_vec(), old.buf.as_slice().to_vec());
    let req = write_request(&a, &old, &plan);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE to a peer without CANCEL");
    drop(req);
    plan.verify(old.buf.as_slice(), &dst_before, &src)
        .or_fail("WRITE to a peer without CANCEL");
    let s2 = stats(a.name());
    assert_fell_back(&s1, &s2, 1, "fallback_peer_not_bounce_capable");
    assert_eq!(s2.since(&s1, "bounce_submitted"), 0);

    // The other way round is byte-exact too (whichever path it takes).
    let plan = Plan::standard(MANY, BLOCK, 8);
    old.buf.fill_pattern(9);
    let (src, dst_before) = (old.buf.as_slice().to_vec(), a.buf.as_slice().to_vec());
    let req = write_request(&old, &a, &plan);
    old.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE from a peer without CANCEL");
    drop(req);
    plan.verify(a.buf.as_slice(), &dst_before, &src)
        .or_fail("WRITE from a peer without CANCEL");
}
