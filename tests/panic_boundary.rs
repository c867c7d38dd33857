//! A panic inside the engine never crosses into NIXL (which would abort the
//! host process): it becomes an error status, and the engine then refuses
//! new work with an error while teardown (disconnect, deregistration,
//! release) still runs.

mod support;

use nixl_sys::XferOp;
use serial_test::serial;
use support::*;

#[test]
#[serial]
fn a_panic_becomes_an_error_and_disables_the_engine() {
    if !ready("BOUNCE") {
        return;
    }
    // Read once at engine creation; only the initiator gets the failpoint.
    std::env::set_var("NIXL_BOUNCE_FAILPOINTS", "panic_in_post_xfer");
    // Four descriptors take BOUNCE's own path only with the gate lowered
    // (below it the UCX delegate carries them and no Rust code posts).
    let init = Endpoint::new(
        "panic-init",
        "BOUNCE",
        &[("min_descriptor_count", "4")],
        1 << 16,
        1,
    );
    std::env::remove_var("NIXL_BOUNCE_FAILPOINTS");
    let init = init.or_fail("initiator");
    let target = Endpoint::new("panic-target", "BOUNCE", &[], 1 << 16, 2).or_fail("target");
    init.node
        .load_md(&target.node.local_md().or_fail("md"))
        .or_fail("load");

    let plan = Plan::standard(4, 4096, 3);
    let req = init
        .node
        .create_xfer(
            XferOp::Write,
            &plan,
            init.buf.addr(),
            target.buf.addr(),
            target.name(),
            None,
        )
        .or_fail("prepare");
    let posted = init.node.agent.post_xfer_req(&req, None);
    assert!(
        posted.is_err(),
        "a panicking postXfer must report an error, got {posted:?}"
    );

    // The engine is now disabled: further work is refused, the process
    // lives. So is a transfer below the route floor, which the shim would
    // otherwise hand to the UCX delegate without asking the engine.
    for n in [4, 1] {
        let again = init.node.create_xfer(
            XferOp::Write,
            &Plan::standard(n, 4096, 3),
            init.buf.addr(),
            target.buf.addr(),
            target.name(),
            None,
        );
        assert!(
            again.is_err(),
            "a disabled engine must refuse new transfers ({n} descriptors)"
        );
    }
    let snap = nixl_bounce::stats::plugin_stats(init.name()).expect("stats still readable");
    assert_eq!(snap.counters["panics"], 1, "{snap:?}");
    drop(req);

    // Teardown still runs: the panic left the peer table's lock poisoned,
    // and forgetting the peer (NIXL's disconnect) takes it all the same.
    init.node
        .agent
        .invalidate_remote_md(target.name())
        .expect("disconnect after a panic that held the peer table's lock");
    let snap = nixl_bounce::stats::plugin_stats(init.name()).expect("stats still readable");
    assert_eq!(
        snap.counters["panics"], 1,
        "disconnect panicked on the poisoned lock: {snap:?}"
    );
}
