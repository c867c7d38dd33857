//! ABI conformance: the project's own declarations of NIXL's C++ plugin ABI
//! (include/nixl_abi/) must agree with the installed NIXL. Each test sends
//! values through a real agent into the engine and back; a layout or vtable
//! disagreement shows up as a wrong value, a failed transfer or a crash here,
//! never silently.

mod support;

use nixl_sys::{MemType, XferDescList, XferOp};
use serial_test::serial;
use support::*;

/// NIXL reads the backend's custom parameters and memory types out of OUR
/// engine object (nixlBackendEngine's data members, slot of
/// getSupportedMems): both must come back exactly as given.
#[test]
#[serial]
fn init_params_and_mem_types_round_trip_through_nixl() {
    if !ready("BOUNCE") {
        return;
    }
    let name = unique_name("abi-params");
    let node = Node::new(
        &name,
        "BOUNCE",
        &[
            ("num_threads", "2"),
            ("ucx_error_handling_mode", "peer"),
            ("enable_cma", "true"),
        ],
    )
    .or_fail("create");
    let (mems, params) = node
        .agent
        .get_backend_params(&node.backend)
        .expect("get_backend_params");
    let mems: Vec<MemType> = mems.iter().map(|m| m.expect("mem type")).collect();
    assert_eq!(
        mems,
        vec![MemType::Dram, MemType::Vram],
        "getSupportedMems as NIXL sees it"
    );
    let mut got: Vec<(String, String)> = params
        .iter()
        .expect("params")
        .map(|p| p.expect("param"))
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    got.sort();
    let mut want = Vec::new();
    // The plugin's advertised defaults are part of what the harness passes.
    let (_m, defaults) = node
        .agent
        .get_plugin_params("BOUNCE")
        .expect("plugin params");
    for (k, v) in defaults
        .iter()
        .expect("defaults")
        .map(|p| p.expect("default"))
    {
        want.push((k.to_string(), v.to_string()));
    }
    want.retain(|(k, _)| k != "num_threads" && k != "ucx_error_handling_mode");
    want.push(("num_threads".into(), "2".into()));
    want.push(("ucx_error_handling_mode".into(), "peer".into()));
    want.sort();
    assert_eq!(
        got, want,
        "custom params read back by NIXL from the engine's base object"
    );

    // The engine saw the same agent name and parameters (init params layout).
    let snap = nixl_bounce::stats::plugin_stats(&name).expect("plugin stats");
    assert_eq!(snap.agent, name);
    assert_eq!(
        snap.params.get("num_threads").map(String::as_str),
        Some("2")
    );
}

/// Descriptor lists (nixlDescList<nixlMetaDesc>: vptr, type, vector of
/// {addr, len, devId, metadataP}) must arrive intact: descriptors of many
/// different lengths and offsets, each checked by the engine against the
/// metadata NIXL resolved for it, then verified byte-exact.
#[test]
#[serial]
fn descriptor_lists_arrive_intact() {
    if !ready("BOUNCE") {
        return;
    }
    let mut pair = LocalPair::new("BOUNCE", &[], 1 << 20).or_fail("pair");
    pair.init.buf.fill_pattern(11);
    pair.target.buf.fill_pattern(12);
    let before = pair.target.buf.as_slice().to_vec();
    let (src, dst) = (pair.init.buf.addr(), pair.target.buf.addr());
    let mut l = XferDescList::new(MemType::Dram).unwrap();
    let mut r = XferDescList::new(MemType::Dram).unwrap();
    let mut moves = Vec::new();
    let (mut so, mut dof) = (0usize, 3usize);
    for i in 0..97usize {
        let len = 1 + (i * 131) % 5000;
        l.add_desc(src + so, len, 0);
        r.add_desc(dst + dof, len, 0);
        moves.push((so, dof, len));
        so += len + (i % 7);
        dof += len + 17;
    }
    let opt = pair.init.node.opt_args(None).or_fail("opt");
    let req = pair
        .init
        .node
        .agent
        .create_xfer_req(
            XferOp::Write,
            &l,
            &r,
            &pair.target.node.name.clone(),
            Some(&opt),
        )
        .expect("create");
    pair.init
        .node
        .post_and_wait(&req, wait_timeout())
        .or_fail("transfer");
    let mut want = before.clone();
    for &(s, d, n) in &moves {
        want[d..d + n].copy_from_slice(&pair.init.buf.as_slice()[s..s + n]);
    }
    verify_bytes(pair.target.buf.as_slice(), &want, |i| format!("byte {i}")).or_fail("destination");
    let snap = nixl_bounce::stats::plugin_stats(pair.init.name()).expect("stats");
    assert!(snap.counters["transfers_prepared"] >= 1, "{snap:?}");
}

