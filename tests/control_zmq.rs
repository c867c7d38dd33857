//! The ZMQ control channel against real ZMQ sockets on loopback.
//!
//! Every test is `#[serial]`: the file-descriptor test counts the whole
//! process's descriptors, which the other tests' sockets would disturb.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use nixl_bounce::control::zmq::{interface_addresses, parse_tcp_endpoint};
use nixl_bounce::control::{
    BindSpec, ControlChannel, ControlError, ControlKind, Endpoint, Incoming, SendError, ZmqChannel,
    ZmqConfig,
};
use serial_test::serial;

const WAIT: Duration = Duration::from_secs(5);

fn loopback_channel() -> ZmqChannel {
    ZmqChannel::new(&BindSpec::loopback(), ZmqConfig::default())
        .expect("binding a loopback channel")
}

/// Receives one message, failing the test after [`WAIT`].
fn recv_one(ch: &mut dyn ControlChannel) -> Incoming {
    ch.recv(WAIT)
        .expect("recv failed")
        .expect("no message within the time limit")
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("reading /proc/self/fd")
        .count()
}

#[test]
#[serial]
fn binds_loopback_with_a_real_port() {
    let ch = loopback_channel();
    assert_eq!(ch.kind(), ControlKind::Zmq);
    let addr = parse_tcp_endpoint(ch.local_endpoint()).expect("the local endpoint is itself valid");
    assert_eq!(addr.ip(), IpAddr::from([127, 0, 0, 1]));
    assert_ne!(addr.port(), 0);
}

#[test]
#[serial]
fn exchange_in_both_directions_over_the_reverse_path() {
    let mut a = loopback_channel();
    let mut b = loopback_channel();

    let to_b = a.add_peer(&b.local_endpoint().clone()).unwrap();
    a.send(to_b, b"WANT").unwrap();

    // B never registered A: it learns A's endpoint from the message itself.
    let got = recv_one(&mut b);
    assert_eq!(got.payload, b"WANT");
    assert_eq!(&got.from, a.local_endpoint());

    let to_a = b.add_peer(&got.from).unwrap();
    b.send(to_a, b"GRANT").unwrap();
    let reply = recv_one(&mut a);
    assert_eq!(reply.payload, b"GRANT");
    assert_eq!(&reply.from, b.local_endpoint());

    // A huge timeout is fine (no overflow) and returns as soon as a message is there.
    b.send(to_a, b"again").unwrap();
    assert_eq!(a.recv(Duration::MAX).unwrap().unwrap().payload, b"again");

    // Empty messages travel too.
    a.send(to_b, b"").unwrap();
    assert_eq!(recv_one(&mut b).payload, b"");
}

#[test]
#[serial]
fn messages_from_each_peer_arrive_in_order() {
    let mut receiver = loopback_channel();
    let mut s1 = loopback_channel();
    let mut s2 = loopback_channel();
    let p1 = s1.add_peer(receiver.local_endpoint()).unwrap();
    let p2 = s2.add_peer(receiver.local_endpoint()).unwrap();

    const N: u32 = 1000;
    for i in 0..N {
        s1.send(p1, &i.to_le_bytes()).unwrap();
        s2.send(p2, &(i + 1_000_000).to_le_bytes()).unwrap();
    }
    let (mut next1, mut next2) = (0u32, 1_000_000u32);
    let deadline = Instant::now() + Duration::from_secs(20);
    while next1 < N || next2 < N + 1_000_000 {
        assert!(Instant::now() < deadline, "timed out at {next1} / {next2}");
        let m = recv_one(&mut receiver);
        let v = u32::from_le_bytes(m.payload[..].try_into().unwrap());
        if &m.from == s1.local_endpoint() {
            assert_eq!(v, next1, "out of order from s1");
            next1 += 1;
        } else {
            assert_eq!(&m.from, s2.local_endpoint());
            assert_eq!(v, next2, "out of order from s2");
            next2 += 1;
        }
    }
}

#[test]
#[serial]
fn add_peer_is_idempotent_and_removed_handles_are_unknown() {
    let mut a = loopback_channel();
    let b = loopback_channel();
    let h1 = a.add_peer(b.local_endpoint()).unwrap();
    let h2 = a.add_peer(b.local_endpoint()).unwrap();
    assert_eq!(h1, h2);
    assert_eq!(a.peer_count(), 1);
    assert!(a.remove_peer(h1));
    assert!(!a.remove_peer(h1));
    assert!(matches!(a.send(h1, b"x"), Err(SendError::UnknownPeer(h)) if h == h1));
    let h3 = a.add_peer(b.local_endpoint()).unwrap();
    assert_ne!(h3, h1, "handles are never reused");
}

