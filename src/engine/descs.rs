//! A transfer's two descriptor lists as NIXL hands them over, and their
//! check: every descriptor inside a registered region, the lists paired,
//! the facts a route needs gathered on the way.

use super::*;
use std::sync::atomic::{AtomicBool, AtomicUsize};

/// The [`Md`] of a descriptor's (non-null) backend metadata, or null
/// (callable from several threads at once: the shim's resolver only reads
/// its metadata table; bounce_ffi.h says so).
pub type MdResolver<'a> = &'a (dyn Fn(*const std::ffi::c_void) -> *const Md + Sync);

/// One side of a transfer as NIXL hands it over: its descriptor array, read
/// in place (no copy per descriptor), its memory kind and the way to its
/// descriptors' metadata. Nothing is checked yet: [`Engine::check`] makes a
/// [`Side`] of it, and the peer-mapped path's one-pass table
/// (`ipc::walk_pairs`) checks as it goes.
#[derive(Clone, Copy)]
pub struct Descs<'a> {
    pub kind: MemKind,
    pub(super) raw: &'a [RawDesc],
    pub(super) resolve: MdResolver<'a>,
}

impl<'a> Descs<'a> {
    /// # Safety
    /// `resolve` of every non-null `md` in `raw` is null or points to an
    /// [`Md`] that lives for `'a` (its magic is checked before anything
    /// else).
    pub unsafe fn new(kind: MemKind, raw: &'a [RawDesc], resolve: MdResolver<'a>) -> Self {
        Self { kind, raw, resolve }
    }

    pub fn len(&self) -> usize {
        self.raw.len()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn raw(&self) -> &'a [RawDesc] {
        self.raw
    }

    /// The live BOUNCE metadata behind a descriptor's (non-null) handle;
    /// `None` for null or a pointer that is not BOUNCE's.
    pub fn md(&self, p: *const std::ffi::c_void) -> Option<&'a Md> {
        if p.is_null() {
            return None;
        }
        // SAFETY: `new`'s contract: null or an `Md`; the magic is read
        // before the rest.
        let md = unsafe { (self.resolve)(p).as_ref() }?;
        md.is_valid().then_some(md)
    }
}

/// One side's checks, one descriptor at a time: its metadata is a live
/// BOUNCE handle (checked once per run of equal handles: consecutive
/// descriptors mostly share one), it does not wrap around the address
/// space, and it lies inside the memory NIXL resolved it to (NIXL checks
/// this too; a failure means NIXL and this plugin disagree about the
/// layout).
pub(super) struct SideCheck<'a, 'k> {
    pub(super) which: &'static str,
    pub(super) descs: Descs<'a>,
    /// The handle of the run under way (`None` before the first).
    pub(super) handle: Option<*const std::ffi::c_void>,
    /// Its region (`None`: a null handle).
    pub(super) region: Option<Region<'a>>,
    /// The regions the last preparation met, in order, when kept.
    pub(super) kept: Option<ipc::Cursor<'k, KeptRegion>>,
}

impl<'a, 'k> SideCheck<'a, 'k> {
    pub(super) fn new(
        which: &'static str,
        descs: Descs<'a>,
        kept: Option<&'k mut Vec<(usize, KeptRegion)>>,
    ) -> Self {
        SideCheck {
            which,
            descs,
            handle: None,
            region: None,
            kept: kept.map(ipc::Cursor::new),
        }
    }

