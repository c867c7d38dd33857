//! The NIXL-notification control channel over two real nixl-sys agents with
//! the UCX backend, in one process.
//!
//! Needs the NIXL runtime: prints `SKIP:` without it, fails when
//! `NIXL_BOUNCE_REQUIRE_RUNTIME=1`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_bounce::control::notif::notif_endpoint;
use nixl_bounce::control::{ControlChannel, ControlKind, Incoming, NotifChannel, NotifHub};
use serial_test::serial;

/// An agent named like an engine's inner agent, with a UCX backend.
fn inner_agent(outer: &str) -> nixl_sys::Agent {
    let name = format!("{}/bounce", support::unique_name(outer));
    support::Node::new(&name, "UCX", &[])
        .unwrap_or_else(|e| panic!("creating agent {name}: {e}"))
        .agent
}

fn recv_within(ch: &mut dyn ControlChannel, limit: Duration) -> Incoming {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(m) = ch.recv(Duration::from_millis(50)).expect("recv failed") {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "no control message within {limit:?}"
        );
    }
}

#[test]
#[serial]
fn notification_channels_exchange_over_the_reverse_path_and_keep_user_notifications() {
    if !support::ready("UCX") {
        return;
    }
    let limit = support::wait_timeout().min(Duration::from_secs(30));
    let a_agent = inner_agent("sender");
    let b_agent = inner_agent("receiver");
    let a_hub = Arc::new(NotifHub::new(Arc::new(a_agent.clone())));
    let b_hub = Arc::new(NotifHub::new(Arc::new(b_agent.clone())));
    let mut a = NotifChannel::new(a_hub.clone()).expect("channel A");
    let mut b = NotifChannel::new(b_hub.clone()).expect("channel B");
    assert_eq!(a.kind(), ControlKind::NixlNotif);

    // One-directional metadata exchange, as in disaggregated serving: the
    // sender knows the receiver (its handshake endpoint), never the reverse.
    let to_b = a
        .add_peer(b.local_endpoint())
        .expect("A adds B by its full endpoint");
    for i in 0..50u32 {
        a.send(to_b, &i.to_le_bytes()).expect("A sends");
        if i % 10 == 0 {
            // A user notification on the same agent pair, interleaved.
            a_agent
                .send_notification(&b_agent.name(), format!("user {i}").as_bytes(), None)
                .expect("user notif");
        }
    }
    let mut from = None;
    for i in 0..50u32 {
        let m = recv_within(&mut b, limit);
        assert_eq!(m.payload, i.to_le_bytes(), "control messages out of order");
        assert_eq!(m.from, notif_endpoint(&a_agent.name(), None));
        from = Some(m.from);
    }

    // Reverse path: B registers A from the full endpoint A would carry in
    // its WANT, then replies to the sender it saw.
    let to_a = b
        .add_peer(a.local_endpoint())
        .expect("B adds A by the endpoint from the WANT");
    assert_eq!(
        b.add_peer(&from.unwrap()).unwrap(),
        to_a,
        "short and full forms name one peer"
    );
    b.send(to_a, b"GRANT").expect("B replies");
    let reply = recv_within(&mut a, limit);
    assert_eq!(reply.payload, b"GRANT");
    assert_eq!(reply.from, notif_endpoint(&b_agent.name(), None));

    // The user notifications reached B's user queue, in order, untouched.
    let deadline = Instant::now() + limit;
    let mut user = Vec::new();
    while user.len() < 5 && Instant::now() < deadline {
        user.extend(b_hub.take_user().expect("take_user"));
        std::thread::sleep(Duration::from_millis(5));
    }
    let expected: Vec<(String, Vec<u8>)> = (0..50)
        .step_by(10)
        .map(|i| (a_agent.name(), format!("user {i}").into_bytes()))
        .collect();
    assert_eq!(user, expected);
    assert!(
        a_hub.take_user().unwrap().is_empty(),
        "control replies leaked into A's user queue"
    );

    // Re-adding after removal (metadata loaded again) still works.
    assert!(b.remove_peer(to_a));
    let again = b
        .add_peer(a.local_endpoint())
        .expect("B re-adds A (metadata loaded twice)");
    b.send(again, b"ACK").expect("B sends after re-adding");
    assert_eq!(recv_within(&mut a, limit).payload, b"ACK");
}

/// Runs the live channels for `span`; heartbeats never surface as messages.
fn run_for(span: Duration, live: &mut [&mut NotifChannel]) {
    let end = Instant::now() + span;
    while Instant::now() < end {
        for ch in live.iter_mut() {
            assert!(ch.recv(Duration::from_millis(2)).expect("recv").is_none());
        }
    }
}

/// Liveness over real notifications (issue 15 item 2): A loaded B (B's
/// handshake); B never loaded A and answers A's PINGs all the same (each
/// carries A's metadata); a B that stops reading is unreachable for A after
/// the timeout, and reachable again once it reads; B, having learned from
/// the PINGs that A answers them, finds A unreachable when A stops.
#[test]
#[serial]
fn heartbeats_over_real_notifications_find_a_stopped_peer() {
    if !support::ready("UCX") {
        return;
    }
    const T: Duration = Duration::from_millis(400);
    let a_agent = inner_agent("pinger");
    let b_agent = inner_agent("answerer");
    let b_hub = Arc::new(NotifHub::new(Arc::new(b_agent.clone())));
    let mut a = NotifChannel::new(Arc::new(NotifHub::new(Arc::new(a_agent.clone()))))
        .expect("channel A")
        .with_liveness(T);
    let mut b = NotifChannel::new(b_hub.clone())
        .expect("channel B")
        .with_liveness(T);
    let to_b = a.add_peer(b.local_endpoint()).expect("A adds B");
    a.watch_liveness(to_b);
    run_for(T * 2, &mut [&mut a, &mut b]);
    assert!(a.unreachable_peers().is_empty(), "B answers A's PINGs");
    let to_a = b
        .add_peer(&notif_endpoint(&a_agent.name(), None))
        .expect("B registers A (loaded by the first PING)");

    run_for(T + T / 2, &mut [&mut a]);
    assert_eq!(a.unreachable_peers(), vec![to_b], "B stopped reading");
    run_for(T, &mut [&mut a, &mut b]);
    assert!(a.unreachable_peers().is_empty(), "B reads again");
    assert!(b.unreachable_peers().is_empty());

    run_for(T + T / 2, &mut [&mut b]);
    assert_eq!(b.unreachable_peers(), vec![to_a], "A stopped reading");
    assert!(
        b_hub.take_user().expect("take_user").is_empty(),
        "a heartbeat reached the user queue"
    );
}
