//! A peer that cannot take the bounce path is served through UCX at once:
//! no error, no wait for a timeout. Each case moves 4096 scattered 4 KiB
//! blocks (bounce-eligible by size) byte-exact, in both directions, checks
//! it completed well under a second or two (the request timeout is 30 s),
//! and that the counters name the fallback (and that the bounce path was
//! not used):
//! - (a) the peer has `enable=false` (no handshake at all);
//! - (b) the peers differ in `max_chunk_size_bytes`;
//! - (c) the peers differ in control kind (one uses NIXL notifications);
//! - (d) the peer speaks another wire version (its published handshake
//!   patched to the next version).
//!
//! Plus the routing gates at their edges (descriptor count, average size,
//! also for a READ) between two compatible peers, and an engine whose
//! bounce set-up failed (its control socket cannot bind) working through
//! UCX. (A peer without the READ capability: tests/bounce_read_one_process.rs.)
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::time::Duration;
use support::*;

const MANY: usize = 4096;
/// Far below `request_timeout_ms` (30 s by default, 60 s set here).
const QUICK: Duration = Duration::from_secs(2);
const TIMEOUT: (&str, &str) = ("request_timeout_ms", "60000");

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// `op` of `n` x `block` between `a` (initiator) and `b`; byte-exact;
/// returns the time from preparing the request to its completion.
fn write(
    a: &mut Endpoint,
    b: &mut Endpoint,
    op: XferOp,
    n: usize,
    block: usize,
    plan_seed: u64,
    seeds: (u64, u64),
) -> Duration {
    let blocks = a.buf.len().min(b.buf.len()) / block;
    let plan = Plan::scattered(n, block, blocks, blocks, plan_seed);
    a.buf.fill_pattern(seeds.0);
    b.buf.fill_pattern(seeds.1);
    let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    // Timed from before the request is prepared (the route is chosen there).
    let t0 = std::time::Instant::now();
    let req = a
        .node
        .create_xfer(
            op,
            &plan,
            a.buf.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            None,
        )
        .or_fail("create_xfer_req");
    a.node.post_and_wait(&req, wait_timeout()).or_fail(&format!(
        "{op:?} {} -> {}",
        a.name(),
        b.name()
    ));
    let dt = t0.elapsed();
    drop(req);
    match op {
        XferOp::Write => plan
            .verify(b.buf.as_slice(), &b_before, &a_before)
            .or_fail("WRITE destination"),
        XferOp::Read => plan
            .verify(a.buf.as_slice(), &a_before, &b_before)
            .or_fail("READ destination"),
    }
    a.buf.check_guards().or_fail("guards");
    b.buf.check_guards().or_fail("guards");
    dt
}

