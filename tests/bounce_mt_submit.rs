//! Multi-threaded submission into ONE engine: 8 application threads of one
//! initiator agent (NIXL thread-sync `Rw`, so NIXL lets them into the
//! engine concurrently) prepare and post bounce WRITEs to the same peer at
//! the same moment (a barrier), two requests each in flight, every thread
//! writing its own disjoint slice of the target's one registered buffer
//! from its own registered source buffer, with its own seed. Two rounds
//! with fresh data and layouts; the whole target buffer is checked
//! byte-exact after each round (no cross-talk, nothing outside the
//! destinations touched) and every request must have taken the bounce path.
//! Meanwhile another thread of the initiator registers and deregisters
//! memory: the requests are routed and planned at their first posts
//! (`prepare_at_post`), which read the registrations it changes.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use support::*;

const THREADS: usize = 8;
const PER_THREAD: usize = 2;
const DESCS: usize = 1024;
const ROUNDS: u64 = 2;

/// Blocks of one request's destination slice.
fn req_blocks() -> usize {
    blocks_for(DESCS)
}

/// Post every request at once, then poll them all to completion.
/// Returns each request's completion time since the post.
fn post_all_and_wait(node: &Node, reqs: &[nixl_sys::XferRequest]) -> Result<Vec<Duration>, String> {
    let t0 = Instant::now();
    for (i, r) in reqs.iter().enumerate() {
        post(node, r).map_err(|e| format!("request {i}: {e}"))?;
    }
    let mut done: Vec<Option<Duration>> = vec![None; reqs.len()];
    let mut spins = 0u64;
    while done.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate() {
            if done[i].is_none() && poll(node, r).map_err(|e| format!("request {i}: {e}"))? {
                done[i] = Some(t0.elapsed());
            }
        }
        if t0.elapsed() > wait_timeout() {
            return Err(format!(
                "requests still running after {:?}: {done:?}",
                wait_timeout()
            ));
        }
        pause(&mut spins);
    }
    Ok(done.into_iter().map(Option::unwrap).collect())
}

#[test]
#[serial_test::serial]
fn eight_threads_submit_to_one_engine() {
    if !ready("BOUNCE") {
        return;
    }
    run(&[LOOPBACK]);
}

#[test]
#[serial_test::serial]
fn eight_threads_submit_to_one_engine_small_arena() {
    if !ready("BOUNCE") {
        return;
    }
    // 16 requests of 16 chunks each compete for a 4 MiB arena on both
    // sides (grants are backpressure, gathers wait for space).
    run(&[
        LOOPBACK,
        ("arena_size_bytes", "4MiB"),
        ("max_chunk_size_bytes", "256KiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
    ]);
}

/// Registers and deregisters a small buffer on `node` until `posting` is
/// cleared, at least once; returns how many times.
fn registrations_while(node: &Node, posting: &AtomicBool) -> usize {
    let buf = DramBuffer::with_pattern(64 * 1024, 7);
    let mut n = 0;
    loop {
        drop(node.register(&buf).or_fail("register beside the posts"));
        n += 1;
        if !posting.load(Ordering::Acquire) {
            return n;
        }
    }
}

fn run(extra: &[(&str, &str)]) {
    let slice = PER_THREAD * req_blocks() * BLOCK;
    let init = node_with(&unique_name("mt-init"), extra, ThreadSync::Rw).or_fail("initiator");
    let mut target = endpoint("mt-target", extra, THREADS * slice, 1, ThreadSync::Default);
    pair_up(&init, &target.node);
    // One registered source buffer per thread (deregistered before freed:
    // the registration is dropped first).
    let mut srcs: Vec<DramBuffer> = (0..THREADS)
        .map(|t| DramBuffer::with_pattern(slice, 10 + t as u64))
        .collect();
    let regs: Vec<_> = srcs
        .iter()
        .map(|b| init.register(b).or_fail("register a source"))
        .collect();
    let tname = target.node.name.clone();

    for round in 0..ROUNDS {
        for (t, b) in srcs.iter_mut().enumerate() {
            b.fill_pattern(1000 * round + t as u64);
        }
        target.buf.fill_pattern(1000 * round + 999);
        let dst_before = target.buf.as_slice().to_vec();
        // plans[t][k]: thread t's request k, source slice k of its buffer,
        // destination slice (t, k) of the target's buffer.
        let plans: Vec<Vec<Plan>> = (0..THREADS)
            .map(|t| {
                (0..PER_THREAD)
                    .map(|k| {
                        let rb = req_blocks();
                        plan_in(
                            DESCS,
                            BLOCK,
                            k * rb * BLOCK,
                            rb,
                            (t * PER_THREAD + k) * rb * BLOCK,
                            rb,
                            100 * round + (t * PER_THREAD + k) as u64,
                        )
                    })
                    .collect()
            })
            .collect();
        let (si, st) = (stats(&init.name), stats(target.name()));
        let barrier = Barrier::new(THREADS);
        let posting = AtomicBool::new(true);
        let taddr = target.buf.addr();
        let (results, registered): (Vec<Result<Vec<Duration>, String>>, usize) =
            std::thread::scope(|s| {
                let registrar = s.spawn(|| registrations_while(&init, &posting));
                let handles: Vec<_> = (0..THREADS)
                    .map(|t| {
                        let (init, plans, srcs, barrier, tname) =
                            (&init, &plans, &srcs, &barrier, &tname);
                        s.spawn(move || -> Result<Vec<Duration>, String> {
                            // Prepared concurrently too.
                            let reqs = plans[t]
                                .iter()
                                .map(|p| {
                                    init.create_xfer(
                                        XferOp::Write,
                                        p,
                                        srcs[t].addr(),
                                        taddr,
                                        tname,
                                        None,
                                    )
                                })
                                .collect::<Result<Vec<_>, _>>()
                                .map_err(|e| format!("thread {t}: {e}"))?;
                            barrier.wait();
                            post_all_and_wait(init, &reqs).map_err(|e| format!("thread {t}: {e}"))
                        })
                    })
                    .collect();
                let results = handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
                    .collect();
                posting.store(false, Ordering::Release);
                (
                    results,
                    registrar.join().expect("the registering thread panicked"),
                )
            });
        eprintln!("round {round}: {registered} registrations beside the posts");
        for (t, r) in results.iter().enumerate() {
            match r {
                Ok(times) => eprintln!("round {round} thread {t}: completed after {times:?}"),
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        let src_copies: Vec<Vec<u8>> = srcs.iter().map(|b| b.as_slice().to_vec()).collect();
        let writes: Vec<(&Plan, &[u8])> = (0..THREADS)
            .flat_map(|t| plans[t].iter().map(move |p| (t, p)))
            .map(|(t, p)| (p, src_copies[t].as_slice()))
            .collect();
        let expected = expected_after(&dst_before, &writes);
        verify_all(&format!("round {round}"), &target.buf, &expected, &writes)
            .or_fail("target buffer");
        let n = (THREADS * PER_THREAD) as u64;
        let (ei, et) = (stats(&init.name), stats(target.name()));
        eprintln!("round {round}: {} ; {}", ei.diff(&si), et.diff(&st));
        assert_sender_bounced(&si, &ei, n);
        assert_receiver_scattered(&st, &et, ei.since(&si, "chunks_written"));
    }
    drop(regs);
}