    /// The region behind handle `p` (not null) of descriptor `i`: kept
    /// from the last preparation when it met the same handle at this
    /// point, else resolved (and kept).
    pub(super) fn region(&mut self, i: usize, p: *const std::ffi::c_void) -> Result<Region<'a>> {
        if let Some(k) = self.kept.as_mut().and_then(|c| c.hit(p)) {
            // SAFETY: the shim forgets the kept regions under its table's
            // writer lock before a handle leaves the table (and so before
            // its `Md` is freed: `Engine::forget_regions`), and a
            // preparation holds the reader lock for the engine's whole
            // call: a kept region is one the table holds, alive for `'a`.
            let md = unsafe { &*(k.md as *const Md) };
            return Ok(Region {
                md,
                range: k.range,
                path: k.path,
            });
        }
        let md = self.descs.md(p).ok_or_else(|| {
            Error::new(
                Status::Mismatch,
                format!("{} descriptor {i} carries metadata that is not one of this BOUNCE engine's registrations or loaded regions", self.which),
            )
        })?;
        let region = Region::of(md, self.which == "local");
        if let Some(c) = self.kept.as_mut() {
            c.keep(
                p,
                KeptRegion {
                    md: md as *const Md as usize,
                    range: region.range,
                    path: region.path,
                },
            );
        }
        Ok(region)
    }

    /// Checks descriptor `i`; at the first of a run of equal handles, the
    /// run's region (inner `None`: a null handle).
    pub(super) fn step(&mut self, i: usize, d: &RawDesc) -> Result<Option<Option<Region<'a>>>> {
        let which = self.which;
        let range = d.range();
        if range.end().is_none() {
            return Err(Error::invalid(format!(
                "{which} descriptor {i} wraps around the address space"
            )));
        }
        let mut run = None;
        if self.handle != Some(d.md) {
            self.region = match d.md.is_null() {
                true => None,
                false => Some(self.region(i, d.md)?),
            };
            self.handle = Some(d.md);
            run = Some(self.region);
        }
        if let Some(r) = self.region {
            let region = r.range;
            if range.len > 0 && !region.covers(&range) {
                return Err(Error::invalid(format!(
                    "{which} descriptor {i} ({} bytes at {:#x}, device {}) lies outside its registered region ({} bytes at {:#x}, device {})",
                    range.len, range.addr, range.dev, region.len, region.addr, region.dev
                )));
            }
        }
        Ok(run)
    }
}

/// Whether every item seen is the same one.
pub(super) enum Same<T> {
    Unseen,
    All(T),
    Not,
}

impl<T: Copy> Same<T> {
    pub(super) fn see(&mut self, item: Option<T>, same: impl Fn(&T, &T) -> bool) {
        *self = match (&*self, item) {
            (Same::Unseen, Some(t)) => Same::All(t),
            (Same::All(a), Some(t)) if same(a, &t) => Same::All(*a),
            _ => Same::Not,
        };
    }

    pub(super) fn get(&self) -> Option<T> {
        match self {
            Same::All(t) => Some(*t),
            _ => None,
        }
    }

    /// What seeing these items and then `next`'s gives.
    pub(super) fn then(self, next: Same<T>, same: impl Fn(&T, &T) -> bool) -> Same<T> {
        match (self, next) {
            (Same::Unseen, x) | (x, Same::Unseen) => x,
            (Same::All(a), Same::All(b)) if same(&a, &b) => Same::All(a),
            _ => Same::Not,
        }
    }
}

/// What a check reads of a run's region: its range, and the path it
/// belongs to (its bounce instance, or the peer's arena), as an identity.
#[derive(Clone, Copy)]
pub(super) struct Region<'a> {
    pub(super) md: &'a Md,
    pub(super) range: Range,
    /// The address of the local region's bounce instance or the remote
    /// region's peer arena; 0: none.
    pub(super) path: usize,
}

impl<'a> Region<'a> {
    /// A region of the local side (its path: its bounce instance) or of the
    /// remote side (the peer's arena).
    pub(super) fn of(md: &'a Md, local: bool) -> Self {
        let path = match local {
            true => md.instance().map_or(0, |b| Arc::as_ptr(b) as usize),
            false => md.arena().map_or(0, |p| Arc::as_ptr(p) as usize),
        };
        Region {
            md,
            range: md.range,
            path,
        }
    }

    /// Whether two local regions have one bounce instance.
    pub(super) fn same_instance(a: &Self, b: &Self) -> bool {
        a.path == b.path
    }

    /// Whether two remote regions have one peer arena: the same `Arc` when
    /// they came from one remote agent (`Engine::admit_peer_instance`
    /// shares equal ones), compared in full otherwise.
    pub(super) fn same_arena(a: &Self, b: &Self) -> bool {
        a.path == b.path || a.md.arena() == b.md.arena()
    }
}

