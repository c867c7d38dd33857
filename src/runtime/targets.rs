//! The application memory copies may touch ([`ScatterTargets`]), and the
//! wait that lets deregistration return only once no copy touches it.

use super::*;

/// Why a copy's runs were refused: they reach outside the memory
/// registered with BOUNCE (the addresses came over the network).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("run {run} wraps around the address space")]
    Wraps { run: usize },
    #[error("run {run} touches [{start:#x}, {end:#x}), outside every memory region registered with BOUNCE")]
    Outside { run: usize, start: u64, end: u64 },
}

/// Application memory the copies may touch, and what they touch now.
///
/// The receiver scatters only into memory registered with this backend at
/// the instance's location (the check an RDMA key gives the standard path):
/// destinations arrive over the network. And since NIXL users may free a
/// buffer once `deregisterMem` returns, deregistration waits until no gather
/// or scatter still reads or writes that range.
#[derive(Debug, Default)]
pub struct ScatterTargets {
    inner: Mutex<Targets>,
    released: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Targets {
    /// Every registration, as (start, len); registrations may repeat.
    registered: Vec<(usize, usize)>,
    /// Their union as sorted, disjoint, non-adjacent [start, end) intervals.
    union: Vec<(u64, u64)>,
    /// Application ranges [start, end) of copies in flight, by token.
    in_use: HashMap<u64, (u64, u64)>,
    next_token: u64,
}

/// Marks one copy's application range as in use until it is returned with
/// [`ScatterTargets::release`].
#[derive(Debug)]
pub struct InUse(u64);

impl Targets {
    fn rebuild(&mut self) {
        let mut v: Vec<(u64, u64)> = self
            .registered
            .iter()
            .map(|&(a, l)| (a as u64, (a as u64).saturating_add(l as u64)))
            .collect();
        v.sort_unstable();
        let mut union: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match union.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => union.push((s, e)),
            }
        }
        self.union = union;
    }

    /// The interval of the union that holds [start, end), if one does.
    fn covering(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let i = self.union.partition_point(|&(s, _)| s <= start);
        (i > 0 && end <= self.union[i - 1].1).then(|| self.union[i - 1])
    }

    /// Whether [start, end) lies inside one interval of the union.
    fn covers(&self, start: u64, end: u64) -> bool {
        self.covering(start, end).is_some()
    }

    /// Checks `runs` (see [`ScatterTargets::admits`]) and returns the
    /// application range they span, [lowest start, highest end) ((0, 0)
    /// for none), in the same pass.
    fn admits(&self, runs: &[Run]) -> Result<(u64, u64), Refused> {
        // A request's runs mostly lie in one registration: the interval
        // that held the last run is tried before the search.
        let mut last = (1u64, 0u64); // empty
        let mut span = (u64::MAX, 0u64);
        for (i, run) in runs.iter().enumerate() {
            let end = run.addr_end().ok_or(Refused::Wraps { run: i })?;
            span = (span.0.min(run.addr), span.1.max(end));
            if last.0 <= run.addr && end <= last.1 {
                continue;
            }
            if let Some(interval) = self.covering(run.addr, end) {
                last = interval;
                continue;
            }
            for (_, addr, len) in run.copies() {
                let copy_end = addr.checked_add(len).ok_or(Refused::Wraps { run: i })?;
                if !self.covers(addr, copy_end) {
                    return Err(Refused::Outside {
                        run: i,
                        start: addr,
                        end: copy_end,
                    });
                }
            }
        }
        Ok(if runs.is_empty() { (0, 0) } else { span })
    }

    /// [`Targets::admits`] for a run list, read as packed copies when it
    /// is ([`Copies`](crate::proto::Copies)): the same verdict and span without building its runs
    /// (they are built only to word a refusal). A list's runs are all
    /// admitted exactly when every copy lies in registered memory.
    fn admits_list(&self, runs: &Runs) -> Result<(u64, u64), Refused> {
        let Some(c) = runs.copies().filter(|c| c.addresses_fit()) else {
            return self.admits(runs);
        };
        let len = c.copy_len();
        let mut last = (1u64, 0u64); // empty
        let mut span = (u64::MAX, 0u64);
        for &a in c.addrs() {
            // Fits: `addresses_fit`.
            let end = a + len;
            span = (span.0.min(a), span.1.max(end));
            if last.0 <= a && end <= last.1 {
                continue;
            }
            match self.covering(a, end) {
                Some(interval) => last = interval,
                None => return self.admits(runs),
            }
        }
        Ok(span)
    }

    /// Marks the application range [start, end) in use.
    fn track(&mut self, (start, end): (u64, u64)) -> InUse {
        self.next_token += 1;
        self.in_use.insert(self.next_token, (start, end));
        InUse(self.next_token)
    }
}