#[test]
#[serial]
fn add_remove_cycles_do_not_grow_open_descriptors() {
    let mut a = loopback_channel();
    let mut b = loopback_channel();
    let b_ep = b.local_endpoint().clone();
    // Warm up: one full cycle, so lazily created ZMQ internals exist already.
    let h = a.add_peer(&b_ep).unwrap();
    a.send(h, b"warm-up").unwrap();
    recv_one(&mut b);
    a.remove_peer(h);

    let settle = |limit: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = open_fds();
            if n <= limit || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let before = settle(0);
    for i in 0..1000u32 {
        let h = a.add_peer(&b_ep).unwrap();
        // The message may or may not make it (linger 0 drops what is queued).
        let _ = a.send(h, &i.to_le_bytes());
        assert!(a.remove_peer(h));
        while let Ok(Some(_)) = b.recv(Duration::ZERO) {}
    }
    assert_eq!(a.peer_count(), 0);
    // Closed sockets are reaped by ZMQ's background thread: allow it a moment.
    let after = settle(before + 4);
    assert!(
        after <= before + 4,
        "open descriptors grew from {before} to {after} over 1000 add/remove cycles"
    );
}

/// Sends `msg` until the channel reports `WouldBlock`, checking that no call
/// blocks. Returns how many messages were accepted.
fn send_until_would_block(
    ch: &mut ZmqChannel,
    peer: nixl_bounce::control::PeerHandle,
    msg: &[u8],
) -> usize {
    let started = Instant::now();
    for sent in 0..1_000_000usize {
        let t = Instant::now();
        let r = ch.send(peer, msg);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "a send blocked for {:?}",
            t.elapsed()
        );
        match r {
            Ok(()) => {}
            Err(SendError::WouldBlock { .. }) => return sent,
            Err(e) => panic!("unexpected send error: {e}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no WouldBlock after {sent} messages"
        );
    }
    panic!("no WouldBlock after a million messages");
}

#[test]
#[serial]
fn a_stalled_peer_fills_the_queue_and_send_returns_would_block() {
    let config = ZmqConfig {
        send_hwm: 16,
        recv_hwm: 16,
        ..ZmqConfig::default()
    };
    let mut a = ZmqChannel::new(&BindSpec::loopback(), config.clone()).unwrap();
    let stalled = ZmqChannel::new(&BindSpec::loopback(), config).unwrap(); // never receives
    let peer = a.add_peer(stalled.local_endpoint()).unwrap();
    let msg = vec![0xabu8; 64 * 1024];
    let accepted = send_until_would_block(&mut a, peer, &msg);
    assert!(
        accepted >= 1,
        "nothing was accepted before the queue was full"
    );
    // Still full a moment later, still not blocking.
    let t = Instant::now();
    assert!(matches!(
        a.send(peer, &msg),
        Err(SendError::WouldBlock { .. })
    ));
    assert!(t.elapsed() < Duration::from_millis(500));
}

#[test]
#[serial]
fn an_unreachable_peer_fills_the_queue_and_send_returns_would_block() {
    // Bind a channel to learn a free port, then close it: nobody listens there.
    let gone = loopback_channel().local_endpoint().clone();
    let mut a = ZmqChannel::new(
        &BindSpec::loopback(),
        ZmqConfig {
            send_hwm: 8,
            ..ZmqConfig::default()
        },
    )
    .unwrap();
    let peer = a.add_peer(&gone).unwrap();
    let accepted = send_until_would_block(&mut a, peer, b"WANT");
    assert!(
        accepted <= 64,
        "{accepted} messages queued for an unreachable peer with a high-water mark of 8"
    );
}