/// A [`Region`] as kept between preparations ([`KeptRegions`]).
#[derive(Clone, Copy)]
pub struct KeptRegion {
    pub(super) md: usize,
    pub(super) range: Range,
    pub(super) path: usize,
}

/// The regions the last arena preparation's check met, each side's in the
/// order met, kept so that the next one, which mostly meets the same
/// regions in the same order (vLLM's lists are region-major), reads its
/// runs' regions from two short arrays instead of resolving each through
/// the shim's table and reading its metadata, cold after a transfer: two
/// to four cache misses per run, 64 runs of 512 descriptors in vLLM's
/// 128-token READ. Forgotten whenever any region is released.
#[derive(Default)]
pub struct KeptRegions {
    pub(super) local: Vec<(usize, KeptRegion)>,
    pub(super) remote: Vec<(usize, KeptRegion)>,
}

/// What a pass over pairs of both lists found beside its checks: whether
/// every local region has one bounce instance and every remote one one
/// peer arena, and the plan's survey.
pub(super) struct Facts<'a> {
    /// The local regions' bounce instance.
    pub(super) instance: Same<Region<'a>>,
    /// The remote regions' peer arena.
    pub(super) peer: Same<Region<'a>>,
    pub(super) survey: std::result::Result<Survey, PlanError>,
}

impl<'a> Facts<'a> {
    /// Checks pairs `range` of `local` and `remote` for a transfer `op`
    /// ([`SideCheck`]; the two lengths of each pair must agree), one run
    /// of equal handles at a time, and surveys them into `survey`. The
    /// first check that fails is named; planning's refusal is kept in
    /// the facts, not an error.
    pub(super) fn of(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        range: std::ops::Range<usize>,
        survey: Survey,
        kept: Option<&mut KeptRegions>,
    ) -> Result<Self> {
        let (lk, rk) = match kept {
            Some(k) => (Some(&mut k.local), Some(&mut k.remote)),
            None => (None, None),
        };
        let (mut lc, mut rc) = (
            SideCheck::new("local", local, lk),
            SideCheck::new("remote", remote, rk),
        );
        let (mut instance, mut peer) = (Same::Unseen, Same::Unseen);
        let mut survey = Ok(survey);
        let mut add = |l: &RawDesc, r: &RawDesc| {
            if let Ok(s) = &mut survey {
                if let Err(e) = s.add(&pair_descriptor(op, l.range(), r.range())) {
                    survey = Err(e);
                }
            }
        };
        // Every check of pair `i`, naming the first that fails; at the
        // first of a run of handles it resolves the run's regions. The two
        // sides' regions (`None`: a null handle).
        let mut full =
            |i: usize, l: &RawDesc, r: &RawDesc| -> Result<(Option<Range>, Option<Range>)> {
                if let Some(region) = lc.step(i, l)? {
                    instance.see(region.filter(|r| r.path != 0), Region::same_instance);
                }
                if let Some(region) = rc.step(i, r)? {
                    peer.see(region.filter(|r| r.path != 0), Region::same_arena);
                }
                if l.len != r.len {
                    return Err(Error::invalid(format!(
                        "descriptor {i}: local length {} differs from remote length {}",
                        l.len, r.len
                    )));
                }
                Ok((lc.region.map(|r| r.range), rc.region.map(|r| r.range)))
            };
        // One run at a time (the descriptors that share both handles, a
        // region's blocks in vLLM's lists): its first pair checked in full,
        // the rest against the run's two regions inline, and in full only
        // to name what is wrong.
        let end = range.end.min(local.raw.len()).min(remote.raw.len());
        let (lraw, rraw) = (&local.raw[..end], &remote.raw[..end]);
        let mut i = range.start;
        while let (Some(l0), Some(r0)) = (lraw.get(i), rraw.get(i)) {
            let (lw, rw) = full(i, l0, r0)?;
            add(l0, r0);
            i += 1;
            while let (Some(l), Some(r)) = (lraw.get(i), rraw.get(i)) {
                if l.md != l0.md || r.md != r0.md {
                    break;
                }
                if !(l.len == r.len && plainly_inside(l, lw) && plainly_inside(r, rw)) {
                    full(i, l, r)?;
                }
                add(l, r);
                i += 1;
            }
        }
        Ok(Facts {
            instance,
            peer,
            survey,
        })
    }

