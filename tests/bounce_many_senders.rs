//! Many senders into one receiver at once: 4 sender agents, each driven by
//! its own thread, each posting 4 bounce WRITEs (2048 scattered 4 KiB blocks
//! each, its own seeds) into its own disjoint slices of the receiver's one
//! registered buffer. All 16 requests are posted before the first one
//! completes (checked). The receiver's 4 MiB arena (256 KiB chunks) cannot
//! hold them all, so the senders compete for its credits.
//!
//! Checked: the receiver's whole buffer byte-exact (no cross-talk between
//! senders, nothing outside the destinations touched), every request
//! succeeded through the bounce path, the receiver scattered exactly the
//! chunks the senders wrote, and completion is fair: no sender is served
//! ahead of the others (every sender finishes after at least half the
//! slowest sender's time; the completion order is printed).
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::sync::Barrier;
use std::time::Instant;
use support::*;

const SENDERS: usize = 4;
const REQS: usize = 4;
const DESCS: usize = 2048;
const ROUNDS: u64 = 2;
const EXTRA: &[(&str, &str)] = &[
    LOOPBACK,
    ("arena_size_bytes", "4MiB"),
    ("max_chunk_size_bytes", "256KiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
];

fn rb() -> usize {
    blocks_for(DESCS)
}

/// (sender, request, posted at, completed at)
type Event = (usize, usize, Instant, Instant);

#[test]
#[serial_test::serial]
fn four_senders_into_one_receiver() {
    if !ready("BOUNCE") {
        return;
    }
    let slice = rb() * BLOCK;
    let mut rx = endpoint(
        "ms-rx",
        EXTRA,
        SENDERS * REQS * slice,
        1,
        ThreadSync::Default,
    );
    let mut senders: Vec<Endpoint> = (0..SENDERS)
        .map(|s| {
            endpoint(
                &format!("ms-tx{s}"),
                EXTRA,
                REQS * slice,
                10 + s as u64,
                ThreadSync::Default,
            )
        })
        .collect();
    for s in &senders {
        pair_up(&s.node, &rx.node);
    }
    let rname = rx.node.name.clone();
    for round in 0..ROUNDS {
        let base = 10_000 * (round + 1);
        for (s, ep) in senders.iter_mut().enumerate() {
            ep.buf.fill_pattern(base + s as u64);
        }
        rx.buf.fill_pattern(base + 99);
        let rx_before = rx.buf.as_slice().to_vec();
        let src_before: Vec<Vec<u8>> = senders.iter().map(|e| e.buf.as_slice().to_vec()).collect();
        // plans[s][k]: sender s, request k: its source slice k -> the
        // receiver's slice (s, k).
        let plans: Vec<Vec<Plan>> = (0..SENDERS)
            .map(|s| {
                (0..REQS)
                    .map(|k| {
                        plan_in(
                            DESCS,
                            BLOCK,
                            k * slice,
                            rb(),
                            (s * REQS + k) * slice,
                            rb(),
                            base + (s * REQS + k) as u64,
                        )
                    })
                    .collect()
            })
            .collect();
        let before: Vec<Counters> = senders.iter().map(|e| stats(e.name())).collect();
        let rx_stats = stats(&rname);
        let barrier = Barrier::new(SENDERS);
        let raddr = rx.buf.addr();
        let results: Vec<Result<Vec<Event>, String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = senders
                .iter()
                .enumerate()
                .map(|(s, ep)| {
                    let (plans, barrier, rname) = (&plans, &barrier, &rname);
                    sc.spawn(move || -> Result<Vec<Event>, String> {
                        let reqs = plans[s]
                            .iter()
                            .map(|p| {
                                ep.node.create_xfer(
                                    XferOp::Write,
                                    p,
                                    ep.buf.addr(),
                                    raddr,
                                    rname,
                                    None,
                                )
                            })
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(|e| format!("sender {s}: {e}"))?;
                        barrier.wait();
                        let mut posted = Vec::new();
                        for r in &reqs {
                            post(&ep.node, r).map_err(|e| format!("sender {s}: {e}"))?;
                            posted.push(Instant::now());
                        }
                        let mut done: Vec<Option<Instant>> = vec![None; reqs.len()];
                        let t0 = Instant::now();
                        let mut spins = 0u64;
                        while done.iter().any(Option::is_none) {
                            for (k, r) in reqs.iter().enumerate() {
                                if done[k].is_none()
                                    && poll(&ep.node, r)
                                        .map_err(|e| format!("sender {s} request {k}: {e}"))?
                                {
                                    done[k] = Some(Instant::now());
                                }
                            }
                            if t0.elapsed() > wait_timeout() {
                                return Err(format!(
                                    "sender {s}: requests still running after {:?}: {done:?}",
                                    wait_timeout()
                                ));
                            }
                            pause(&mut spins);
                        }
                        Ok((0..reqs.len())
                            .map(|k| (s, k, posted[k], done[k].unwrap()))
                            .collect())
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("sender thread panicked".into()))
                })
                .collect()
        });
        let mut events: Vec<Event> = Vec::new();
        for r in results {
            events.extend(r.unwrap_or_else(|e| panic!("round {round}: {e}")));
        }
        events.sort_by_key(|e| e.3);
        let t_first_post = events.iter().map(|e| e.2).min().unwrap();
        let order: Vec<String> = events
            .iter()
            .map(|(s, k, _, d)| format!("s{s}r{k}@{:.0?}", d.duration_since(t_first_post)))
            .collect();
        eprintln!("round {round}: completion order {order:?}");

        // Byte-exact: the receiver's whole buffer, every sender's source.
        let writes: Vec<(&Plan, &[u8])> = (0..SENDERS)
            .flat_map(|s| plans[s].iter().map(move |p| (s, p)))
            .map(|(s, p)| (p, src_before[s].as_slice()))
            .collect();
        verify_all(
            &format!("round {round}: receiver"),
            &rx.buf,
            &expected_after(&rx_before, &writes),
            &writes,
        )
        .or_fail("receiver buffer");
        for (s, ep) in senders.iter().enumerate() {
            verify_bytes(ep.buf.as_slice(), &src_before[s], |_| "source".into())
                .or_fail(&format!("sender {s} source changed"));
        }

        // All in flight at once.
        let last_post = events.iter().map(|e| e.2).max().unwrap();
        let first_done = events[0].3;
        assert!(
            last_post < first_done,
            "round {round}: the last request was posted {:?} after the first completed: not all in flight at once",
            last_post.duration_since(first_done)
        );
        // Fairness. With equal demand and round-robin credits every flow
        // advances at the same pace, so all requests finish close to the
        // end and the order of those last completions is noise; what must
        // not happen is one sender being served first (finishing all its
        // requests while the others are far from done). So: every sender's
        // last completion comes after at least half of the slowest
        // sender's time (served one after another, the first of 4 senders
        // would finish at about a quarter).
        let t_start = last_post;
        let finish: Vec<f64> = (0..SENDERS)
            .map(|s| {
                events
                    .iter()
                    .filter(|e| e.0 == s)
                    .map(|e| e.3)
                    .max()
                    .unwrap()
                    .duration_since(t_start)
                    .as_secs_f64()
            })
            .collect();
        let slowest = finish.iter().cloned().fold(0.0, f64::max);
        eprintln!("round {round}: per-sender finish times after the last post (s): {finish:.3?}");
        for (s, f) in finish.iter().enumerate() {
            assert!(
                *f >= 0.5 * slowest,
                "round {round}: sender {s} finished all its requests after {f:.3} s, the slowest sender after {slowest:.3} s: unfair service; order {order:?}"
            );
        }

        // Counters: each sender 4 bounce transfers; the receiver scattered
        // exactly what they wrote.
        let mut written = 0;
        for (s, ep) in senders.iter().enumerate() {
            let after = stats(ep.name());
            eprintln!("round {round}: {}", after.diff(&before[s]));
            assert_sender_bounced(&before[s], &after, REQS as u64);
            written += after.since(&before[s], "chunks_written");
        }
        let rx_after = stats(&rname);
        eprintln!("round {round}: {}", rx_after.diff(&rx_stats));
        assert_receiver_scattered(&rx_stats, &rx_after, written);
        assert_eq!(
            rx_after.since(&rx_stats, "chunks_scattered"),
            written,
            "receiver scattered != chunks written"
        );
        // Every chunk was granted, or written into its sender's standing
        // slot (claimed by its WANT), exactly once.
        assert_eq!(
            rx_after.since(&rx_stats, "grants")
                + rx_after.since(&rx_stats, "bounce_standing_taken"),
            written,
            "grants and standing chunks != chunks written"
        );
    }
}