#[test]
#[serial]
fn malformed_messages_from_a_raw_client_are_dropped() {
    let mut b = loopback_channel();
    let b_ep = b.local_endpoint().as_str().unwrap().to_string();
    let ctx = zmq::Context::new();

    // 1. No routing id set: ZMQ invents one, which is not an endpoint.
    let anon = ctx.socket(zmq::DEALER).unwrap();
    anon.set_linger(0).unwrap();
    anon.connect(&b_ep).unwrap();
    anon.send("garbage", 0).unwrap();
    // 2. A valid-looking routing id but three payload frames.
    let raw = ctx.socket(zmq::DEALER).unwrap();
    raw.set_linger(0).unwrap();
    raw.set_identity(b"tcp://127.0.0.1:1").unwrap();
    raw.connect(&b_ep).unwrap();
    raw.send_multipart(["one", "two", "three"], 0).unwrap();
    // 3. A routing id that is not a tcp endpoint.
    let liar = ctx.socket(zmq::DEALER).unwrap();
    liar.set_linger(0).unwrap();
    liar.set_identity(b"not an endpoint").unwrap();
    liar.connect(&b_ep).unwrap();
    liar.send("hello", 0).unwrap();
    // 4. Then a well-formed message from the same raw client: it still parses.
    raw.send("WANT", 0).unwrap();

    let got = recv_one(&mut b);
    assert_eq!(got.payload, b"WANT");
    assert_eq!(got.from, Endpoint::from("tcp://127.0.0.1:1"));

    // A real channel still gets through afterwards.
    let mut a = loopback_channel();
    let h = a.add_peer(b.local_endpoint()).unwrap();
    a.send(h, b"after garbage").unwrap();
    let got = recv_one(&mut b);
    assert_eq!(got.payload, b"after garbage");
    assert_eq!(&got.from, a.local_endpoint());
    assert!(
        b.recv(Duration::from_millis(100)).unwrap().is_none(),
        "a malformed message leaked through"
    );
}

#[test]
#[serial]
fn a_forgotten_peer_reconnects_with_the_same_routing_id() {
    let mut a = loopback_channel();
    let mut b = loopback_channel();
    let b_ep = b.local_endpoint().clone();
    // Forget and re-add repeatedly without letting B notice the disconnect:
    // without ZMQ_ROUTER_HANDOVER, B would drop the new connection's messages
    // while the stale one with the same routing id is still registered.
    for round in 0..20u32 {
        let h = a.add_peer(&b_ep).unwrap();
        a.send(h, &round.to_le_bytes()).unwrap();
        let got = recv_one(&mut b);
        assert_eq!(got.payload, round.to_le_bytes(), "round {round}");
        assert_eq!(&got.from, a.local_endpoint());
        assert!(a.remove_peer(h));
    }
}

#[test]
#[serial]
fn ipv6_loopback_works_when_available() {
    let v6 = BindSpec::address("::1".parse().unwrap());
    let (mut a, mut b) = match (
        ZmqChannel::new(&v6, ZmqConfig::default()),
        ZmqChannel::new(&v6, ZmqConfig::default()),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            println!("SKIP: cannot bind [::1] on this machine: {e}");
            return;
        }
    };
    let ep = b.local_endpoint().as_str().unwrap().to_string();
    assert!(ep.starts_with("tcp://[::1]:"), "{ep}");
    let h = a.add_peer(b.local_endpoint()).unwrap();
    a.send(h, b"v6").unwrap();
    let got = recv_one(&mut b);
    assert_eq!(got.payload, b"v6");
    assert_eq!(&got.from, a.local_endpoint());
    let back = b.add_peer(&got.from).unwrap();
    b.send(back, b"v6 reply").unwrap();
    assert_eq!(recv_one(&mut a).payload, b"v6 reply");
}