    /// These facts followed by `next`'s, of the pairs right after.
    pub(super) fn then(self, next: Facts<'a>) -> Facts<'a> {
        Facts {
            instance: self.instance.then(next.instance, Region::same_instance),
            peer: self.peer.then(next.peer, Region::same_arena),
            survey: match (self.survey, next.survey) {
                (Ok(a), Ok(b)) => Ok(a.then(&b)),
                (Err(e), _) | (Ok(_), Err(e)) => Err(e),
            },
        }
    }
}

/// A plan packed in the check's own pass over NIXL's lists, before its
/// survey is known ([`Checked::in_parts`]): from the first pair, assuming
/// every descriptor is of its length and devices ([`Survey::uniform`]) and
/// that the arena path of the local regions' bounce instance takes it.
/// What the pass finds otherwise is dropped (the run lists go back to
/// their pool) and the plan is made the usual way, after routing.
pub struct Packing {
    /// The local regions' bounce instance the plan is for ...
    pub(super) instance: Arc<Bounce>,
    /// ... and the peer's arena it goes to.
    pub(super) peer: Arc<PeerBounce>,
    pub(super) spec: PackSpec,
}

impl Packing {
    /// The packing of `local` to `remote` for a transfer `op`, when their
    /// first pair names a local bounce instance and a peer arena and the
    /// plan would be cut by whole chunks.
    pub(super) fn of(op: Op, local: &Descs<'_>, remote: &Descs<'_>) -> Option<Packing> {
        let (l0, r0) = (local.raw.first()?, remote.raw.first()?);
        let mixed = local.kind != remote.kind;
        let instance = local.md(l0.md)?.instance_for(mixed)?.clone();
        let peer = remote.md(r0.md)?.arena_for(mixed)?.clone();
        let first = pair_descriptor(op, l0.range(), r0.range());
        let runtime = &instance.runtime;
        let spec = PackSpec::new(
            Survey::uniform(&first, local.len()),
            runtime.plan_options(),
            runtime.run_pool().clone(),
        )?;
        Some(Packing {
            instance,
            peer,
            spec,
        })
    }
}

/// The chunks a check packed, with the packing they assumed and how the
/// pool's workers helped.
pub(super) struct EarlyPlan {
    pub(super) packing: Packing,
    pub(super) chunks: Vec<plan::Chunk>,
    pub(super) help: ipc::FillHelp,
}

/// What packing a plan's chunks before its survey is known assumes: the
/// survey, and the cut it gives.
pub struct PackSpec {
    pub(super) survey: Survey,
    /// The chunk cap, and the descriptors a chunk holds.
    pub(super) cap: u64,
    pub(super) per_chunk: usize,
    pub(super) merge: bool,
    pub(super) pool: crate::proto::RunPool,
}

impl PackSpec {
    /// `None` when the plan would not be cut by whole chunks.
    pub(super) fn new(
        survey: Survey,
        options: plan::PlanOptions,
        pool: crate::proto::RunPool,
    ) -> Option<Self> {
        if options.max_chunk_bytes < plan::REGION_ALIGN {
            return None;
        }
        let cut = plan::cut(&survey, &options);
        Some(PackSpec {
            survey,
            cap: cut.cap,
            per_chunk: cut.per_chunk?,
            merge: options.merge_runs,
            pool,
        })
    }

    /// The chunks' byte sizes of the plan it packs, known before any chunk
    /// is ([`plan::Cut::sizes`]).
    pub(super) fn chunk_sizes(&self) -> Option<Vec<u64>> {
        let cut = plan::Cut {
            cap: self.cap,
            per_chunk: Some(self.per_chunk),
        };
        cut.sizes(&self.survey)
    }
}

/// A plan's chunks packed in slices ([`plan::pack_slice`], of half the
/// pool's part length, never across a chunk) on the preparation pool's
/// threads, each chunk stitched ([`plan::stitch`]) by the thread whose
/// slice of it finishes last, or packed whole as one pass would when it
/// is not packed copies first (blocks mostly in order). Parts of whole
/// chunks end with the longest part and the workers' late start (a 64 MiB
/// request of 4 KiB blocks is 8 parts of 2048 descriptors on 8 threads);
/// slices of 512 share the same work in 32.
pub(super) struct Sliced<'s> {
    spec: &'s PackSpec,
    n: usize,
    /// Descriptors a slice ([`plan::slice_len`]).
    slice: usize,
    chunks: Vec<SlicedChunk>,
    /// Handed each chunk as soon as it is packed, every descriptor of it
    /// checked ([`ChunkHook`]).
    hook: Option<&'s ChunkHook<'s>>,
}

