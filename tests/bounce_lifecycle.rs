//! Lifecycles around bounce transfers, each byte-exact and counted:
//! - one prepared request posted again and again (new data each time);
//! - a request's routing and plan wait for its first post
//!   (`prepare_at_post`), are kept for its re-posts, and a request never
//!   posted costs nothing; with the setting off they are made in prepXfer;
//! - a request the engine hands to UCX at its first post keeps UCX's
//!   request for its re-posts;
//! - a first post from a region deregistered after createXferReq fails
//!   with a clear error and writes nothing;
//! - a request released while it runs (cancelled), then the pair still
//!   works;
//! - the peer's metadata invalidated and loaded again;
//! - the peer agent destroyed and re-created under the same name (new
//!   arena, new control endpoint): the initiator must use the new one;
//! - the peer destroyed while a transfer to it runs: the transfer fails
//!   within its timeout instead of hanging.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp, XferRequest};
use std::time::{Duration, Instant};
use support::*;

const MANY: usize = 4096;

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// One counted, byte-exact bounce WRITE a -> b with a fresh request.
fn write(a: &mut Endpoint, b: &mut Endpoint, seed: u64) {
    let plan = Plan::standard(MANY, BLOCK, seed);
    a.buf.fill_pattern(seed + 1);
    b.buf.fill_pattern(seed + 2);
    let (src, dst_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let req = write_request(a, b, &plan);
    a.node.post_and_wait(&req, wait_timeout()).or_fail("WRITE");
    drop(req);
    plan.verify(b.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    b.buf.check_guards().or_fail("guards");
    let (ea, eb) = (stats(a.name()), stats(b.name()));
    assert_sender_bounced(&sa, &ea, 1);
    assert_receiver_scattered(&sb, &eb, ea.since(&sa, "chunks_written"));
}

/// Posts the prepared `req` (a -> b, `plan`) once more with new source data
/// (`seed`) and waits for `notif` when it carries one: byte-exact against
/// `dst_before` outside the plan, one bounce transfer counted on each side.
#[allow(clippy::too_many_arguments)]
fn post_again(
    a: &mut Endpoint,
    b: &Endpoint,
    req: &XferRequest,
    plan: &Plan,
    dst_before: &[u8],
    seed: u64,
    notif: Option<&[u8]>,
    what: &str,
) {
    a.buf.fill_pattern(seed);
    let src = a.buf.as_slice().to_vec();
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    a.node
        .post_and_wait(req, wait_timeout())
        .or_fail(&format!("{what}: post"));
    if let Some(msg) = notif {
        b.node
            .wait_notif(a.name(), msg, wait_timeout())
            .or_fail(&format!("{what}: notification"));
    }
    plan.verify(b.buf.as_slice(), dst_before, &src)
        .or_fail(what);
    let (ea, eb) = (stats(a.name()), stats(b.name()));
    assert_sender_bounced(&sa, &ea, 1);
    assert_receiver_scattered(&sb, &eb, ea.since(&sa, "chunks_written"));
}

#[test]
#[serial_test::serial]
fn repost_the_same_request() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = endpoint("lc-a", &[LOOPBACK], len(), 1, ThreadSync::Default);
    let mut b = endpoint("lc-b", &[LOOPBACK], len(), 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(MANY, BLOCK, 3);
    b.buf.fill_pattern(4);
    let dst_before = b.buf.as_slice().to_vec();
    let req = a
        .node
        .create_xfer(
            XferOp::Write,
            &plan,
            a.buf.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            Some(b"lc-repost"),
        )
        .or_fail("create_xfer_req");
    for i in 0..3u64 {
        let what = format!("repost #{i}");
        post_again(
            &mut a,
            &b,
            &req,
            &plan,
            &dst_before,
            10 + i,
            Some(b"lc-repost"),
            &what,
        );
    }
}

/// With `prepare_at_post` (the default) NIXL's createXferReq costs the
/// engine nothing per descriptor: the request is routed and planned at its
/// first post, once, and a re-post uses that plan; a request released
/// unposted was never prepared. Off, the preparation is createXferReq's.
#[test]
#[serial_test::serial]
fn preparation_waits_for_the_first_post() {
    if !ready("BOUNCE") {
        return;
    }
    for at_post in [true, false] {
        let ex = [
            LOOPBACK,
            ("prepare_at_post", if at_post { "true" } else { "false" }),
        ];
        let mut a = endpoint("lc-a", &ex, len(), 11, ThreadSync::Default);
        let mut b = endpoint("lc-b", &ex, len(), 12, ThreadSync::Default);
        pair_up(&a.node, &b.node);
        let plan = Plan::standard(MANY, BLOCK, 13);
        let prepared =
            |e: &Endpoint, before: &Counters| stats(e.name()).since(before, "transfers_prepared");

        // A malformed custom parameter needs no descriptor: refused by
        // createXferReq whichever the setting.
        let mut opt = a.node.opt_args(None).or_fail("opt");
        opt.set_custom_param(b"deadline_ms=soon")
            .expect("custom param");
        let l = xfer_list(a.buf.addr(), &plan.src, plan.block).unwrap();
        let r = xfer_list(b.buf.addr(), &plan.dst, plan.block).unwrap();
        let refused =
            a.node
                .agent
                .create_xfer_req(XferOp::Write, &l, &r, &b.node.name.clone(), Some(&opt));
        assert!(
            refused.is_err(),
            "at_post={at_post}: a malformed custom parameter was accepted"
        );

        // Released without a post.
        let sa = stats(a.name());
        drop(write_request(&a, &b, &plan));
        assert_eq!(
            prepared(&a, &sa),
            u64::from(!at_post),
            "at_post={at_post}: an unposted request"
        );

        let sa = stats(a.name());
        let req = write_request(&a, &b, &plan);
        assert_eq!(
            prepared(&a, &sa),
            u64::from(!at_post),
            "at_post={at_post}: after createXferReq"
        );
        b.buf.fill_pattern(14);
        let dst_before = b.buf.as_slice().to_vec();
        for i in 0..2u64 {
            let what = format!("at_post={at_post}: post #{i}");
            post_again(&mut a, &b, &req, &plan, &dst_before, 15 + i, None, &what);
        }
        assert_eq!(
            prepared(&a, &sa),
            1,
            "at_post={at_post}: prepared once for two posts"
        );
        drop(req);
        write(&mut b, &mut a, 17);
    }
}

/// A request the engine hands to the UCX delegate at its first post (the
/// peer has bounce off) keeps the delegate's request for its re-posts:
/// routed (and counted) once, every post byte-exact through UCX.
#[test]
#[serial_test::serial]
fn a_ucx_route_chosen_at_the_first_post_is_kept() {
    if !ready("BOUNCE") {
        return;
    }
    for at_post in [true, false] {
        let setting = ("prepare_at_post", if at_post { "true" } else { "false" });
        let a = endpoint("lc-a", &[LOOPBACK, setting], len(), 21, ThreadSync::Default);
        let mut b = endpoint(
            "lc-b",
            &[LOOPBACK, setting, ("enable", "false")],
            len(),
            22,
            ThreadSync::Default,
        );
        pair_up(&a.node, &b.node);
        let plan = Plan::standard(MANY, BLOCK, 23);
        let sa = stats(a.name());
        let req = write_request(&a, &b, &plan);
        let routed = |e: &Endpoint, before: &Counters| {
            stats(e.name()).since(before, "fallback_peer_not_bounce_capable")
        };
        assert_eq!(
            routed(&a, &sa),
            u64::from(!at_post),
            "at_post={at_post}: routed by createXferReq"
        );
        b.buf.fill_pattern(24);
        let dst_before = b.buf.as_slice().to_vec();
        let mut a = a;
        for i in 0..3u64 {
            a.buf.fill_pattern(25 + i);
            let src = a.buf.as_slice().to_vec();
            a.node
                .post_and_wait(&req, wait_timeout())
                .or_fail(&format!("at_post={at_post}: post #{i}"));
            plan.verify(b.buf.as_slice(), &dst_before, &src)
                .or_fail(&format!("at_post={at_post}: post #{i}"));
        }
        let ea = stats(a.name());
        assert_fell_back(&sa, &ea, 1, "fallback_peer_not_bounce_capable");
        drop(req);
        write_through_ucx_again(&a, &mut b);
    }
}

/// After the delegate's request is released, a new one still works.
fn write_through_ucx_again(a: &Endpoint, b: &mut Endpoint) {
    let plan = Plan::standard(MANY, BLOCK, 29);
    b.buf.fill_pattern(30);
    let dst_before = b.buf.as_slice().to_vec();
    let req = write_request(a, b, &plan);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("a new request after the release");
    plan.verify(b.buf.as_slice(), &dst_before, a.buf.as_slice())
        .or_fail("a new request after the release");
}

/// A request whose source region is deregistered between createXferReq
/// and its first post (a user error NIXL does not catch): the post fails
/// with an error that names the unregistered region, nothing is written,
/// the request releases cleanly, and the pair keeps working.
#[test]
#[serial_test::serial]
fn a_first_post_after_the_region_is_deregistered_fails_cleanly() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = endpoint("lc-a", &[LOOPBACK], len(), 31, ThreadSync::Default);
    let mut b = endpoint("lc-b", &[LOOPBACK], len(), 32, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let other = DramBuffer::with_pattern(len(), 33);
    let reg = a.node.register(&other).or_fail("register a second source");
    let plan = Plan::standard(MANY, BLOCK, 34);
    let req = a
        .node
        .create_xfer(
            XferOp::Write,
            &plan,
            other.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            None,
        )
        .or_fail("create_xfer_req");
    drop(reg);
    let dst_before = b.buf.as_slice().to_vec();
    let sa = stats(a.name());
    let err = a
        .node
        .post_and_wait(&req, wait_timeout())
        .expect_err("a post from a deregistered region succeeded");
    eprintln!("the post failed as it should: {err}");
    let ea = stats(a.name());
    assert_eq!(ea.since(&sa, "bounce_submitted"), 0, "{}", ea.diff(&sa));
    assert_eq!(b.buf.as_slice(), &dst_before[..], "the destination changed");
    drop(req);
    write(&mut a, &mut b, 35);
    write(&mut b, &mut a, 36);
}

#[test]
#[serial_test::serial]
fn release_while_running_then_keep_going() {
    if !ready("BOUNCE") {
        return;
    }
    // Small chunks so the request is still running when released.
    let ex = [
        LOOPBACK,
        ("max_chunk_size_bytes", "64KiB"),
        ("arena_size_bytes", "4MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
    ];
    let mut a = endpoint("lc-a", &ex, len(), 5, ThreadSync::Default);
    let mut b = endpoint("lc-b", &ex, len(), 6, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    for i in 0..3u64 {
        let plan = Plan::standard(MANY, BLOCK, 20 + i);
        let sa = stats(a.name());
        let req = write_request(&a, &b, &plan);
        post(&a.node, &req).or_fail("post");
        std::thread::sleep(Duration::from_millis(5 * i));
        let t0 = Instant::now();
        drop(req); // release while (probably) running: must return at once
        let dt = t0.elapsed();
        assert!(
            dt < Duration::from_secs(1),
            "releasing a running bounce request took {dt:?}"
        );
        let ea = stats(a.name());
        eprintln!(
            "release #{i} after {} ms: took {dt:?}; {}",
            5 * i,
            ea.diff(&sa)
        );
        assert_eq!(ea.since(&sa, "bounce_submitted"), 1);
    }
    // Let cancellations settle, then the pair still moves data both ways.
    std::thread::sleep(Duration::from_millis(200));
    write(&mut a, &mut b, 30);
    write(&mut b, &mut a, 40);
    assert!(stats(a.name()).poisoned.is_none() && stats(b.name()).poisoned.is_none());
}

#[test]
#[serial_test::serial]
fn metadata_invalidated_and_loaded_again() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = endpoint("lc-a", &[LOOPBACK], len(), 7, ThreadSync::Default);
    let mut b = endpoint("lc-b", &[LOOPBACK], len(), 8, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    write(&mut a, &mut b, 50);
    for i in 0..2u64 {
        a.node
            .agent
            .invalidate_remote_md(b.name())
            .unwrap_or_else(|e| panic!("invalidate_remote_md: {e:?}"));
        b.node
            .agent
            .invalidate_remote_md(a.name())
            .unwrap_or_else(|e| panic!("invalidate_remote_md: {e:?}"));
        pair_up(&a.node, &b.node);
        write(&mut a, &mut b, 60 + 10 * i);
        write(&mut b, &mut a, 65 + 10 * i);
    }
}

#[test]
#[serial_test::serial]
fn peer_recreated_under_the_same_name() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = endpoint("lc-a", &[LOOPBACK], len(), 9, ThreadSync::Default);
    let name = unique_name("lc-b");
    let make_b = |seed: u64| -> Endpoint {
        let node = node_with(&name, &[LOOPBACK], ThreadSync::Default).or_fail("create b");
        let buf = DramBuffer::with_pattern(len(), seed);
        let reg = node.register(&buf).or_fail("register");
        Endpoint {
            reg: Some(reg),
            buf,
            node,
        }
    };
    let mut b = make_b(10);
    pair_up(&a.node, &b.node);
    write(&mut a, &mut b, 80);
    write(&mut b, &mut a, 85);
    for i in 0..2u64 {
        let old = handshake_of(&b.node.local_md().or_fail("md"));
        // The peer goes away; a new incarnation with the same name comes.
        a.node
            .agent
            .invalidate_remote_md(&name)
            .unwrap_or_else(|e| panic!("invalidate_remote_md: {e:?}"));
        drop(b);
        b = make_b(11 + i);
        let new = handshake_of(&b.node.local_md().or_fail("md"));
        eprintln!(
            "incarnation {}: control {:?} -> {:?}",
            i + 1,
            String::from_utf8_lossy(&old.endpoint),
            String::from_utf8_lossy(&new.endpoint)
        );
        pair_up(&a.node, &b.node);
        write(&mut a, &mut b, 90 + 10 * i);
        write(&mut b, &mut a, 95 + 10 * i);
    }
}

#[test]
#[serial_test::serial]
fn peer_destroyed_mid_transfer_fails_in_bounded_time() {
    if !ready("BOUNCE") {
        return;
    }
    // 64 chunks of 256 KiB through a 1 MiB receiver arena: still running
    // when the receiver goes away. request_timeout_ms bounds the wait.
    let ex = [
        LOOPBACK,
        ("max_chunk_size_bytes", "256KiB"),
        ("arena_size_bytes", "1MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
        ("request_timeout_ms", "2000"),
    ];
    let mut a = endpoint("lc-a", &ex, len(), 13, ThreadSync::Default);
    let b = endpoint("lc-b", &ex, len(), 14, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(MANY, BLOCK, 110);
    let sa = stats(a.name());
    let req = write_request(&a, &b, &plan);
    post(&a.node, &req).or_fail("post");
    std::thread::sleep(Duration::from_millis(10));
    let bname = b.name().to_string();
    drop(b);
    let t0 = Instant::now();
    let mut spins = 0u64;
    let outcome = loop {
        match poll(&a.node, &req) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        if t0.elapsed() > Duration::from_secs(20) {
            panic!("the transfer to a destroyed peer is still running after 20 s (request_timeout_ms is 2 s)");
        }
        pause(&mut spins);
    };
    let ea = stats(a.name());
    eprintln!("after {:?}: {outcome:?}; {}", t0.elapsed(), ea.diff(&sa));
    drop(req);
    // Success is possible only if everything had landed before the peer
    // went; either way the initiator is usable again with a new peer.
    a.node.agent.invalidate_remote_md(&bname).ok();
    let mut c = endpoint("lc-c", &ex, len(), 15, ThreadSync::Default);
    pair_up(&a.node, &c.node);
    write(&mut a, &mut c, 120);
    assert!(
        stats(a.name()).poisoned.is_none(),
        "initiator poisoned: {:?}",
        stats(a.name()).poisoned
    );
}
