//! The peer-mapped path with two BOUNCE agents in one process (needs a GPU;
//! prints `SKIP: ...` and passes elsewhere). In one process the peer's
//! memory is used at its own address; two processes (CUDA IPC) are covered
//! by `bounce-vram test` (docs/gpu.md).
//!
//! - WRITE and READ of 1024 and 16,384 scattered 4 KiB blocks, byte-exact
//!   over the whole buffers, counted as peer-mapped on the initiator and
//!   never seen by the target's bounce path (the one-pass pair table);
//! - the same with descriptors of two lengths (the merged run table);
//! - a small request posted four times: its inline table is uploaded at
//!   the second post (none inline when prepared in prepXfer), byte-exact;
//! - a WRITE with a notification: the target checks its destination the
//!   moment the notification arrives, without the initiator polling first;
//! - `enable_peer_map=false` on the target: the region is not exported and
//!   the WRITE takes the bounce path instead;
//! - a release while the copy runs: no notification, nothing outside the
//!   destinations touched, the next WRITE byte-exact;
//! - with two GPUs, the initiator's buffer on one and the target's on the
//!   other, both ways (skips with one).
//!
//! Run: `cargo test --release --test gpu_peer_map -- --nocapture`.
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bounce::{stats, take_notifs};
use nixl_bounce::copy::cuda::{CudaDevice, CudaRuntime};
use nixl_bounce::dataplane::vram::DeviceArena;
use nixl_sys::{MemType, OptArgs, RegistrationHandle, XferDescList, XferOp, XferRequest};
use support::*;

const BLOCK: usize = 4096;

/// GPU 0, when there is one and the plugin can run (else the test skips,
/// saying why).
fn gpu_and_plugin() -> Option<Arc<CudaDevice>> {
    match CudaRuntime::probe().and_then(|rt| rt.device(0)) {
        Ok(d) => ready("BOUNCE").then_some(d),
        Err(e) => {
            println!("SKIP: no CUDA driver or device ({e})");
            None
        }
    }
}

/// An agent with a VRAM buffer registered with BOUNCE.
struct Side {
    node: Node,
    buf: DeviceArena,
    _reg: RegistrationHandle,
}

impl Side {
    fn new(dev: &CudaDevice, prefix: &str, len: usize, extra: &[(&str, &str)]) -> Side {
        let mut params = vec![("control_bind_loopback", "true")];
        params.extend_from_slice(extra);
        let node = Node::new(&unique_name(prefix), "BOUNCE", &params).or_fail("agent");
        let buf = DeviceArena::new(dev, len).or_fail("device buffer");
        let reg = register_vram(&node, &buf);
        Side {
            node,
            buf,
            _reg: reg,
        }
    }
    fn name(&self) -> &str {
        &self.node.name
    }
    fn fill(&self, seed: u64) -> Vec<u8> {
        let data = pattern(self.buf.len(), seed);
        self.buf.write(0, &data).or_fail("fill");
        data
    }
    fn contents(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buf.len()];
        self.buf.read(0, &mut v).or_fail("read back");
        v
    }
}

fn register_vram(node: &Node, buf: &DeviceArena) -> RegistrationHandle {
    let mut opt = OptArgs::new().expect("opt args");
    opt.add_backend(&node.backend).expect("backend");
    node.agent
        .register_memory(buf, Some(&opt))
        .map_err(|e| format!("{e}"))
        .or_fail("register VRAM")
}

/// A VRAM transfer request of `plan` from `a`'s buffer to `b`'s (WRITE) or
/// back (READ), as `Node::create_xfer` makes for DRAM.
fn vram_xfer(op: XferOp, plan: &Plan, a: &Side, b: &Side, notif: Option<&[u8]>) -> XferRequest {
    vram_xfer_split(op, plan, a, b, notif, None)
}