/// What [`Checked::in_parts`] hands each chunk of a plan packed in slices
/// as soon as it is packed (its index and the chunk), from the thread that
/// finished it: an announced WRITE's sender takes it ahead of the plan.
pub(super) type ChunkHook<'h> = dyn Fn(usize, &plan::Chunk) + Sync + 'h;

/// One chunk being packed in slices: the slices packed so far, how many
/// are still to come, whether one was not what the packing assumed, and
/// its chunk: packed whole by its first slice when that gave up at the
/// checkpoint, else stitched once every slice came; `None` when a slice
/// could not be packed (the plan is then made the usual way).
struct SlicedChunk {
    slices: Vec<Mutex<Option<plan::Slice>>>,
    left: AtomicUsize,
    unchecked: AtomicBool,
    done: Mutex<Option<Vec<plan::Chunk>>>,
}

impl<'s> Sliced<'s> {
    /// The slicing of `n` descriptors packed by `spec` in slices of about
    /// `about`, when its chunks may be packed in slices
    /// ([`plan::sliceable`]) and are longer than one: chunks of a slice or
    /// less are better shared out several to a part, as whole chunks.
    pub(super) fn new(
        spec: &'s PackSpec,
        n: usize,
        about: usize,
        hook: Option<&'s ChunkHook<'s>>,
    ) -> Option<Self> {
        let (k, slice) = (spec.per_chunk, plan::slice_len(about));
        if !plan::sliceable(&spec.survey, spec.merge) || k <= slice {
            return None;
        }
        let chunks = (0..n.div_ceil(k))
            .map(|c| {
                let slices = (k.min(n - c * k)).div_ceil(slice);
                SlicedChunk {
                    slices: (0..slices).map(|_| Mutex::new(None)).collect(),
                    left: AtomicUsize::new(slices),
                    unchecked: AtomicBool::new(false),
                    done: Mutex::new(None),
                }
            })
            .collect();
        Some(Sliced {
            spec,
            n,
            slice,
            chunks,
            hook,
        })
    }

    /// The descriptors of chunk `c`.
    fn chunk_range(&self, c: usize) -> std::ops::Range<usize> {
        let k = self.spec.per_chunk;
        c * k..self.n.min((c + 1) * k)
    }

    /// Every slice's descriptors, chunk after chunk.
    pub(super) fn parts(&self) -> Vec<std::ops::Range<usize>> {
        let slice = self.slice;
        (0..self.chunks.len())
            .flat_map(|c| {
                let chunk = self.chunk_range(c);
                chunk
                    .clone()
                    .step_by(slice)
                    .map(move |a| a..chunk.end.min(a + slice))
            })
            .collect()
    }

