//! Peer liveness from heartbeats, for a control channel whose transport
//! says nothing about its connections (NIXL notifications: a notification to
//! a dead agent is simply never answered).
//!
//! Pure: events in (a peer watched, something heard from it), decisions out
//! (whom to PING now, who is unreachable), time passed in. The channel
//! ([`super::notif::NotifChannel`]) sends the PINGs, answers PINGs with
//! PONGs and reports what [`Heartbeats::unreachable`] returns.
//!
//! The rule, the ZMQ channel's in other words: every watched peer is PINGed
//! every quarter of the timeout; anything that arrives from it counts as
//! heard. A peer silent for the timeout after it was last heard, or never
//! heard for three timeouts since it was watched (perhaps only a slow start),
//! is unreachable until it is heard again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::PeerHandle;

/// How many timeouts a watched peer that was never heard from gets before it
/// is unreachable.
const NEVER_HEARD_TIMEOUTS: u32 = 3;

/// The liveness of the peers a channel watches.
#[derive(Debug)]
pub struct Heartbeats {
    timeout: Duration,
    watched: HashMap<PeerHandle, Watch>,
}

#[derive(Debug)]
struct Watch {
    since: Instant,
    heard: Option<Instant>,
    next_ping: Instant,
    /// Reported unreachable, and not heard since.
    reported: bool,
}

impl Watch {
    fn unreachable(&self, now: Instant, timeout: Duration) -> bool {
        match self.heard {
            Some(t) => now.saturating_duration_since(t) >= timeout,
            None => now.saturating_duration_since(self.since) >= timeout * NEVER_HEARD_TIMEOUTS,
        }
    }
}