/// As [`vram_xfer`]; with `split: Some(k)` each block of the plan is two
/// descriptors, its first `k` bytes and the rest (descriptors of two
/// lengths, moving the same bytes).
fn vram_xfer_split(
    op: XferOp,
    plan: &Plan,
    a: &Side,
    b: &Side,
    notif: Option<&[u8]>,
    split: Option<usize>,
) -> XferRequest {
    let (lo, ro) = match op {
        XferOp::Write => (&plan.src, &plan.dst),
        _ => (&plan.dst, &plan.src),
    };
    let list = |buf: &DeviceArena, offsets: &[usize]| {
        let (base, dev) = (buf.base() as usize, buf.ordinal() as u64);
        let mut l = XferDescList::new(MemType::Vram).expect("descriptor list");
        for o in offsets {
            match split {
                None => l.add_desc(base + o, plan.block, dev),
                Some(k) => {
                    l.add_desc(base + o, k, dev);
                    l.add_desc(base + o + k, plan.block - k, dev);
                }
            }
        }
        l
    };
    let opt = a.node.opt_args(notif).or_fail("opt args");
    a.node
        .agent
        .create_xfer_req(
            op,
            &list(&a.buf, lo),
            &list(&b.buf, ro),
            b.name(),
            Some(&opt),
        )
        .map_err(|e| format!("create_xfer_req({op:?}, {} descriptors): {e}", plan.len()))
        .or_fail("prepare")
}

fn pair(dev: &CudaDevice, n: usize, target_extra: &[(&str, &str)]) -> (Side, Side) {
    let len = blocks_for(n) * BLOCK;
    let a = Side::new(dev, "pm-init", len, &[]);
    let b = Side::new(dev, "pm-target", len, target_extra);
    introduce(&a, &b);
    (a, b)
}

/// Each side loads the other's metadata.
fn introduce(a: &Side, b: &Side) {
    a.node
        .load_md(&b.node.local_md().or_fail("target md"))
        .or_fail("load target md");
    b.node
        .load_md(&a.node.local_md().or_fail("initiator md"))
        .or_fail("load initiator md");
}

/// One byte-exact transfer of `plan` between the two buffers; returns the
/// path the initiator's counters show ("peer", "bounce" or "ucx").
fn checked(op: XferOp, a: &Side, b: &Side, plan: &Plan, seed: u64) -> &'static str {
    checked_split(op, a, b, plan, seed, None)
}

/// As [`checked`], the blocks split as [`vram_xfer_split`] does.
fn checked_split(
    op: XferOp,
    a: &Side,
    b: &Side,
    plan: &Plan,
    seed: u64,
    split: Option<usize>,
) -> &'static str {
    // Source and destination buffers of the plan.
    let (src, dst) = match op {
        XferOp::Write => (a, b),
        _ => (b, a),
    };
    let src_data = src.fill(seed);
    let dst_before = dst.fill(seed + 1);
    let before = stats(a.name());
    let req = vram_xfer_split(op, plan, a, b, None, split);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("transfer");
    drop(req);
    plan.verify(&dst.contents(), &dst_before, &src_data)
        .or_fail("destination");
    verify_bytes(&src.contents(), &src_data, |_| "source".into()).or_fail("source changed");
    let after = stats(a.name());
    match (
        after.since(&before, "peer_map_succeeded"),
        after.since(&before, "bounce_succeeded"),
    ) {
        (1, 0) => "peer",
        (0, 1) => "bounce",
        (0, 0) => "ucx",
        other => panic!("counted on two paths: {other:?}"),
    }
}

#[test]
#[serial_test::serial]
fn writes_and_reads_are_one_kernel_through_the_mapping() {
    let Some(dev) = gpu_and_plugin() else { return };
    for n in [1024, 16384] {
        let (a, b) = pair(&dev, n, &[]);
        let target_before = stats(b.name());
        for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
            let plan = Plan::standard(n, BLOCK, 40 + n as u64 + i as u64);
            let path = checked(op, &a, &b, &plan, 7 * n as u64 + i as u64);
            assert_eq!(path, "peer", "{op:?} of {n} x 4 KiB");
        }
        let target_after = stats(b.name());
        for k in ["chunks_scattered", "reads_served", "bounce_succeeded"] {
            assert_eq!(target_after.since(&target_before, k), 0, "target {k}");
        }
        println!("{n} x 4 KiB: WRITE and READ peer-mapped, byte-exact");
    }
}

