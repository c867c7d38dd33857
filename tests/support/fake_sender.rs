//! A sender that is not a NIXL agent: the library's own control channel of
//! the receiver's kind (ZMQ or direct TCP) speaking the bounce wire
//! protocol (`nixl_bounce::proto::wire`) to a receiver's control endpoint
//! (read both with `bounce::handshake_of`). For tests of the receiver's
//! behaviour towards a misbehaving or silent peer (`support::fake_sender`).
#![allow(dead_code)]

use nixl_bounce::control::{
    BindSpec, ControlChannel, PeerHandle, TcpChannel, TcpConfig, ZmqChannel, ZmqConfig,
};
use nixl_bounce::proto::wire::{ControlKind, Message, StandingUse};
use nixl_bounce::proto::{RegionHandle, RequestId, Run};
use std::cell::RefCell;
use std::time::{Duration, Instant};

pub const WAIT: Duration = Duration::from_secs(10);

/// A sender that is not a NIXL agent: a channel bound on loopback, which
/// names its own endpoint on everything it sends (as the engine's does).
pub struct FakeSender {
    channel: RefCell<Box<dyn ControlChannel>>,
    receiver: PeerHandle,
    pub endpoint: String,
    /// The access key this client puts in its WANTs (the receiver's own for
    /// a client that loaded its metadata, anything else for a stranger).
    pub key: u64,
    next_request: u64,
}

impl FakeSender {
    /// A client of the receiver at `receiver_endpoint`, whose handshake says
    /// it uses control `kind`.
    pub fn new(receiver_endpoint: &str, key: u64, kind: ControlKind) -> Self {
        let bind = BindSpec::loopback();
        let mut channel: Box<dyn ControlChannel> = match kind {
            ControlKind::Zmq => Box::new(ZmqChannel::new(&bind, ZmqConfig::default()).unwrap()),
            ControlKind::Tcp => Box::new(TcpChannel::new(&bind, TcpConfig::default()).unwrap()),
            ControlKind::NixlNotif => {
                panic!("a fake sender over NIXL notifications is not built")
            }
        };
        let endpoint = channel.local_endpoint().as_str().unwrap().to_string();
        let receiver = channel
            .add_peer(&receiver_endpoint.into())
            .expect("the receiver's control endpoint");
        FakeSender {
            channel: RefCell::new(channel),
            receiver,
            endpoint,
            key,
            next_request: 0x00F0_0000_0000_0000 + std::process::id() as u64 * 1000,
        }
    }

    pub fn send(&self, m: &Message) {
        self.channel
            .borrow_mut()
            .send(self.receiver, &m.encode())
            .expect("send to the receiver");
    }

    /// The next message from the receiver (bounded wait).
    pub fn recv(&self, what: &str) -> Message {
        self.recv_within(what, WAIT)
    }

    /// The next message from the receiver within `limit` (panics after).
    pub fn recv_within(&self, what: &str, limit: Duration) -> Message {
        self.quiet_for(limit)
            .unwrap_or_else(|| panic!("fake sender: no {what} from the receiver within {limit:?}"))
    }

    /// The next message within `d`, if any.
    pub fn quiet_for(&self, d: Duration) -> Option<Message> {
        let t0 = Instant::now();
        loop {
            let left = d.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return None;
            }
            let got = self
                .channel
                .borrow_mut()
                .recv(left.min(Duration::from_millis(10)))
                .expect("receive from the receiver");
            if let Some(incoming) = got {
                return Some(
                    Message::decode(&incoming.payload)
                        .unwrap_or_else(|e| panic!("undecodable message from the receiver: {e}")),
                );
            }
        }
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
            standing: StandingUse::None,
            incarnation: 0,
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
