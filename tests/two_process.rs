//! Two processes, for each backend: this test (the initiator) re-executes
//! its own test binary as the target peer (`peer_helper`, the support
//! module's peer, active only when started as one) and drives it over
//! `nixl_bounce::harness::child`'s line protocol. Both sides compute the
//! same seeded plans and patterns, so each side verifies its own buffer
//! byte-exact: the target after a WRITE, the initiator after a READ.
mod support;

use nixl_sys::XferOp;
use support::peer::{peer_command, peer_main, Peer, BACKEND_ENV};
use support::*;

const BLOCK: usize = 4096;
const MANY: usize = 4096;

fn buf_len() -> usize {
    blocks_for(MANY) * BLOCK
}

fn plan(n: usize, seed: u64) -> Plan {
    support::peer::plan(buf_len(), n, seed)
}

/// The target peer: a no-op unless this binary was started as one.
#[test]
fn peer_helper() {
    peer_main();
}

backend_tests! {
    fn two_process_transfers(backend) {
        let mut cmd = peer_command(&[], buf_len(), &[], "tp-target");
        cmd.env(BACKEND_ENV, backend);
        let mut peer = Peer::spawn("target", cmd).unwrap_or_else(|e| panic!("{e}"));
        let (tname, taddr, tmd) = (peer.name.clone(), peer.addr, peer.md.clone());
        assert_eq!(peer.len, buf_len());

        let mut me = Endpoint::new("tp-init", backend, &[], buf_len(), 0).or_fail("initiator setup");
        assert_eq!(me.node.load_md(&tmd).or_fail("load target metadata"), tname);
        let r = peer.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("local md"))));
        assert_eq!(r, me.name());

        let len = buf_len();
        let steps = [(XferOp::Write, 1usize, false), (XferOp::Write, MANY, true), (XferOp::Read, 1, false), (XferOp::Read, MANY, true)];
        for (i, (op, n, with_notif)) in steps.into_iter().enumerate() {
            let i = i as u64;
            let (my_seed, peer_seed, plan_seed) = (1000 + 2 * i, 1001 + 2 * i, 50 + i);
            let p = plan(n, plan_seed);
            me.buf.fill_pattern(my_seed);
            peer.cmd(&format!("FILL {peer_seed}"));
            let notif = with_notif.then(|| format!("tp-{op:?}-{n}").into_bytes());
            let what = format!("{op:?} {n} x 4 KiB across processes");
            let req = me.node
                .create_xfer(op, &p, me.buf.addr(), taddr, &tname, notif.as_deref())
                .or_fail(&what);
            let dt = me.node.post_and_wait(&req, wait_timeout()).or_fail(&what);
            eprintln!("[two_process] {what}: transfer {dt:?}");
            drop(req);
            let notif_hex = notif.as_deref().map(hex).unwrap_or_else(|| "-".into());
            match op {
                XferOp::Write => {
                    peer.cmd(&format!("CHECK_WRITE {} {n} {plan_seed} {my_seed} {peer_seed} {notif_hex}", me.name()));
                    verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| "WRITE source".into())
                        .or_fail(&format!("{what}: source changed"));
                }
                XferOp::Read => {
                    p.verify(me.buf.as_slice(), &pattern(len, my_seed), &pattern(len, peer_seed)).or_fail(&what);
                    peer.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
                    if let Some(m) = &notif {
                        peer.cmd(&format!("WAIT_NOTIF {} {}", me.name(), hex(m)));
                    }
                }
            }
            me.buf.check_guards().or_fail(&what);
        }

        // Standalone notifications, both directions.
        let msg = b"standalone \x00\xfe notification";
        me.node.agent.send_notification(&tname, msg, Some(&me.node.backend))
            .unwrap_or_else(|e| panic!("send_notification: {e:?}"));
        peer.cmd(&format!("WAIT_NOTIF {} {}", me.name(), hex(msg)));
        peer.cmd(&format!("SEND_NOTIF {} {}", me.name(), hex(b"from-target")));
        me.node.wait_notif(&tname, b"from-target", wait_timeout()).or_fail("notification from the target");

        peer.finish();
    }
}