/// Two GPUs (skips with one): the initiator's buffer on one, the target's
/// on the other, both ways. In one process the copying GPU is given peer
/// access to the other; the copy is still one kernel, byte-exact.
#[test]
#[serial_test::serial]
fn across_two_gpus_writes_and_reads_are_one_kernel() {
    let Some(dev0) = gpu_and_plugin() else { return };
    let rt = CudaRuntime::probe().or_fail("CUDA");
    if rt.device_count() < 2 {
        println!("SKIP: one GPU (the cross-GPU case needs two)");
        return;
    }
    let dev1 = rt.device(1).or_fail("GPU 1");
    for (from, to) in [(&dev0, &dev1), (&dev1, &dev0)] {
        for n in [1024, 16384] {
            let len = blocks_for(n) * BLOCK;
            let a = Side::new(from, "pm-x-init", len, &[]);
            let b = Side::new(to, "pm-x-target", len, &[]);
            introduce(&a, &b);
            for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
                let plan = Plan::standard(n, BLOCK, 60 + n as u64 + i as u64);
                let path = checked(op, &a, &b, &plan, 11 * n as u64 + i as u64);
                let (f, t) = (from.ordinal(), to.ordinal());
                assert_eq!(path, "peer", "{op:?} of {n} x 4 KiB, GPU {f} -> GPU {t}");
            }
            println!(
                "GPU {} -> GPU {}: {n} x 4 KiB WRITE and READ peer-mapped, byte-exact",
                from.ordinal(),
                to.ordinal()
            );
        }
    }
}

/// Regions registered anew between requests (the peer's agent and memory
/// replaced, this agent's memory registered again) are copied where they
/// are now, byte-exact. The windows kept from one request for the next
/// (`WindowCache`) are emptied by every release, by construction; in one
/// process a stale window could only be declined (a peer's memory is not
/// shifted there), so this guards the path rather than provoking one.
#[test]
#[serial_test::serial]
fn regions_registered_anew_between_requests_are_copied_where_they_are_now() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 512;
    let len = blocks_for(n) * BLOCK;
    let mut a = Side::new(&dev, "pm-anew-init", len, &[]);
    for round in 0..3u64 {
        if round > 0 {
            // A new buffer registered, then the old registration and buffer
            // released (in that order: fields assigned in turn).
            let buf = DeviceArena::new(&dev, len).or_fail("device buffer");
            a._reg = register_vram(&a.node, &buf);
            a.buf = buf;
        }
        let b = Side::new(&dev, "pm-anew-target", len, &[]);
        introduce(&a, &b);
        for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
            let seed = 90 + 2 * round + i as u64;
            let plan = Plan::standard(n, BLOCK, seed);
            let path = checked(op, &a, &b, &plan, 7 * seed);
            assert_eq!(path, "peer", "round {round}: {op:?}");
        }
        a.node
            .agent
            .invalidate_remote_md(b.name())
            .map_err(|e| format!("{e}"))
            .or_fail("unload the target's metadata");
    }
    println!("3 rounds of new regions: WRITE and READ peer-mapped, byte-exact");
}

/// Descriptors of two lengths are not a pair table: they take the merged
/// run table, on the same path, byte-exact.
#[test]
#[serial_test::serial]
fn descriptors_of_several_lengths_take_the_run_table() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 2048;
    let (a, b) = pair(&dev, n, &[]);
    for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
        let plan = Plan::standard(n, BLOCK, 300 + i as u64);
        let path = checked_split(op, &a, &b, &plan, 500 + i as u64, Some(1000));
        assert_eq!(path, "peer", "{op:?} of {n} x (1000 + 3096) bytes");
    }
    println!("{n} blocks as 1000 + 3096 bytes: WRITE and READ peer-mapped, byte-exact");
}