impl Heartbeats {
    /// Tracks peers against `timeout` (non-zero).
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout: timeout.max(Duration::from_millis(1)),
            watched: HashMap::new(),
        }
    }

    /// The pause between two PINGs to one peer.
    pub fn interval(&self) -> Duration {
        self.timeout / 4
    }

    /// Starts watching `peer`, its first PING due at once. Watching a peer
    /// already watched changes nothing.
    pub fn watch(&mut self, peer: PeerHandle, now: Instant) {
        self.watched.entry(peer).or_insert(Watch {
            since: now,
            heard: None,
            next_ping: now,
            reported: false,
        });
    }

    /// Stops watching `peer` (it was removed).
    pub fn unwatch(&mut self, peer: PeerHandle) {
        self.watched.remove(&peer);
    }

    pub fn is_watched(&self, peer: PeerHandle) -> bool {
        self.watched.contains_key(&peer)
    }

    /// Something arrived from `peer`. Returns whether it had been reported
    /// unreachable (it is back).
    pub fn heard(&mut self, peer: PeerHandle, now: Instant) -> bool {
        match self.watched.get_mut(&peer) {
            Some(w) => {
                w.heard = Some(now);
                std::mem::take(&mut w.reported)
            }
            None => false,
        }
    }

    /// Starts every watched peer's silence again at `now`: the channel
    /// could hear nothing for a while (it was not polled), so a peer's
    /// silence until now proves nothing.
    pub fn excuse_all(&mut self, now: Instant) {
        for w in self.watched.values_mut() {
            match &mut w.heard {
                Some(t) => *t = (*t).max(now),
                None => w.since = w.since.max(now),
            }
        }
    }

    /// The peers to PING now; each is next due an interval later.
    pub fn due(&mut self, now: Instant) -> Vec<PeerHandle> {
        let interval = self.interval();
        let mut due = Vec::new();
        for (peer, w) in &mut self.watched {
            if w.next_ping <= now {
                w.next_ping = now + interval;
                due.push(*peer);
            }
        }
        due.sort();
        due
    }

    /// The earliest moment a PING is due, if any peer is watched.
    pub fn next_due(&self) -> Option<Instant> {
        self.watched.values().map(|w| w.next_ping).min()
    }

    /// The watched peers unreachable now, each with how long it has been
    /// silent when this is the first report of its outage (`None` on later
    /// reports of the same outage).
    pub fn unreachable(&mut self, now: Instant) -> Vec<(PeerHandle, Option<Duration>)> {
        let timeout = self.timeout;
        let mut down = Vec::new();
        for (peer, w) in &mut self.watched {
            if w.unreachable(now, timeout) {
                let first = !std::mem::replace(&mut w.reported, true);
                let silent = now.saturating_duration_since(w.heard.unwrap_or(w.since));
                down.push((*peer, first.then_some(silent)));
            }
        }
        down.sort();
        down
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(1000);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn handles(v: Vec<(PeerHandle, Option<Duration>)>) -> Vec<PeerHandle> {
        v.into_iter().map(|(p, _)| p).collect()
    }

    #[test]
    fn a_watched_peer_is_pinged_at_once_then_every_quarter_of_the_timeout() {
        let t0 = Instant::now();
        let (a, b) = (PeerHandle::new(1), PeerHandle::new(2));
        let mut h = Heartbeats::new(T);
        assert!(h.due(t0).is_empty() && h.next_due().is_none());
        h.watch(a, t0);
        assert_eq!(h.due(t0), vec![a]);
        assert!(h.due(t0 + ms(249)).is_empty());
        assert_eq!(h.next_due(), Some(t0 + ms(250)));
        h.watch(b, t0 + ms(100));
        h.watch(a, t0 + ms(100)); // already watched: its schedule stands
        assert_eq!(h.due(t0 + ms(100)), vec![b]);
        assert_eq!(h.due(t0 + ms(250)), vec![a]);
        assert_eq!(h.due(t0 + ms(400)), vec![b]);
        h.unwatch(a);
        assert!(!h.is_watched(a) && h.is_watched(b));
        assert!(h.due(t0 + ms(1000)) == vec![b]);
    }

    #[test]
    fn a_peer_silent_for_the_timeout_is_unreachable_until_heard_again() {
        let t0 = Instant::now();
        let p = PeerHandle::new(7);
        let mut h = Heartbeats::new(T);
        h.watch(p, t0);
        assert!(!h.heard(p, t0 + ms(10)));
        assert!(h.unreachable(t0 + ms(1009)).is_empty());
        // First report names the silence; the next reports of the same
        // outage do not (the channel logs once).
        assert_eq!(h.unreachable(t0 + ms(1010)), vec![(p, Some(ms(1000)))]);
        assert_eq!(h.unreachable(t0 + ms(1500)), vec![(p, None)]);
        assert!(h.heard(p, t0 + ms(1600)), "it was reported: it is back");
        assert!(h.unreachable(t0 + ms(2599)).is_empty());
        assert_eq!(handles(h.unreachable(t0 + ms(2600))), vec![p]);
    }

    #[test]
    fn a_channel_that_could_not_listen_gives_every_peer_a_new_timeout() {
        let t0 = Instant::now();
        let (heard, never) = (PeerHandle::new(1), PeerHandle::new(2));
        let mut h = Heartbeats::new(T);
        h.watch(heard, t0);
        h.watch(never, t0);
        h.heard(heard, t0 + ms(100));
        // Deaf from 200 ms to 5 s: nothing they sent could be read.
        h.excuse_all(t0 + ms(5000));
        assert!(h.unreachable(t0 + ms(5999)).is_empty());
        assert_eq!(handles(h.unreachable(t0 + ms(6000))), vec![heard]);
        assert_eq!(handles(h.unreachable(t0 + ms(8000))), vec![heard, never]);
    }

    #[test]
    fn a_peer_never_heard_from_gets_three_timeouts() {
        let t0 = Instant::now();
        let p = PeerHandle::new(3);
        let mut h = Heartbeats::new(T);
        h.watch(p, t0);
        assert!(h.unreachable(t0 + ms(2999)).is_empty());
        assert_eq!(h.unreachable(t0 + ms(3000)), vec![(p, Some(ms(3000)))]);
        // Unwatched peers are never reported; heard-from unknowns ignored.
        h.unwatch(p);
        assert!(h.unreachable(t0 + ms(9000)).is_empty());
        assert!(!h.heard(p, t0 + ms(9000)));
    }
}
