//! A receiver that shuts down, or forgets a sender, while that sender's
//! flows are live must tell it (REFUSE, a protocol message made for this),
//! so that the sender's request ends at once instead of waiting for
//! `request_timeout_ms` (30 s by default).
//!
//! - With a fake sender (not a NIXL agent) that the receiver never paired with
//!   (holding granted credits it never uses, so no DATA races the
//!   shutdown), REFUSE(ShuttingDown) arrives.
//! - Found (fixed since in fc89f4d, the tests now pass): when the receiver forgets a sender whose
//!   metadata it had loaded (`invalidate_remote_md`, which NIXL also does
//!   for every peer when the receiving agent is destroyed),
//!   `Engine::disconnect` -> `Runtime::forget_peer` -> `Receiver::forget_peer`
//!   -> `CreditScheduler::reclaim_peer` drops the sender's live flows
//!   silently: no REFUSE is sent (and the reactor removes the peer's control
//!   handle first, so none could be), the sender's DATA are then dropped as
//!   late and its request hangs until `request_timeout_ms`. On agent
//!   destruction this runs before the engine's shutdown, so the
//!   REFUSE(ShuttingDown) of `Endpoint::shutdown` finds no flow left.
//! - Found (fixed since: peer liveness): a bounce WRITE to a receiver that
//!   is gone before the WANT reaches it was never answered; the sender
//!   waited `request_timeout_ms` for a GRANT, where the UCX path fails at
//!   once. The ZMQ channel now tracks each peer's connection (socket
//!   monitor + ZMTP heartbeats); a peer without one for
//!   `peer_liveness_timeout_ms` (1 s) is unreachable and its requests fail.
mod support;

use bounce::*;
use fake_sender::*;
use nixl_bounce::proto::wire::{Message, RefuseReason};
use nixl_sys::{ThreadSync, XferOp};
use std::time::{Duration, Instant};
use support::*;

#[test]
#[serial_test::serial]
fn receiver_shutdown_refuses_live_flows_of_unpaired_senders() {
    if !ready("BOUNCE") {
        return;
    }
    let mut lost = 0;
    for round in 0..3 {
        let r = endpoint("sd-rx", &[LOOPBACK], 1 << 20, round, ThreadSync::Default);
        let hs = handshake_of(&r.node.local_md().or_fail("md"));
        let fake = {
            let mut f = FakeSender::new(
                &String::from_utf8(hs.endpoint).unwrap(),
                hs.access_key,
                hs.control,
            );
            // Two live flows, each holding a credit it never uses.
            let a = f.want(4096).0;
            let b = f.want(4096).0;
            (f, [a, b])
        };
        let (f, flows) = fake;
        let t0 = Instant::now();
        drop(r); // destroys the agent and its BOUNCE engine
        let dropped_in = t0.elapsed();
        let mut refused = Vec::new();
        while refused.len() < 2 {
            match f.quiet_for(Duration::from_secs(2)) {
                Some(Message::Refuse { request, reason }) => {
                    assert_eq!(reason, RefuseReason::ShuttingDown, "round {round}");
                    assert!(flows.contains(&request));
                    refused.push(request);
                }
                Some(other) => panic!("round {round}: unexpected {other:?}"),
                None => break,
            }
        }
        eprintln!("round {round}: receiver destroyed in {dropped_in:?}; REFUSE(ShuttingDown) received for {} of 2 live flows", refused.len());
        if refused.len() < 2 {
            lost += 1;
        }
    }
    assert_eq!(
        lost, 0,
        "in {lost} of 3 rounds the senders of live flows were not told that the receiver shut down"
    );
}

