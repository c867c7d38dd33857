//! A sender that is not a NIXL agent: raw ZMQ sockets speaking the bounce
//! wire protocol (`nixl_bounce::proto::wire`) to a receiver's control
//! endpoint (read it with `bounce::handshake_of`). For tests of the
//! receiver's behaviour towards a misbehaving or silent peer.
//!
//! Include after `common` and `bounce`:
//! `#[path = "support/fake_sender.rs"] mod fake_sender;`
#![allow(dead_code)]

use nixl_bounce::proto::wire::Message;
use nixl_bounce::proto::{RegionHandle, RequestId, Run};
use std::time::{Duration, Instant};

pub const WAIT: Duration = Duration::from_secs(10);

/// A sender that is not a NIXL agent: a ROUTER to hear replies and a DEALER
/// (routing id = our own endpoint, as the real channel does) to talk.
pub struct FakeSender {
    _ctx: zmq::Context,
    router: zmq::Socket,
    dealer: zmq::Socket,
    pub endpoint: String,
    /// The access key this client puts in its WANTs (the receiver's own for
    /// a client that loaded its metadata, anything else for a stranger).
    pub key: u64,
    next_request: u64,
}

impl FakeSender {
    pub fn new(receiver_endpoint: &str, key: u64) -> Self {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        router
            .bind("tcp://127.0.0.1:*")
            .expect("bind the fake sender's ROUTER on loopback");
        let endpoint = router.get_last_endpoint().unwrap().unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_linger(0).unwrap();
        dealer.set_identity(endpoint.as_bytes()).unwrap();
        dealer.connect(receiver_endpoint).unwrap();
        FakeSender {
            _ctx: ctx,
            router,
            dealer,
            endpoint,
            key,
            next_request: 0x00F0_0000_0000_0000 + std::process::id() as u64 * 1000,
        }
    }

    pub fn send(&self, m: &Message) {
        self.dealer
            .send(m.encode(), 0)
            .expect("send to the receiver");
    }

    /// The next message from the receiver (bounded wait).
    pub fn recv(&self, what: &str) -> Message {
        self.recv_within(what, WAIT)
    }

    /// The next message from the receiver within `limit` (panics after).
    pub fn recv_within(&self, what: &str, limit: Duration) -> Message {
        let t0 = Instant::now();
        loop {
            let left = limit.saturating_sub(t0.elapsed());
            if left.is_zero() {
                panic!("fake sender: no {what} from the receiver within {limit:?}");
            }
            if self
                .router
                .poll(zmq::POLLIN, left.as_millis() as i64)
                .unwrap()
                > 0
            {
                let frames = self.router.recv_multipart(0).unwrap();
                assert_eq!(
                    frames.len(),
                    2,
                    "expected [routing id, message], got {} frames",
                    frames.len()
                );
                return Message::decode(&frames[1])
                    .unwrap_or_else(|e| panic!("undecodable message from the receiver: {e}"));
            }
        }
    }

    /// The next message within `d`, if any.
    pub fn quiet_for(&self, d: Duration) -> Option<Message> {
        if self.router.poll(zmq::POLLIN, d.as_millis() as i64).unwrap() > 0 {
            let frames = self.router.recv_multipart(0).unwrap();
            return Message::decode(&frames[1]).ok();
        }
        None
    }

    /// Sends a WANT for one chunk of `len` bytes and returns its request id
    /// without waiting for the reply.
    pub fn send_want(&mut self, len: u64) -> RequestId {
        self.next_request += 1;
        let request = RequestId(self.next_request);
        self.send(&Message::Want {
            request,
            chunk_sizes: vec![len],
            endpoint: self.endpoint.as_bytes().to_vec(),
            key: self.key,
        });
        request
    }

    /// WANT one chunk of `len` bytes; returns (request, granted region, granted length).
    pub fn want(&mut self, len: u64) -> (RequestId, RegionHandle, u64) {
        let request = self.send_want(len);
        match self.recv("GRANT") {
            Message::Grant {
                request: r,
                credits,
            } => {
                assert_eq!(r, request, "GRANT for another request");
                assert_eq!(credits.len(), 1, "{credits:?}");
                assert_eq!(credits[0].chunk, 0);
                assert!(credits[0].len >= len, "{credits:?}");
                (request, credits[0].region, credits[0].len)
            }
            other => panic!("expected a GRANT, got {other:?}"),
        }
    }

    pub fn data(&self, request: RequestId, region: RegionHandle, runs: Vec<Run>) {
        self.send(&Message::Data {
            request,
            chunk: 0,
            region,
            runs: runs.into(),
        });
    }

    pub fn cancel(&self, request: RequestId) {
        self.send(&Message::cancel(
            request,
            self.endpoint.as_bytes().to_vec(),
            self.key,
        ));
    }
}