/// Both directions between `a_extra` and `b_extra` peers fall back, quickly.
fn mismatched(
    a_extra: &[(&str, &str)],
    b_extra: &[(&str, &str)],
    a_reason: &str,
    b_reason: &str,
    seed: u64,
) {
    let mut a = endpoint("fb-a", a_extra, len(), seed, ThreadSync::Default);
    let mut b = endpoint("fb-b", b_extra, len(), seed + 1, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    for round in 0..2u64 {
        let s = seed * 100 + round * 10;
        let (sa, sb) = (stats(a.name()), stats(b.name()));
        let dt = write(
            &mut a,
            &mut b,
            XferOp::Write,
            MANY,
            BLOCK,
            s,
            (s + 1, s + 2),
        );
        let ea = stats(a.name());
        eprintln!("{} -> {}: {dt:?}; {}", a.name(), b.name(), ea.diff(&sa));
        assert!(
            dt < QUICK,
            "the fallback WRITE took {dt:?} (>= {QUICK:?}): was it waiting for the bounce path?"
        );
        assert_fell_back(&sa, &ea, 1, a_reason);
        let eb = stats(b.name());
        assert_eq!(eb.since(&sb, "chunks_scattered"), 0, "{}", eb.diff(&sb));
        assert_eq!(eb.since(&sb, "grants"), 0, "{}", eb.diff(&sb));

        let (sa, sb) = (stats(a.name()), stats(b.name()));
        let dt = write(
            &mut b,
            &mut a,
            XferOp::Write,
            MANY,
            BLOCK,
            s + 5,
            (s + 6, s + 7),
        );
        let eb = stats(b.name());
        eprintln!("{} -> {}: {dt:?}; {}", b.name(), a.name(), eb.diff(&sb));
        assert!(dt < QUICK, "the fallback WRITE took {dt:?} (>= {QUICK:?})");
        assert_fell_back(&sb, &eb, 1, b_reason);
        let ea = stats(a.name());
        assert_eq!(ea.since(&sa, "chunks_scattered"), 0, "{}", ea.diff(&sa));
    }
}

#[test]
#[serial_test::serial]
fn peer_with_bounce_disabled_falls_back_at_once() {
    if !ready("BOUNCE") {
        return;
    }
    mismatched(
        &[LOOPBACK, TIMEOUT],
        &[LOOPBACK, TIMEOUT, ("enable", "false")],
        "fallback_peer_not_bounce_capable",
        // The disabled side routes nothing through bounce, whatever the peer.
        "fallback_bounce_disabled",
        1,
    );
}

#[test]
#[serial_test::serial]
fn peer_with_other_chunk_size_falls_back_at_once() {
    if !ready("BOUNCE") {
        return;
    }
    mismatched(
        &[LOOPBACK, TIMEOUT, ("max_chunk_size_bytes", "32MiB")],
        &[LOOPBACK, TIMEOUT, ("max_chunk_size_bytes", "16MiB")],
        "fallback_peer_not_bounce_capable",
        "fallback_peer_not_bounce_capable",
        2,
    );
}

#[test]
#[serial_test::serial]
fn peer_with_other_control_kind_falls_back_at_once() {
    if !ready("BOUNCE") {
        return;
    }
    mismatched(
        &[LOOPBACK, TIMEOUT],
        &[TIMEOUT, NOTIF_CONTROL],
        "fallback_peer_not_bounce_capable",
        "fallback_peer_not_bounce_capable",
        3,
    );
}

#[test]
#[serial_test::serial]
fn peer_with_zmq_against_direct_tcp_falls_back_at_once() {
    if !ready("BOUNCE") {
        return;
    }
    mismatched(
        &[LOOPBACK, TIMEOUT],
        &[LOOPBACK, TIMEOUT, ZMQ_CONTROL],
        "fallback_peer_not_bounce_capable",
        "fallback_peer_not_bounce_capable",
        5,
    );
}

#[test]
#[serial_test::serial]
fn routing_gates_at_their_edges() {
    if !ready("BOUNCE") {
        return;
    }
    // Buffers big enough for 1024 x 32 KiB.
    let l = 1300 * 32 * KIB;
    let mut a = endpoint("rg-a", &[LOOPBACK], l, 1, ThreadSync::Default);
    let mut b = endpoint("rg-b", &[LOOPBACK], l, 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let cases: [(&str, XferOp, usize, usize, Option<&str>); 7] = [
        (
            "1023 x 4 KiB (one below min_descriptor_count)",
            XferOp::Write,
            1023,
            BLOCK,
            Some("fallback_too_few_descriptors"),
        ),
        (
            "1024 x 4 KiB (exactly min_descriptor_count)",
            XferOp::Write,
            1024,
            BLOCK,
            None,
        ),
        (
            "1024 x 8 KiB (exactly the average-size limit)",
            XferOp::Write,
            1024,
            8 * KIB,
            None,
        ),
        (
            "1024 x 8 KiB + 1 byte",
            XferOp::Write,
            1024,
            8 * KIB + 1,
            Some("fallback_descriptors_too_large"),
        ),
        (
            "1024 x 32 KiB",
            XferOp::Write,
            1024,
            32 * KIB,
            Some("fallback_descriptors_too_large"),
        ),
        (
            "READ 1023 x 4 KiB",
            XferOp::Read,
            1023,
            BLOCK,
            Some("fallback_too_few_descriptors"),
        ),
        (
            "READ 1024 x 32 KiB",
            XferOp::Read,
            1024,
            32 * KIB,
            Some("fallback_descriptors_too_large"),
        ),
    ];
    for (i, (what, op, n, block, reason)) in cases.into_iter().enumerate() {
        let s = 10 * i as u64;
        let (sa, sb) = (stats(a.name()), stats(b.name()));
        let dt = write(&mut a, &mut b, op, n, block, s, (s + 1, s + 2));
        let (ea, eb) = (stats(a.name()), stats(b.name()));
        eprintln!("{what}: {dt:?}; {} ; {}", ea.diff(&sa), eb.diff(&sb));
        match reason {
            Some(r) => assert_fell_back(&sa, &ea, 1, r),
            None => {
                assert_sender_bounced(&sa, &ea, 1);
                assert_receiver_scattered(&sb, &eb, ea.since(&sa, "chunks_written"));
            }
        }
    }
}

#[test]
#[serial_test::serial]
fn bounce_setup_failure_keeps_the_agent_working_through_ucx() {
    if !ready("BOUNCE") {
        return;
    }
    // The control socket cannot bind (no such interface): the engine must
    // still be created, publish no bounce path and move data through UCX.
    let broken = [("control_interface", "nbb-no-such0"), TIMEOUT];
    let mut a = endpoint("fb-broken", &broken, len(), 31, ThreadSync::Default);
    let mut b = endpoint(
        "fb-ok",
        &[LOOPBACK, TIMEOUT],
        len(),
        32,
        ThreadSync::Default,
    );
    pair_up(&a.node, &b.node);
    let md = a.node.local_md().or_fail("md");
    let offered = try_handshake_of(&md);
    eprintln!("handshake of the engine whose control socket could not bind: {offered:?}");
    assert!(
        offered.is_err(),
        "an engine whose control socket could not bind still offers a bounce path"
    );
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let dt = write(&mut a, &mut b, XferOp::Write, MANY, BLOCK, 33, (34, 35));
    let ea = stats(a.name());
    eprintln!("{} -> {}: {dt:?}; {}", a.name(), b.name(), ea.diff(&sa));
    assert!(dt < QUICK, "took {dt:?}");
    // The reason is named after where the set-up failed (the engine's, or
    // the arena of the memory's location).
    assert_fell_back_any(
        &sa,
        &ea,
        1,
        &["fallback_bounce_disabled", "fallback_no_local_arena"],
    );
    let dt = write(&mut b, &mut a, XferOp::Write, MANY, BLOCK, 36, (37, 38));
    let eb = stats(b.name());
    eprintln!("{} -> {}: {dt:?}; {}", b.name(), a.name(), eb.diff(&sb));
    assert!(dt < QUICK, "took {dt:?}");
    assert_fell_back(&sb, &eb, 1, "fallback_peer_not_bounce_capable");
}

#[test]
#[serial_test::serial]
fn peer_with_other_wire_version_falls_back_at_once() {
    if !ready("BOUNCE") {
        return;
    }
    use nixl_bounce::proto::wire::{HANDSHAKE_MAGIC, WIRE_VERSION};
    // The initiator loads the target's metadata with the wire version in
    // every bounce handshake it carries patched to the next version (as a
    // newer plugin would publish it); everything else is untouched.
    let mut a = endpoint("fb-a", &[LOOPBACK, TIMEOUT], len(), 41, ThreadSync::Default);
    let mut b = endpoint("fb-b", &[LOOPBACK, TIMEOUT], len(), 42, ThreadSync::Default);
    let mut md = b.node.local_md().or_fail("md");
    let mut patched = 0;
    let at: Vec<usize> = md
        .windows(4)
        .enumerate()
        .filter(|(_, w)| *w == HANDSHAKE_MAGIC)
        .map(|(i, _)| i)
        .collect();
    for i in at {
        if md.get(i + 6..i + 8) == Some(&WIRE_VERSION.to_le_bytes()[..]) {
            md[i + 6..i + 8].copy_from_slice(&(WIRE_VERSION + 1).to_le_bytes());
            patched += 1;
        }
    }
    assert!(
        patched > 0,
        "no bounce handshake found in the target's metadata"
    );
    assert_eq!(
        a.node.load_md(&md).or_fail("load the patched metadata"),
        b.name()
    );
    load(&b.node, &a.node);
    let sa = stats(a.name());
    let dt = write(&mut a, &mut b, XferOp::Write, MANY, BLOCK, 43, (44, 45));
    let ea = stats(a.name());
    eprintln!(
        "{patched} handshake(s) patched to wire version {}; {} -> {}: {dt:?}; {}",
        WIRE_VERSION + 1,
        a.name(),
        b.name(),
        ea.diff(&sa)
    );
    assert!(dt < QUICK, "took {dt:?}");
    assert_fell_back(&sa, &ea, 1, "fallback_peer_not_bounce_capable");
}