    /// Packs the slice of descriptors `range` (one of [`Sliced::parts`])
    /// from `descriptors` of a range, unless `checked` is false (its check
    /// failed, or its descriptors are not all the first's length). A
    /// chunk that is not packed copies first past the checkpoint (blocks
    /// in order) is packed whole by its first slice, as one pass would,
    /// and its other slices only check; else the chunk's last slice to
    /// come stitches it.
    pub(super) fn pack<I: Iterator<Item = plan::Descriptor>>(
        &self,
        range: std::ops::Range<usize>,
        checked: bool,
        descriptors: impl Fn(std::ops::Range<usize>) -> I,
    ) {
        let k = self.spec.per_chunk;
        let (c, at) = (range.start / k, range.start % k);
        let chunk = &self.chunks[c];
        let chunk_range = self.chunk_range(c);
        let p = self.spec;
        let pack_whole = || {
            plan::pack(
                descriptors(chunk_range.clone()),
                chunk_range.start,
                &p.survey,
                p.cap,
                p.merge,
                &p.pool,
            )
            .ok()
        };
        if !checked {
            chunk.unchecked.store(true, Ordering::Relaxed);
        } else if at == 0 {
            match plan::pack_slice(
                descriptors(range.clone()),
                range.start,
                true,
                chunk_range.len(),
            ) {
                Ok(slice) if slice.gave_up() => *chunk.done.locked() = pack_whole(),
                slice => *chunk.slices[0].locked() = slice.ok(),
            }
        } else if plan::copies_first_past_checkpoint(descriptors(chunk_range.clone())) {
            let slice =
                plan::pack_slice(descriptors(range.clone()), range.start, false, range.len());
            *chunk.slices[at / self.slice].locked() = slice.ok();
        }
        if chunk.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // The last slice: every other is in (or missing: not packed), and
        // a chunk its first slice packed whole is done already.
        let mut done = chunk.done.locked();
        if chunk.unchecked.load(Ordering::Relaxed) {
            *done = None;
        } else if done.is_none() {
            let slices: Option<Vec<plan::Slice>> =
                chunk.slices.iter().map(|s| s.locked().take()).collect();
            // Copies first to the end of the chunk, or packed whole when
            // it turns out not to keep its copies after all.
            *done = slices.and_then(|s| match plan::stitch(s) {
                Some(stitched) => Some(vec![stitched]),
                None => pack_whole(),
            });
        }
        if let (Some(hook), Some([whole])) = (self.hook, done.as_deref()) {
            hook(c, whole);
        }
    }

    /// The chunks, in order, once every slice was packed; `None` when one
    /// could not be.
    pub(super) fn chunks(self) -> Option<Vec<plan::Chunk>> {
        let mut all = Vec::with_capacity(self.chunks.len());
        for chunk in self.chunks {
            all.extend(chunk.done.into_inner().unwrap_or_else(|e| e.into_inner())?);
        }
        Some(all)
    }
}

/// Both sides of a transfer for the checked paths, every descriptor
/// checked ([`SideCheck`]; the two lengths of each pair must agree) in one
/// pass over NIXL's two lists, which also gathers what the bounce arena's
/// routing and plan read of every descriptor. A 32,768-descriptor list is
/// read once, where separate checks, comparisons, region scans, sums and
/// the plan's own checks read it seven times (2 MiB each).
pub struct Checked<'a> {
    pub local: Side<'a>,
    pub remote: Side<'a>,
    /// The bounce instance of every local region, when they share one.
    pub(super) local_instance: Option<&'a Arc<Bounce>>,
    /// The peer's bounce arena of every remote region, when they share one.
    pub(super) peer: Option<&'a Arc<PeerBounce>>,
    /// The plan's survey of the descriptors, source to destination, or why
    /// they cannot be planned.
    pub(super) survey: std::result::Result<Survey, PlanError>,
}

impl<'a> Checked<'a> {
    /// Checks `local` and `remote` (of equal lengths) for a transfer `op`.
    pub fn new(op: Op, local: Descs<'a>, remote: Descs<'a>) -> Result<Self> {
        Checked::with_kept(op, local, remote, None)
    }

    /// [`Checked::new`], reading the regions the last preparation met from
    /// `kept` where it meets them again (and keeping the ones it resolves).
    pub fn with_kept(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        kept: Option<&mut KeptRegions>,
    ) -> Result<Self> {
        let facts = Facts::of(op, local, remote, 0..local.len(), Survey::default(), kept)?;
        Ok(Checked::from_facts(local, remote, facts))
    }