impl ScatterTargets {
    pub fn add(&self, addr: usize, len: usize) {
        let mut t = self.inner.locked();
        t.registered.push((addr, len));
        t.rebuild();
    }

    /// Forgets a registration, then waits (up to `bound`) until no copy in
    /// flight touches [addr, addr + len). Returns false if one still does.
    pub fn remove(&self, addr: usize, len: usize, bound: Duration) -> bool {
        let mut t = self.inner.locked();
        if let Some(i) = t.registered.iter().position(|&x| x == (addr, len)) {
            t.registered.swap_remove(i);
            t.rebuild();
        }
        let (lo, hi) = (addr as u64, (addr as u64).saturating_add(len as u64));
        let deadline = Instant::now() + bound;
        loop {
            if !t.in_use.values().any(|&(s, e)| s < hi && lo < e) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            t = crate::sync::wait_timeout(&self.released, t, left).0;
        }
    }

    /// Whether every copy of every run lands inside registered memory. A run
    /// whose whole span is registered passes at once; otherwise (a strided
    /// run over several registrations, or across a gap between them) each
    /// copy is checked on its own.
    pub fn admits(&self, runs: &[Run]) -> Result<(), Refused> {
        self.inner.locked().admits(runs).map(|_| ())
    }

    /// Admits a scatter and marks its destinations in use, atomically with
    /// respect to deregistration.
    pub fn admit_scatter(&self, runs: &Runs) -> Result<InUse, Refused> {
        let mut t = self.inner.locked();
        let span = t.admits_list(runs)?;
        Ok(t.track(span))
    }

    /// Admits a gather (its sources must be registered memory: for a
    /// served READ they come from the network) and marks them in use,
    /// atomically with respect to deregistration.
    pub fn admit_gather(&self, runs: &Runs) -> Result<InUse, Refused> {
        self.admit_scatter(runs)
    }