/// A small request's table is the launch's parameter when the request is
/// prepared at its first post (the default), and uploaded at its second
/// post; every post after moves new bytes exactly. Prepared in prepXfer
/// (`prepare_at_post=false`), the table is uploaded from the start.
#[test]
#[serial_test::serial]
fn a_reposted_small_table_is_uploaded_once_and_copies_the_same() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 1024;
    for (at_post, inline, uploaded) in [("true", 1, 1), ("false", 0, 0)] {
        let len = blocks_for(n) * BLOCK;
        let extra = [("prepare_at_post", at_post)];
        let a = Side::new(&dev, "pm-repost", len, &extra);
        let b = Side::new(&dev, "pm-repost-target", len, &[]);
        introduce(&a, &b);
        for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
            let (src, dst) = match op {
                XferOp::Write => (&a, &b),
                _ => (&b, &a),
            };
            let plan = Plan::standard(n, BLOCK, 900 + i as u64);
            let before = stats(a.name());
            let req = vram_xfer(op, &plan, &a, &b, None);
            for post in 0..4u64 {
                let seed = 1000 * (i as u64 + 1) + 10 * post;
                let src_data = src.fill(seed);
                let dst_before = dst.fill(seed + 1);
                a.node
                    .post_and_wait(&req, wait_timeout())
                    .or_fail("transfer");
                plan.verify(&dst.contents(), &dst_before, &src_data)
                    .or_fail("destination");
            }
            let after = stats(a.name());
            let what = format!("{op:?}, prepare_at_post={at_post}");
            assert_eq!(after.since(&before, "peer_map_succeeded"), 4, "{what}");
            assert_eq!(
                after.since(&before, "peer_map_inline_tables"),
                inline,
                "{what}"
            );
            assert_eq!(
                after.since(&before, "peer_map_inline_tables_uploaded"),
                uploaded,
                "{what}"
            );
        }
        println!(
            "{n} x 4 KiB posted 4 times, prepare_at_post={at_post}: byte-exact, \
             {inline} inline table, {uploaded} uploaded at a repost"
        );
    }
}

#[test]
#[serial_test::serial]
fn the_notification_means_the_data_is_there() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 4096;
    let (a, b) = pair(&dev, n, &[]);
    let plan = Plan::standard(n, BLOCK, 77);
    let src = a.fill(1);
    let dst_before = b.fill(2);
    let req = vram_xfer(XferOp::Write, &plan, &a, &b, Some(b"peer-done"));
    let before = stats(a.name());
    a.node.agent.post_xfer_req(&req, None).expect("post");
    // The initiator does not poll: the notification must still come.
    let t0 = Instant::now();
    let got = loop {
        let msgs = take_notifs(&b.node).or_fail("notifications");
        if !msgs.is_empty() {
            break msgs;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no notification");
        std::thread::sleep(Duration::from_micros(50));
    };
    assert_eq!(got, vec![(a.name().to_string(), b"peer-done".to_vec())]);
    plan.verify(&b.contents(), &dst_before, &src)
        .or_fail("destination at notification time");
    a.node
        .wait_xfer(&req, Instant::now(), wait_timeout())
        .or_fail("status");
    assert_eq!(stats(a.name()).since(&before, "peer_map_succeeded"), 1);
}

#[test]
#[serial_test::serial]
fn a_target_that_turns_peer_mapping_off_gets_the_bounce_path() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 1024;
    let (a, b) = pair(&dev, n, &[("enable_peer_map", "false")]);
    let plan = Plan::standard(n, BLOCK, 5);
    assert_eq!(checked(XferOp::Write, &a, &b, &plan, 11), "bounce");
}

#[test]
#[serial_test::serial]
fn a_release_while_the_copy_runs_sends_nothing_and_harms_nothing() {
    let Some(dev) = gpu_and_plugin() else { return };
    let n = 16384;
    let (a, b) = pair(&dev, n, &[]);
    let plan = Plan::standard(n, BLOCK, 9);
    let src = a.fill(3);
    let dst_before = b.fill(4);
    let before = stats(a.name());
    for _ in 0..20 {
        let req = vram_xfer(XferOp::Write, &plan, &a, &b, Some(b"released"));
        a.node.agent.post_xfer_req(&req, None).expect("post");
        drop(req); // released at once, mostly while the kernel runs
    }
    std::thread::sleep(Duration::from_millis(200));
    let after = stats(a.name());
    let cancelled = after.since(&before, "peer_map_cancelled");
    let notifs = take_notifs(&b.node).or_fail("notifications").len();
    // Every request released while running sent nothing; the others did.
    assert_eq!(
        notifs as u64 + cancelled,
        20,
        "cancelled {cancelled}, notified {notifs}"
    );
    // Each copy wrote the same bytes: the destinations hold the source, the
    // rest is untouched.
    plan.verify(&b.contents(), &dst_before, &src)
        .or_fail("destination after released copies");
    let again = Plan::standard(n, BLOCK, 10);
    assert_eq!(checked(XferOp::Write, &a, &b, &again, 12), "peer");
    println!("{cancelled} of 20 released while running");
}
