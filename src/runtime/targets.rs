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
    pub fn admit_scatter(&self, runs: &[Run]) -> Result<InUse, Refused> {
        let mut t = self.inner.locked();
        let span = t.admits(runs)?;
        Ok(t.track(span))
    }

    /// Admits a gather (its sources must be registered memory: for a
    /// served READ they come from the network) and marks them in use,
    /// atomically with respect to deregistration.
    pub fn admit_gather(&self, runs: &[Run]) -> Result<InUse, Refused> {
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
        let token = t.admit_scatter(&[run(0x1100, 0x100, 1, 0)]).unwrap();
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
        let other = t.admit_gather(&[run(0x9000, 0x10, 1, 0)]).unwrap();
        assert!(
            t.admit_gather(&[run(0x9000, 0x10, 2, 0x100)]).is_err(),
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
            .admit_scatter(&[run(0x5800, 0x100, 1, 0), run(0x1000, 0x100, 1, 0)])
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
}