#[test]
#[serial]
fn invalid_endpoints_are_rejected_with_clear_messages() {
    let mut a = loopback_channel();
    let cases: &[(&[u8], &str)] = &[
        (b"tcp://999.1.1.1:5", "\"999.1.1.1\" is not an IPv4 address"),
        (b"udp://127.0.0.1:5", "scheme must be tcp://"),
        (b"127.0.0.1:5", "scheme must be tcp://"),
        (b"tcp://127.0.0.1", "port is missing"),
        (b"tcp://127.0.0.1:0", "not 0"),
        (b"tcp://127.0.0.1:65536", "not a number in 1..65535"),
        (b"tcp://127.0.0.1:-1", "not a number"),
        (b"tcp://127.0.0.1:*", "not a number"),
        (b"tcp://::1:5", "must be bracketed"),
        (b"tcp://[::1:5", "no closing"),
        (b"tcp://[zz::1]:5", "not an IPv6 address"),
        (b"tcp://localhost:5", "host names are not accepted"),
        (b"tcp://0.0.0.0:5", "not a unicast address"),
        (b"tcp://[::]:5", "not a unicast address"),
        (b"tcp://224.0.0.1:5", "not a unicast address"),
        (b"tcp://255.255.255.255:5", "broadcast"),
        (b"", "scheme must be tcp://"),
        (b"tcp://\xff\xfe:5", "not UTF-8"),
    ];
    for (input, expected) in cases {
        let ep = Endpoint::from_bytes(*input);
        let err = a.add_peer(&ep).expect_err(&format!("{ep} was accepted"));
        let msg = err.to_string();
        assert!(matches!(err, ControlError::InvalidEndpoint { .. }), "{msg}");
        assert!(
            msg.contains("is not a valid tcp://<ip>:<port> address"),
            "{msg}"
        );
        assert!(
            msg.contains(expected),
            "message for {ep}: {msg:?} lacks {expected:?}"
        );
    }
    let long = format!("tcp://127.0.0.1:5{}", "0".repeat(300));
    assert!(a
        .add_peer(&Endpoint::from(long))
        .unwrap_err()
        .to_string()
        .contains("longer than 255"));
    assert_eq!(a.peer_count(), 0, "a rejected endpoint registered a peer");
    let first = a
        .add_peer(&Endpoint::from("tcp://999.1.1.1:5"))
        .unwrap_err()
        .to_string();
    assert!(
        first
            .starts_with("endpoint \"tcp://999.1.1.1:5\" is not a valid tcp://<ip>:<port> address"),
        "{first}"
    );
}

#[test]
#[serial]
fn bind_selection_prefers_a_routable_address() {
    let interfaces = interface_addresses().unwrap();
    let routable = interfaces.iter().any(|i| {
        i.up && !i.loopback
            && !i.ip.is_loopback()
            && !i.ip.is_unspecified()
            && !matches!(i.ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
    });
    let ip = BindSpec::auto().resolve().unwrap();
    if routable {
        assert!(
            !ip.is_loopback(),
            "auto-detection chose {ip} although {interfaces:?} has routable addresses"
        );
        assert!(
            interfaces.iter().any(|i| i.ip == ip),
            "{ip} is not an address of this host"
        );
        // And the channel really binds it.
        let ch = ZmqChannel::new(&BindSpec::auto(), ZmqConfig::default()).unwrap();
        assert_eq!(parse_tcp_endpoint(ch.local_endpoint()).unwrap().ip(), ip);
    } else {
        println!("SKIP (partly): this machine has no routable address; auto-detection chose {ip}");
        assert!(ip.is_loopback());
    }

    // A named interface: its address; an unknown one: an error naming it.
    if let Some(i) = interfaces
        .iter()
        .find(|i| i.up && !i.loopback && i.ip.is_ipv4())
    {
        assert_eq!(BindSpec::interface(i.name.clone()).resolve().unwrap(), i.ip);
    }
    let err = BindSpec::interface("nosuchif0")
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"nosuchif0\" does not exist"), "{err}");

    // Loopback only on request.
    let lo = interfaces
        .iter()
        .find(|i| i.loopback)
        .map(|i| i.name.clone())
        .unwrap_or_else(|| "lo".into());
    let err = BindSpec::interface(lo.clone())
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("refusing to bind loopback"), "{err}");
    let allowed = BindSpec {
        interface: Some(lo),
        allow_loopback: true,
        ..BindSpec::default()
    };
    assert!(allowed.resolve().unwrap().is_loopback());
    let explicit = BindSpec {
        address: Some("127.0.0.1".parse().unwrap()),
        allow_loopback: false,
        ..BindSpec::default()
    };
    assert!(explicit
        .resolve()
        .unwrap_err()
        .to_string()
        .contains("refusing to bind loopback"));
    let any = BindSpec::address("0.0.0.0".parse().unwrap());
    assert!(any
        .resolve()
        .unwrap_err()
        .to_string()
        .contains("cannot be advertised"));
}

#[test]
#[serial]
fn channels_are_usable_as_trait_objects() {
    let mut chans: Vec<Box<dyn ControlChannel>> =
        vec![Box::new(loopback_channel()), Box::new(loopback_channel())];
    let b_ep = chans[1].local_endpoint().clone();
    let h = chans[0].add_peer(&b_ep).unwrap();
    chans[0].send(h, b"dyn").unwrap();
    assert_eq!(recv_one(chans[1].as_mut()).payload, b"dyn");
    // Sendable to the reactor thread.
    let ch = chans.pop().unwrap();
    std::thread::spawn(move || drop(ch)).join().unwrap();
}