/// nixlBackendOptionalArgs.customParam reaches the engine: a known key is
/// accepted, an unknown one refused (so the bytes were really read).
#[test]
#[serial]
fn transfer_custom_param_reaches_the_engine() {
    if !ready("BOUNCE") {
        return;
    }
    let pair = LocalPair::new("BOUNCE", &[], 1 << 16).or_fail("pair");
    let plan = Plan::standard(4, 4096, 5);
    let make = |param: &[u8]| {
        let mut opt = pair.init.node.opt_args(None).or_fail("opt");
        opt.set_custom_param(param).expect("custom param");
        let l = xfer_list(pair.init.buf.addr(), &plan.src, plan.block).unwrap();
        let r = xfer_list(pair.target.buf.addr(), &plan.dst, plan.block).unwrap();
        pair.init.node.agent.create_xfer_req(
            XferOp::Write,
            &l,
            &r,
            &pair.target.node.name.clone(),
            Some(&opt),
        )
    };
    let ok = make(b"deadline_ms=60000").expect("a known custom parameter is accepted");
    pair.init
        .node
        .post_and_wait(&ok, wait_timeout())
        .or_fail("transfer");
    assert!(
        make(b"no_such_key=1").is_err(),
        "an unknown custom parameter must be refused"
    );
}

/// Transfers with fewer descriptors than any of BOUNCE's paths takes are
/// handed to the UCX delegate by the shim without entering the engine's
/// preparation (the floors it read once): they still arrive byte-exact and
/// are counted as the engine counts them, prepared and by reason (to the
/// peer: too few descriptors; within the agent itself: a local transfer).
#[test]
#[serial]
fn transfers_below_the_route_floor_are_counted_by_reason() {
    if !ready("BOUNCE") {
        return;
    }
    let mut pair = LocalPair::new("BOUNCE", &[], 1 << 16).or_fail("pair");
    let agent = pair.init.name().to_string();
    // (A counter still at zero is left out.)
    let counter = |key: &str| {
        let stats = nixl_bounce::stats::plugin_stats(&agent).expect("stats");
        stats.counters.get(key).copied().unwrap_or(0)
    };
    for (to_self, reason) in [
        (false, "fallback_too_few_descriptors"),
        (true, "fallback_local_transfer"),
    ] {
        pair.init.buf.fill_pattern(21);
        pair.target.buf.fill_pattern(22);
        let (prepared, fell_back, timed) = (
            counter("transfers_prepared"),
            counter(reason),
            counter("prepare_ns"),
        );
        let src = pair.init.buf.addr();
        let (dst, name) = if to_self {
            (src + 8192, pair.init.node.name.clone())
        } else {
            (pair.target.buf.addr(), pair.target.node.name.clone())
        };
        let l = xfer_list(src, &[0], 4096).unwrap();
        let r = xfer_list(dst, &[0], 4096).unwrap();
        let req = pair
            .init
            .node
            .agent
            .create_xfer_req(XferOp::Write, &l, &r, &name, None)
            .expect("create");
        pair.init
            .node
            .post_and_wait(&req, wait_timeout())
            .or_fail("transfer");
        let moved = if to_self {
            &pair.init.buf.as_slice()[8192..8192 + 4096]
        } else {
            &pair.target.buf.as_slice()[..4096]
        };
        assert_eq!(moved, &pair.init.buf.as_slice()[..4096], "{reason}: bytes");
        assert_eq!(counter("transfers_prepared"), prepared + 1, "{reason}");
        assert_eq!(counter(reason), fell_back + 1, "{reason}");
        // Decided in the shim: the engine's preparation timer never ran.
        assert_eq!(
            counter("prepare_ns"),
            timed,
            "{reason}: the engine prepared it"
        );
    }
}
