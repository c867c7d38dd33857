//! Two nixl-sys agents in one process, the same backend on both: DRAM WRITE
//! and READ of 1 descriptor and of 4096 scattered 4 KiB descriptors,
//! byte-exact (including bytes outside the destination blocks), and
//! notifications (with a transfer and standalone).
mod support;

use nixl_sys::XferOp;
use support::*;

const BLOCK: usize = 4096;
const MANY: usize = 4096;

fn pair(backend: &str, n: usize) -> LocalPair {
    LocalPair::new(backend, &[], blocks_for(n) * BLOCK).or_fail("set up two agents")
}

backend_tests! {
    fn write_one_descriptor(backend) {
        let mut p = pair(backend, 1);
        let plan = Plan::standard(1, BLOCK, 11);
        p.run(XferOp::Write, &plan, (101, 102), None).or_fail("WRITE 1 x 4 KiB");
    }

    fn read_one_descriptor(backend) {
        let mut p = pair(backend, 1);
        let plan = Plan::standard(1, BLOCK, 12);
        p.run(XferOp::Read, &plan, (103, 104), None).or_fail("READ 1 x 4 KiB");
    }

    fn write_4096_scattered(backend) {
        let mut p = pair(backend, MANY);
        let plan = Plan::standard(MANY, BLOCK, 13);
        p.run(XferOp::Write, &plan, (105, 106), None).or_fail("WRITE 4096 x 4 KiB scattered");
        // Same agents, a second transfer with another layout and other data.
        let plan = Plan::standard(MANY, BLOCK, 14);
        p.run(XferOp::Write, &plan, (107, 108), None).or_fail("second WRITE 4096 x 4 KiB");
    }

    fn read_4096_scattered(backend) {
        let mut p = pair(backend, MANY);
        let plan = Plan::standard(MANY, BLOCK, 15);
        p.run(XferOp::Read, &plan, (109, 110), None).or_fail("READ 4096 x 4 KiB scattered");
        let plan = Plan::standard(MANY, BLOCK, 16);
        p.run(XferOp::Read, &plan, (111, 112), None).or_fail("second READ 4096 x 4 KiB");
    }

    fn one_large_descriptor(backend) {
        // 1 x 4 MiB: a single large block, unaligned to the block plan.
        let len = 4 << 20;
        let mut p = LocalPair::new(backend, &[], len + BLOCK).or_fail("set up two agents");
        let plan = Plan { block: len, src: vec![0], dst: vec![BLOCK] };
        p.run(XferOp::Write, &plan, (113, 114), None).or_fail("WRITE 1 x 4 MiB");
        let plan = Plan { block: len, src: vec![BLOCK], dst: vec![0] };
        p.run(XferOp::Read, &plan, (115, 116), None).or_fail("READ 1 x 4 MiB");
    }

    fn odd_sizes_and_offsets(backend) {
        // Descriptors that are not 4 KiB multiples and not aligned.
        let mut p = LocalPair::new(backend, &[], 1 << 20).or_fail("set up two agents");
        let plan = Plan {
            block: 1000,
            src: vec![1, 5003, 77_777, 300_001, 1_000_000 - 1001],
            dst: vec![999_000, 3, 12_345, 500_000, 250_013],
        };
        p.run(XferOp::Write, &plan, (117, 118), None).or_fail("WRITE odd sizes");
        p.run(XferOp::Read, &plan, (119, 120), None).or_fail("READ odd sizes");
    }

    fn write_with_notification(backend) {
        let mut p = pair(backend, MANY);
        let plan = Plan::standard(MANY, BLOCK, 17);
        p.run(XferOp::Write, &plan, (121, 122), Some(b"write-4096-done"))
            .or_fail("WRITE 4096 with notification");
        let plan = Plan::standard(1, BLOCK, 18);
        p.run(XferOp::Write, &plan, (123, 124), Some(b"write-1-done"))
            .or_fail("WRITE 1 with notification");
    }

    fn read_with_notification(backend) {
        let mut p = pair(backend, 1);
        let plan = Plan::standard(1, BLOCK, 19);
        p.run(XferOp::Read, &plan, (125, 126), Some(b"read-done"))
            .or_fail("READ with notification");
    }

    fn standalone_notification(backend) {
        let p = pair(backend, 1);
        let msg = b"hello from the initiator \x00\x01\xff binary ok";
        p.init
            .node
            .agent
            .send_notification(p.target.name(), msg, Some(&p.init.node.backend))
            .unwrap_or_else(|e| panic!("send_notification: {e:?}"));
        p.target
            .node
            .wait_notif(p.init.name(), msg, wait_timeout())
            .or_fail("standalone notification");
        // And the other way round.
        p.target
            .node
            .agent
            .send_notification(p.init.name(), b"reply", None)
            .unwrap_or_else(|e| panic!("send_notification (reply): {e:?}"));
        p.init
            .node
            .wait_notif(p.target.name(), b"reply", wait_timeout())
            .or_fail("reply notification");
    }

    fn repost_same_request(backend) {
        // A request can be posted again once complete; data must follow.
        let mut p = pair(backend, 64);
        let plan = Plan::standard(64, BLOCK, 20);
        p.init.buf.fill_pattern(127);
        p.target.buf.fill_pattern(128);
        let target_before = p.target.buf.as_slice().to_vec();
        let req = p
            .init
            .node
            .create_xfer(XferOp::Write, &plan, p.init.buf.addr(), p.target.buf.addr(), &p.target.node.name.clone(), None)
            .or_fail("create_xfer_req");
        for i in 0..3u64 {
            p.init.buf.fill_pattern(200 + i);
            let src = p.init.buf.as_slice().to_vec();
            p.init.node.post_and_wait(&req, wait_timeout()).or_fail("post/wait");
            plan.verify(p.target.buf.as_slice(), &target_before, &src)
                .or_fail(&format!("repost #{i}"));
        }
    }
}