    /// [`Checked::new`] in parts on `fill`'s threads beside this one, each
    /// part checked and surveyed apart ([`Survey::part`]) and the facts put
    /// together in order, so the first error is the one a single pass
    /// names; how the pool's workers helped; and, with `packing`, the
    /// chunks each part packed right after checking them (while its
    /// descriptors are in the cache), when every part could. Blocks that
    /// pack back to back in chunks longer than a slice are packed in
    /// slices ([`Sliced`]); otherwise the parts are whole chunks, and a
    /// packing whose parts would be fewer than the pool's threads is not
    /// done (the check would lose its threads to it). `None`: the lists
    /// are empty or the pool declined (held by another preparation).
    pub fn in_parts(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        fill: &ipc::FillPool,
        packing: Option<&PackSpec>,
        hook: Option<&ChunkHook<'_>>,
    ) -> Option<(Result<Self>, ipc::FillHelp, Option<Vec<plan::Chunk>>)> {
        let n = local.len().min(remote.len());
        let first = pair_descriptor(op, local.raw.first()?.range(), remote.raw.first()?.range());
        // Slices of chunks when the blocks pack back to back ([`Sliced`]),
        // else parts of whole chunks, unless they would be fewer than the
        // pool's threads.
        let sliced = packing.and_then(|p| Sliced::new(p, n, fill.part_len / 2, hook));
        let (mut packing, mut parts) = match &sliced {
            Some(s) => (None, s.parts()),
            None => (packing, fill.parts(n, packing.map_or(1, |p| p.per_chunk))),
        };
        if packing.is_some() && parts.len() <= fill.pool.current_num_threads() {
            (packing, parts) = (None, fill.parts(n, 1));
        }
        let descriptors = |range| pair_descriptors(op, local, remote, range);
        let (parts, help) = fill.share(parts, |range| {
            let survey = Survey::part(&first, range.start);
            let facts = Facts::of(op, local, remote, range.clone(), survey, None);
            // Every descriptor of the part is the first's length (the
            // part's survey holds it to descriptor 0's).
            let one_len = matches!(&facts, Ok(Facts { survey: Ok(s), .. }) if s.one_len());
            if let Some(s) = &sliced {
                s.pack(range.clone(), one_len, descriptors);
            }
            let chunks = match packing {
                Some(p) if one_len => plan::pack(
                    descriptors(range.clone()),
                    range.start,
                    &p.survey,
                    p.cap,
                    p.merge,
                    &p.pool,
                )
                .ok(),
                _ => None,
            };
            Some((facts, chunks))
        })?;
        let (mut facts, mut chunks): (Option<Facts<'a>>, Option<Vec<_>>) =
            (None, packing.map(|_| Vec::new()));
        for (part, packed) in parts {
            let part = match part {
                Ok(part) => part,
                Err(e) => return Some((Err(e), help, None)),
            };
            facts = Some(match facts {
                Some(f) => f.then(part),
                None => part,
            });
            chunks = chunks.zip(packed).map(|(mut all, part)| {
                all.extend(part);
                all
            });
        }
        let chunks = match sliced {
            Some(s) => s.chunks(),
            None => chunks,
        };
        Some((Ok(Checked::from_facts(local, remote, facts?)), help, chunks))
    }

    pub(super) fn from_facts(local: Descs<'a>, remote: Descs<'a>, facts: Facts<'a>) -> Self {
        // Memory of two kinds takes the GPU side's host-staged instance.
        let mixed = local.kind != remote.kind;
        Checked {
            local: Side(local),
            remote: Side(remote),
            local_instance: facts.instance.get().and_then(|r| r.md.instance_for(mixed)),
            peer: facts.peer.get().and_then(|r| r.md.arena_for(mixed)),
            survey: facts.survey,
        }
    }

    /// The transfer's descriptors, source to destination (what was
    /// surveyed).
    pub(super) fn descriptors(&self, op: Op) -> impl Iterator<Item = Descriptor> + 'a {
        self.descriptors_in(op, 0..self.local.len())
    }

    /// Descriptors `range` of [`Checked::descriptors`].
    pub(super) fn descriptors_in(
        &self,
        op: Op,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = Descriptor> + 'a {
        pair_descriptors(op, self.local.0, self.remote.0, range)
    }
}

/// Pairs `range` of `local` and `remote` as the plan's source ->
/// destination descriptors ([`pair_descriptor`]).
pub(super) fn pair_descriptors<'a>(
    op: Op,
    local: Descs<'a>,
    remote: Descs<'a>,
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = Descriptor> + 'a {
    local.raw[range.clone()]
        .iter()
        .zip(&remote.raw[range])
        .map(move |(l, r)| pair_descriptor(op, l.range(), r.range()))
}