#[test]
#[serial_test::serial]
fn receiver_forgetting_a_sender_mid_transfer_tells_it() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [
        LOOPBACK,
        ("max_chunk_size_bytes", "256KiB"),
        ("arena_size_bytes", "1MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
        ("request_timeout_ms", "10000"),
    ];
    let len = blocks_for(4096) * BLOCK;
    let mut a = endpoint("sd-a", &ex, len, 1, ThreadSync::Default);
    let b = endpoint("sd-b", &ex, len, 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(4096, BLOCK, 30);
    a.buf.fill_pattern(33);
    let (src0, before0) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let req = write_request(&a, &b, &plan);
    post(&a.node, &req).or_fail("post");
    // Wait until the receiver has granted (the flow is live), then forget.
    let t0 = Instant::now();
    while stats(b.name()).since(&sb, "grants") == 0 {
        check_deadline(t0, Duration::from_secs(10), &|| "no grant".into());
        std::thread::sleep(Duration::from_micros(200));
    }
    b.node
        .agent
        .invalidate_remote_md(a.name())
        .unwrap_or_else(|e| panic!("invalidate_remote_md: {e:?}"));
    let t1 = Instant::now();
    let mut spins = 0u64;
    let outcome = loop {
        match poll(&a.node, &req) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        check_deadline(t1, Duration::from_secs(30), &|| {
            "transfer after the receiver forgot the sender".into()
        });
        pause(&mut spins);
    };
    let dt = t1.elapsed();
    drop(req);
    eprintln!(
        "after the receiver forgot the sender: {outcome:?} after {dt:?}; {} ; {}",
        stats(a.name()).diff(&sa),
        stats(b.name()).diff(&sb)
    );
    assert!(dt < Duration::from_secs(2), "the sender's request ended only after {dt:?} (its request timeout): it was never told its flow was dropped");
    if outcome.is_ok() {
        // Served to the end (forgetting the metadata need not end the
        // flow): then every byte must be there.
        plan.verify(b.buf.as_slice(), &before0, &src0)
            .or_fail("a transfer reported done after the receiver forgot the sender");
    }
    // Either way the pair works again once the receiver knows the sender.
    load(&b.node, &a.node);
    let plan = Plan::standard(4096, BLOCK, 31);
    a.buf.fill_pattern(32);
    let (src, before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let req = write_request(&a, &b, &plan);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE after re-pairing");
    plan.verify(b.buf.as_slice(), &before, &src)
        .or_fail("WRITE after re-pairing");
}

const EX_SMALL: [(&str, &str); 5] = [
    LOOPBACK,
    ("max_chunk_size_bytes", "256KiB"),
    ("arena_size_bytes", "1MiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
    ("request_timeout_ms", "10000"),
];

/// Poll `req` to its end; returns the outcome and how long it took.
fn finish(node: &Node, req: &nixl_sys::XferRequest) -> (Result<(), String>, Duration) {
    let t0 = Instant::now();
    let mut spins = 0u64;
    let r = loop {
        match poll(node, req) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        check_deadline(t0, Duration::from_secs(30), &|| {
            "a transfer to a destroyed receiver".into()
        });
        pause(&mut spins);
    };
    (r, t0.elapsed())
}

#[test]
#[serial_test::serial]
fn sender_fails_promptly_when_the_receiver_is_destroyed_mid_transfer() {
    if !ready("BOUNCE") {
        return;
    }
    // 1 MiB receiver arena, 256 KiB chunks: the transfer is still running
    // (the receiver has granted, so its flow is live) when the receiver
    // agent is destroyed; request_timeout_ms 10 s; promptly = < 2 s.
    let len = blocks_for(4096) * BLOCK;
    let a = endpoint("sd-a", &EX_SMALL, len, 1, ThreadSync::Default);
    for round in 0..3u64 {
        let b = endpoint("sd-b", &EX_SMALL, len, 2 + round, ThreadSync::Default);
        pair_up(&a.node, &b.node);
        let plan = Plan::standard(4096, BLOCK, 10 + round);
        let sb = stats(b.name());
        let req = write_request(&a, &b, &plan);
        post(&a.node, &req).or_fail("post");
        let t0 = Instant::now();
        while stats(b.name()).since(&sb, "grants") == 0 {
            check_deadline(t0, Duration::from_secs(10), &|| "no grant".into());
            std::thread::sleep(Duration::from_micros(200));
        }
        let bname = b.name().to_string();
        drop(b);
        let (outcome, dt) = finish(&a.node, &req);
        eprintln!("round {round}: {outcome:?} {dt:?} after the receiver was destroyed");
        drop(req);
        a.node.agent.invalidate_remote_md(&bname).ok();
        assert!(
            outcome.is_err(),
            "round {round}: the transfer succeeded although the receiver was destroyed mid-way"
        );
        assert!(dt < Duration::from_secs(2), "round {round}: the sender learned of the receiver's shutdown only after {dt:?} (its request timeout)");
    }
}

#[test]
#[serial_test::serial]
fn transfer_to_a_receiver_that_is_gone_fails_promptly() {
    if !ready("BOUNCE") {
        return;
    }
    // The receiver agent is destroyed after the metadata exchange and
    // before the transfer: the initiator still routes to the bounce path
    // (the peer passed the handshake) and its WANT goes nowhere.
    let len = blocks_for(4096) * BLOCK;
    let a = endpoint("sd-a", &EX_SMALL, len, 1, ThreadSync::Default);
    let b = endpoint("sd-b", &EX_SMALL, len, 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let (bname, baddr) = (b.name().to_string(), b.buf.addr());
    drop(b);
    std::thread::sleep(Duration::from_millis(100));
    // For comparison, the UCX path (too few descriptors for bounce).
    let ucx = Plan::standard(64, BLOCK, 3);
    let (ucx_outcome, ucx_dt) =
        match a
            .node
            .create_xfer(XferOp::Write, &ucx, a.buf.addr(), baddr, &bname, None)
        {
            Ok(req) => match post(&a.node, &req) {
                Ok(()) => finish(&a.node, &req),
                Err(e) => (Err(e), Duration::ZERO),
            },
            Err(e) => (Err(e), Duration::ZERO),
        };
    eprintln!("UCX path to the destroyed receiver: {ucx_outcome:?} after {ucx_dt:?}");
    let sa = stats(a.name());
    let plan = Plan::standard(4096, BLOCK, 4);
    let req = a
        .node
        .create_xfer(XferOp::Write, &plan, a.buf.addr(), baddr, &bname, None)
        .or_fail("create_xfer_req");
    post(&a.node, &req).or_fail("post");
    let (outcome, dt) = finish(&a.node, &req);
    let ea = stats(a.name());
    eprintln!(
        "bounce path to the destroyed receiver: {outcome:?} after {dt:?}; {}",
        ea.diff(&sa)
    );
    assert!(
        outcome.is_err(),
        "a transfer to a destroyed receiver succeeded"
    );
    assert_eq!(
        ea.since(&sa, "bounce_submitted"),
        1,
        "not routed to the bounce path: {}",
        ea.diff(&sa)
    );
    assert!(dt < Duration::from_secs(2), "the bounce WRITE to a receiver that is gone failed only after {dt:?} (request_timeout_ms); the UCX path took {ucx_dt:?}");
}
