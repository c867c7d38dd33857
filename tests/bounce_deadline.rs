//! Per-request deadlines: a bounce transfer carries `deadline_ms` in NIXL's
//! backend custom parameter; past it the request fails with a distinct
//! error, long before the no-progress timeout, and the engine stays usable.

mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::time::{Duration, Instant};
use support::*;

#[test]
#[serial_test::serial]
fn a_transfer_past_its_deadline_fails_promptly_and_the_engine_recovers() {
    if !ready("BOUNCE") {
        return;
    }
    let len = blocks_for(4096) * BLOCK;
    // The receiver drops every control message it sends, so the sender gets
    // no GRANT: without a deadline it would wait request_timeout_ms (30 s).
    std::env::set_var("NIXL_BOUNCE_FAILPOINTS", "drop_control");
    let mute = endpoint("dl-mute", &[LOOPBACK], len, 2, ThreadSync::Default);
    std::env::remove_var("NIXL_BOUNCE_FAILPOINTS");
    let a = endpoint("dl-a", &[LOOPBACK], len, 1, ThreadSync::Default);
    pair_up(&a.node, &mute.node);

    let plan = Plan::standard(4096, BLOCK, 31);
    let before = stats(a.name());
    let mut opt = a.node.opt_args(None).or_fail("opt");
    opt.set_custom_param(b"deadline_ms=300")
        .expect("custom param");
    let l = xfer_list(a.buf.addr(), &plan.src, plan.block).unwrap();
    let r = xfer_list(mute.buf.addr(), &plan.dst, plan.block).unwrap();
    let req = a
        .node
        .agent
        .create_xfer_req(XferOp::Write, &l, &r, &mute.node.name.clone(), Some(&opt))
        .expect("create");
    let t0 = Instant::now();
    a.node.agent.post_xfer_req(&req, Some(&opt)).expect("post");
    let outcome = loop {
        match poll(&a.node, &req) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no outcome 10 s after a 300 ms deadline"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let took = t0.elapsed();
    let after = stats(a.name());
    eprintln!(
        "outcome after {took:?}: {outcome:?}; {}",
        after.diff(&before)
    );
    assert!(
        outcome.is_err(),
        "a transfer that got no GRANT cannot succeed"
    );
    assert!(
        took >= Duration::from_millis(250),
        "failed before its deadline ({took:?})"
    );
    assert!(
        took < Duration::from_secs(3),
        "the deadline did not cut the wait short ({took:?})"
    );
    assert_eq!(
        after.since(&before, "bounce_deadlines_exceeded"),
        1,
        "{}",
        after.diff(&before)
    );
    assert_eq!(
        after.since(&before, "bounce_timeouts"),
        0,
        "a deadline is not a no-progress timeout"
    );
    drop(req);

    // The initiator's engine still works with a healthy peer.
    let b = endpoint("dl-b", &[LOOPBACK], len, 3, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let plan = Plan::standard(4096, BLOCK, 32);
    let req = a
        .node
        .create_xfer(
            XferOp::Write,
            &plan,
            a.buf.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            None,
        )
        .or_fail("create");
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("a transfer after the deadline failure");
}