    /// The copy holding `token` is over.
    pub fn release(&self, token: InUse) {
        self.inner.locked().in_use.remove(&token.0);
        self.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(addr: u64, len: u64, count: u32, stride: u64) -> Run {
        Run {
            region_offset: 0,
            addr,
            len,
            count,
            region_stride: len,
            addr_stride: stride,
        }
    }

    #[test]
    fn deregistration_waits_for_copies_in_flight() {
        let t = Arc::new(ScatterTargets::default());
        t.add(0x1000, 0x1000);
        let token = t
            .admit_scatter(&Runs::from(vec![run(0x1100, 0x100, 1, 0)]))
            .unwrap();
        assert!(
            !t.remove(0x1000, 0x1000, Duration::from_millis(20)),
            "a scatter still writes there"
        );
        let t2 = t.clone();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            t2.release(token);
        });
        assert!(
            t.remove(0x1000, 0x1000, Duration::from_secs(5)),
            "released within the bound"
        );
        releaser.join().unwrap();
        t.add(0x9000, 0x100);
        let other = t
            .admit_gather(&Runs::from(vec![run(0x9000, 0x10, 1, 0)]))
            .unwrap();
        assert!(
            t.admit_gather(&Runs::from(vec![run(0x9000, 0x10, 2, 0x100)]))
                .is_err(),
            "a gather (a served READ's sources) outside registered memory is refused"
        );
        assert!(
            t.remove(0x1000, 0x1000, Duration::ZERO),
            "copies elsewhere do not hold it up"
        );
        t.release(other);
    }

    #[test]
    fn scatter_targets_admit_copies_inside_registered_memory_only() {
        let t = ScatterTargets::default();
        t.add(0x1000, 0x1000);
        t.add(0x2000, 0x1000); // adjacent: one interval [0x1000, 0x3000)
        t.add(0x5000, 0x1000); // gap [0x3000, 0x5000)
        assert!(
            t.admits(&[run(0x1800, 0x1000, 1, 0)]).is_ok(),
            "a copy across adjacent registrations"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 2, 0x4000)]).is_ok(),
            "strided copies on both sides of a gap"
        );
        assert!(
            t.admits(&[run(0x2f00, 0x200, 1, 0)]).is_err(),
            "a copy running into the gap"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 3, 0x2000)]).is_err(),
            "the middle copy lands in the gap"
        );
        assert!(
            t.admits(&[run(0x6000, 1, 1, 0)]).is_err(),
            "past the last registration"
        );
        assert!(t.admits(&[run(u64::MAX - 1, 4, 1, 0)]).is_err(), "wrapping");
        // Later runs are tried against the interval of the one before
        // first: that shortcut must not admit what leaves it.
        assert!(
            t.admits(&[run(0x1000, 0x100, 1, 0), run(0x5000, 0x100, 1, 0)])
                .is_ok(),
            "runs in two intervals"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 1, 0), run(0x2f00, 0x200, 1, 0)])
                .is_err(),
            "a run leaving the interval that held the run before"
        );
        assert!(
            t.admits(&[run(0x5000, 0x100, 1, 0), run(0x4f00, 0x200, 1, 0)])
                .is_err(),
            "a run starting before that interval"
        );
        // The range marked in use spans every run: deregistering any part
        // of it waits for the copy.
        let in_use = t
            .admit_scatter(&Runs::from(vec![
                run(0x5800, 0x100, 1, 0),
                run(0x1000, 0x100, 1, 0),
            ]))
            .expect("admitted");
        assert!(
            !t.remove(0x5000, 0x1000, Duration::ZERO),
            "the last run's registration"
        );
        t.add(0x5000, 0x1000);
        assert!(
            !t.remove(0x1000, 0x1000, Duration::ZERO),
            "the first run's registration"
        );
        t.add(0x1000, 0x1000);
        t.release(in_use);
        assert!(t.remove(0x2000, 0x1000, Duration::ZERO));
        assert!(
            t.admits(&[run(0x1800, 0x1000, 1, 0)]).is_err(),
            "after deregistration"
        );
    }

    /// Not a benchmark: what one 16 MiB chunk of 4096 scattered 4 KiB
    /// blocks costs the hosts' passes on the arena path, each alone and
    /// warm: the sender's check and table fill and its DATA's encoding; the
    /// receiver's decoding, checks and pair-table fill reading the DATA's
    /// packed copies, against the same passes over the runs the receiver
    /// built before (docs/design.md §4, "Runs the GPU reads as they
    /// arrive"); beside them one pass that reads the copies, checks each
    /// against the registration and writes an address list: the floor.
    /// `cargo test --release --lib chunk_passes_cost -- --ignored --nocapture`;
    /// with `CHUNK_PASSES_LAYOUT=vllm` the blocks are drawn as
    /// `bench/vllm_pattern.py` draws them, where a pair of neighbours in
    /// memory is common (the "as before" passes are then what such a chunk
    /// paid before the planner kept contiguous pairs as packed copies).
    #[test]
    #[ignore]
    fn chunk_passes_cost() {
        use crate::copy::cuda::{
            fill_pairs_from_copies, fill_table, table_capacity, table_parts, TableLayout,
        };
        use crate::copy::{Direction, RegionSpan};
        use crate::proto::plan::{build_from, Descriptor, PlanOptions};
        use crate::proto::receiver::{validate_run_list, validate_runs};
        use crate::proto::wire::Message;
        use crate::proto::{RegionHandle, RequestId, RunPool, Runs};
        use std::hint::black_box;
        use std::time::Instant;

        let (blocks, len) = (4096u64, 4096u64);
        let (src, dst) = (1u64 << 32, 1u64 << 40);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut shuffle = |order: &mut [u64]| {
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
        };
        // Block numbers on each side (in slots of 4 * blocks).
        let (src_blocks, dst_blocks): (Vec<u64>, Vec<u64>) =
            if std::env::var("CHUNK_PASSES_LAYOUT").as_deref() == Ok("vllm") {
                // vLLM's pattern (bench/vllm_pattern.py): per layer region
                // of 1024 cache blocks, 512 distinct ones in random order,
                // regions one after another: now and then two blocks in a
                // row are neighbours in memory.
                let mut side = || {
                    (0..blocks / 512)
                        .flat_map(|r| {
                            let mut pool: Vec<u64> = (0..1024).collect();
                            shuffle(&mut pool);
                            pool.truncate(512);
                            pool.into_iter().map(move |b| r * 1024 + b)
                        })
                        .collect()
                };
                (side(), side())
            } else {
                // Blocks taken from a shuffled free list four times larger.
                let mut order: Vec<u64> = (0..blocks * 4).collect();
                shuffle(&mut order);
                (
                    order[..blocks as usize].to_vec(),
                    order[blocks as usize..2 * blocks as usize].to_vec(),
                )
            };
        let descriptors = (0..blocks).map(|b| Descriptor {
            src_addr: src + src_blocks[b as usize] * len,
            src_dev: 0,
            dst_addr: dst + dst_blocks[b as usize] * len,
            dst_dev: 0,
            len,
        });
        let options = PlanOptions {
            max_chunk_bytes: blocks * len,
            merge_runs: true,
            min_chunks: 1,
            min_chunk_bytes: blocks * len,
        };
        let pool = RunPool::default();
        let plan_time = |pool: &RunPool| {
            let t = Instant::now();
            let plan = build_from(descriptors.clone(), options, pool).expect("planned");
            (t.elapsed().as_nanos(), plan)
        };
        let mut plan_best = u128::MAX;
        for _ in 0..200 {
            plan_best = plan_best.min(plan_time(&pool).0);
        }
        let plan = plan_time(&pool).1;
        assert_eq!(plan.chunks.len(), 1);
        let chunk = &plan.chunks[0];
        let targets = ScatterTargets::default();
        targets.add(src as usize, (blocks * 4 * len) as usize);
        targets.add(dst as usize, (blocks * 4 * len) as usize);
        let region = RegionSpan {
            addr: 1 << 44,
            len: (chunk.bytes) as usize,
        };
        let nruns = chunk.scatter_runs.len().max(chunk.gather_runs.len());
        let layout = TableLayout::new(nruns).expect("layout");
        let mut table = vec![0u64; table_capacity(nruns).expect("capacity").div_ceil(8)];
        let data = Message::Data {
            request: RequestId(1),
            chunk: 0,
            region: RegionHandle(0),
            runs: chunk.scatter_runs.clone(),
        };
        let bytes = data.encode();
        let rounds = 2000;
        let best = |f: &mut dyn FnMut()| {
            let mut best = u128::MAX;
            for _ in 0..rounds {
                let t = Instant::now();
                f();
                best = best.min(t.elapsed().as_nanos());
            }
            best as f64 / 1e3
        };
        let mut fill = |direction: Direction, runs: &[Run]| {
            let layout = TableLayout::new(runs.len()).expect("layout");
            // SAFETY: `table` holds table_capacity(nruns) bytes, 8-aligned,
            // and nothing else uses it.
            let (r, t, s) = unsafe { table_parts(table.as_mut_ptr() as *mut u8, &layout) };
            black_box(fill_table(direction, region, runs, 8192, 1 << 20, r, t, s).expect("filled"));
        };
        // The sender as before: its runs checked, tabled and encoded.
        let gather_check = best(&mut || {
            targets.admits(&chunk.gather_runs).expect("admitted");
        });
        let gather_fill = best(&mut || fill(Direction::Gather, &chunk.gather_runs));
        let runs_data = Message::Data {
            request: RequestId(1),
            chunk: 0,
            region: RegionHandle(0),
            runs: Runs::from(chunk.scatter_runs.to_vec()),
        };
        let encode_runs = best(&mut || {
            black_box(runs_data.encode());
        });
        // Now: the plan's packed copies.
        let gc = chunk
            .gather_runs
            .copies()
            .expect("the plan's gather copies");
        assert!(
            chunk.scatter_runs.copies().is_some(),
            "the plan's scatter copies"
        );
        let gather_check_copies = best(&mut || {
            black_box(
                targets
                    .inner
                    .locked()
                    .admits_list(&chunk.gather_runs)
                    .expect("admitted"),
            );
        });
        let mut gather_pairs = vec![0u64; 2 * gc.addrs().len()];
        let gather_fill_copies = best(&mut || {
            black_box(
                fill_pairs_from_copies(Direction::Gather, region, gc, &mut gather_pairs)
                    .expect("filled"),
            );
        });
        let encode = best(&mut || {
            black_box(data.encode());
        });
        // The same bytes as the runs', unless the plan holds contiguous
        // pairs of copies as runs twice as long: those the runs' encoding
        // writes in its general form, and a chunk with one had no copies
        // before the planner kept such pairs.
        let plain_bytes = runs_data.encode();
        let joined = plain_bytes != bytes;
        let mut decoded = None;
        let decode = best(&mut || decoded = Some(Message::decode(&bytes).expect("decoded")));
        let Some(Message::Data { runs, .. }) = decoded else {
            panic!("not a DATA")
        };
        let c = runs.copies().expect("decoded as packed copies");
        // As before: the runs built from the copies, checked and filled.
        let decode_build = best(&mut || {
            let Ok(Message::Data { runs, .. }) = Message::decode(&plain_bytes) else {
                panic!("not a DATA")
            };
            black_box(runs.len()); // the runs, built
        });
        let as_runs = chunk.scatter_runs.to_vec();
        let runs_check = best(&mut || {
            validate_runs(&as_runs, chunk.bytes).expect("valid");
            targets.admits(&as_runs).expect("admitted");
        });
        let runs_fill = best(&mut || fill(Direction::Scatter, &as_runs));
        // Now: the copies read as they arrived.
        let scatter_check = best(&mut || {
            validate_run_list(&runs, chunk.bytes).expect("valid");
            black_box(targets.inner.locked().admits_list(&runs).expect("admitted"));
        });
        let mut pairs = vec![0u64; 2 * c.addrs().len()];
        let scatter_fill = best(&mut || {
            black_box(
                fill_pairs_from_copies(Direction::Scatter, region, c, &mut pairs).expect("filled"),
            );
        });
        // The lower bound: one pass over the DATA's copies, each checked
        // against the registration and written to an address list.
        let copies: Vec<u64> = runs.iter().flat_map(|r| r.copies().map(|c| c.1)).collect();
        let entries: Vec<u8> = copies.iter().flat_map(|a| a.to_le_bytes()).collect();
        let mut list = vec![0u64; copies.len()];
        let (lo, hi) = (dst, dst + blocks * 4 * len);
        let one_pass = best(&mut || {
            let mut bad = false;
            for (out, e) in list.iter_mut().zip(entries.chunks_exact(8)) {
                let a = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                bad |= (a < lo) | (a.wrapping_add(len) > hi);
                *out = a;
            }
            assert!(!black_box(bad));
        });
        println!(
            "one chunk of {blocks} x {len} B: {} gather runs, {} scatter runs, DATA {} bytes ({} as runs{}), table {} bytes",
            chunk.gather_runs.len(),
            chunk.scatter_runs.len(),
            bytes.len(),
            plain_bytes.len(),
            if joined { ": contiguous pairs joined" } else { "" },
            layout.capacity
        );
        println!(
            "plan of the {blocks} descriptors (in the preparation): {:.1} us",
            plan_best as f64 / 1e3
        );
        println!(
            "sender, runs as before: check {gather_check:.1} us, fill {gather_fill:.1} us, encode {encode_runs:.1} us: {:.1} us",
            gather_check + gather_fill + encode_runs
        );
        println!(
            "sender, plan's copies:  check {gather_check_copies:.1} us, pair fill {gather_fill_copies:.1} us, encode {encode:.1} us: {:.1} us",
            gather_check_copies + gather_fill_copies + encode
        );
        println!(
            "receiver, runs as before: decode and build {decode_build:.1} us, check {runs_check:.1} us, fill {runs_fill:.1} us: {:.1} us",
            decode_build + runs_check + runs_fill
        );
        println!(
            "receiver, copies kept:    decode {decode:.1} us, check {scatter_check:.1} us, pair fill {scatter_fill:.1} us: {:.1} us",
            decode + scatter_check + scatter_fill
        );
        println!("one pass from the DATA's copies to an address list: {one_pass:.1} us");
    }

    proptest::proptest! {
        /// Admitting packed copies gives admitting their runs' verdict
        /// and span, whatever of them is registered.
        #[test]
        fn packed_copies_are_admitted_as_their_runs(
            c in crate::proto::testing::arb_copies(),
            regs in proptest::collection::vec((0..1u64 << 16, 1..1u64 << 15), 0..4),
        ) {
            let t = ScatterTargets::default();
            let base = crate::proto::testing::WINDOW.0;
            for (off, len) in regs {
                t.add((base + off) as usize, len as usize);
            }
            let list = Runs::from_copies(c);
            let runs = list.to_vec();
            let targets = t.inner.locked();
            proptest::prop_assert_eq!(targets.admits_list(&list), targets.admits(&runs));
        }
    }
}
