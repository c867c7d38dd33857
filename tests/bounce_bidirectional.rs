//! Bidirectional: two agents (NIXL thread-sync `Rw`), 8 threads on EACH
//! side, every thread writing 1024 scattered 4 KiB blocks from its own
//! slice of its agent's buffer into its own slice of the other agent's
//! buffer, all 16 started together (a barrier), repeated for several rounds
//! with fresh data and layouts. Each agent's buffer is half sources, half
//! destinations; after each round both whole buffers are checked
//! byte-exact, and the counters of both sides must show 8 bounce transfers
//! sent and scattered. Run with the default arena, and with 4 MiB arenas
//! where each side's arena is contended by its own gathers and the peer's
//! grants at once (the cycle the local reserve must break).
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use support::*;

const THREADS: usize = 8;
const DESCS: usize = 1024;

fn slice_blocks() -> usize {
    blocks_for(DESCS)
}

/// Offset of the out slice / in slice `t` in an agent's buffer.
fn out_off(t: usize) -> usize {
    t * slice_blocks() * BLOCK
}
fn in_off(t: usize) -> usize {
    (THREADS + t) * slice_blocks() * BLOCK
}

fn run(extra: &[(&str, &str)], rounds: u64, seed: u64) {
    let len = 2 * THREADS * slice_blocks() * BLOCK;
    let mut a = endpoint("bd-a", extra, len, seed, ThreadSync::Rw);
    let mut b = endpoint("bd-b", extra, len, seed + 1, ThreadSync::Rw);
    pair_up(&a.node, &b.node);
    for round in 0..rounds {
        let s = seed * 1000 + round * 100;
        a.buf.fill_pattern(s + 1);
        b.buf.fill_pattern(s + 2);
        let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
        let sb = slice_blocks();
        let a_plans: Vec<Plan> = (0..THREADS)
            .map(|t| {
                plan_in(
                    DESCS,
                    BLOCK,
                    out_off(t),
                    sb,
                    in_off(t),
                    sb,
                    s + 10 + t as u64,
                )
            })
            .collect();
        let b_plans: Vec<Plan> = (0..THREADS)
            .map(|t| {
                plan_in(
                    DESCS,
                    BLOCK,
                    out_off(t),
                    sb,
                    in_off(t),
                    sb,
                    s + 50 + t as u64,
                )
            })
            .collect();
        let (sa, sbb) = (stats(a.name()), stats(b.name()));
        let barrier = Barrier::new(2 * THREADS);
        let t0 = Instant::now();
        let results: Vec<Result<(String, Duration), String>> = std::thread::scope(|sc| {
            let mut hs = Vec::new();
            for (from, to, plans) in [(&a, &b, &a_plans), (&b, &a, &b_plans)] {
                for (t, plan) in plans.iter().enumerate().take(THREADS) {
                    let barrier = &barrier;
                    hs.push(sc.spawn(move || -> Result<(String, Duration), String> {
                        let who = format!("{} thread {t}", from.name());
                        let req = from
                            .node
                            .create_xfer(
                                XferOp::Write,
                                plan,
                                from.buf.addr(),
                                to.buf.addr(),
                                &to.node.name,
                                None,
                            )
                            .map_err(|e| format!("{who}: {e}"))?;
                        barrier.wait();
                        let dt = from
                            .node
                            .post_and_wait(&req, wait_timeout())
                            .map_err(|e| format!("{who}: {e}"))?;
                        Ok((who, dt))
                    }));
                }
            }
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
                .collect()
        });
        let wall = t0.elapsed();
        let mut times = Vec::new();
        for r in results {
            match r {
                Ok((who, dt)) => times.push(format!("{who}: {dt:.1?}")),
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        eprintln!("round {round} {extra:?}: 16 transfers in {wall:?}: {times:?}");
        let aw: Vec<(&Plan, &[u8])> = a_plans.iter().map(|p| (p, a_before.as_slice())).collect();
        let bw: Vec<(&Plan, &[u8])> = b_plans.iter().map(|p| (p, b_before.as_slice())).collect();
        // B holds A's blocks in its in-half, its out-half unchanged; and
        // the other way round.
        verify_all(
            &format!("round {round}: {}'s buffer", b.name()),
            &b.buf,
            &expected_after(&b_before, &aw),
            &aw,
        )
        .or_fail("B");
        verify_all(
            &format!("round {round}: {}'s buffer", a.name()),
            &a.buf,
            &expected_after(&a_before, &bw),
            &bw,
        )
        .or_fail("A");
        let (ea, eb) = (stats(a.name()), stats(b.name()));
        eprintln!("round {round}: {} ; {}", ea.diff(&sa), eb.diff(&sbb));
        assert_sender_bounced(&sa, &ea, THREADS as u64);
        assert_sender_bounced(&sbb, &eb, THREADS as u64);
        assert_receiver_scattered(&sa, &ea, eb.since(&sbb, "chunks_written"));
        assert_receiver_scattered(&sbb, &eb, ea.since(&sa, "chunks_written"));
    }
}

#[test]
#[serial_test::serial]
fn eight_threads_per_side_both_ways() {
    if !ready("BOUNCE") {
        return;
    }
    run(&[LOOPBACK], 3, 1);
}

#[test]
#[serial_test::serial]
fn eight_threads_per_side_both_ways_small_arenas() {
    if !ready("BOUNCE") {
        return;
    }
    run(
        &[
            LOOPBACK,
            ("arena_size_bytes", "4MiB"),
            ("max_chunk_size_bytes", "256KiB"),
            ("arena_allocation_granularity_bytes", "64KiB"),
        ],
        2,
        2,
    );
}