/// Whether a descriptor passes [`SideCheck::step`] in a run whose region
/// is `region` (`None`: a null handle), without building its error.
#[inline]
pub(super) fn plainly_inside(d: &RawDesc, region: Option<Range>) -> bool {
    let range = d.range();
    range.end().is_some() && region.is_none_or(|w| range.len == 0 || w.covers(&range))
}

/// A pair of descriptors as the plan's source -> destination: local to
/// remote for a WRITE, remote to local for a READ.
pub(super) fn pair_descriptor(op: Op, l: Range, r: Range) -> Descriptor {
    let (src, dst) = match op {
        Op::Write => (l, r),
        Op::Read => (r, l),
    };
    Descriptor {
        src_addr: src.addr as u64,
        src_dev: src.dev as u32,
        dst_addr: dst.addr as u64,
        dst_dev: dst.dev as u32,
        len: l.len as u64,
    }
}

/// One side of a transfer whose every descriptor was checked
/// ([`Engine::check`]).
#[derive(Clone, Copy)]
pub struct Side<'a>(Descs<'a>);

impl std::fmt::Debug for Side<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("kind", &self.0.kind)
            .field("descriptors", &self.len())
            .finish()
    }
}

impl<'a> Side<'a> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Descriptor `i`'s range.
    pub fn range(&self, i: usize) -> Range {
        self.0.raw[i].range()
    }

    /// Each descriptor's range and metadata.
    pub fn iter(&self) -> impl Iterator<Item = (Range, Option<&'a Md>)> + 'a {
        let mut md = self.mds();
        self.0.raw.iter().map(move |d| (d.range(), md(d.md)))
    }

    /// Resolves descriptors' metadata, once per run of equal handles.
    pub(super) fn mds(&self) -> impl FnMut(*const std::ffi::c_void) -> Option<&'a Md> + 'a {
        let descs = self.0;
        let mut last: (*const std::ffi::c_void, Option<&'a Md>) = (std::ptr::null(), None);
        move |p| {
            if p != last.0 {
                last = (p, descs.md(p));
            }
            last.1
        }
    }

    /// Each descriptor's range.
    pub fn ranges(&self) -> impl Iterator<Item = Range> + 'a {
        self.0.raw.iter().map(RawDesc::range)
    }

    /// The descriptors' metadata, each run of equal handles once (routing
    /// looks at regions, not descriptors).
    pub fn distinct_mds(&self) -> impl Iterator<Item = Option<&'a Md>> + 'a {
        let mut last: Option<*const std::ffi::c_void> = None;
        let mut md = self.mds();
        self.0.raw.iter().filter_map(move |d| {
            if last == Some(d.md) {
                return None;
            }
            last = Some(d.md);
            Some(md(d.md))
        })
    }
}

impl RawDesc {
    pub(super) fn range(&self) -> Range {
        Range {
            addr: self.addr,
            len: self.len,
            dev: self.dev,
        }
    }
}

/// What routing looks at before any descriptor: the memory kinds, the
/// descriptor count and their total length, and whether the transfer stays
/// within this agent.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub local: MemKind,
    pub remote: MemKind,
    pub descriptors: u64,
    pub bytes: TotalBytes<'a>,
    pub local_transfer: bool,
}

/// The total length of a transfer's descriptors: known, or summed when a
/// gate first asks for it (and kept in the cell for the next). Only gates
/// with a size limit ask, and the peer-mapped path's default gate has
/// none: the real clients' transfers it takes are then read once, by the
/// table's pass, not twice (a sum over 32,768 descriptors reads 1 MiB).
#[derive(Debug, Clone, Copy)]
pub enum TotalBytes<'a> {
    Known(u64),
    Of(&'a [RawDesc], &'a std::cell::OnceCell<u64>),
}

impl TotalBytes<'_> {
    pub fn get(self) -> u64 {
        match self {
            TotalBytes::Known(b) => b,
            TotalBytes::Of(d, sum) => *sum.get_or_init(|| d.iter().map(|d| d.len as u64).sum()),
        }
    }
}

impl From<u64> for TotalBytes<'_> {
    fn from(b: u64) -> Self {
        TotalBytes::Known(b)
    }
}
