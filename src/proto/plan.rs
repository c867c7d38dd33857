//! Transfer plan: bin-packs (source, destination) descriptor pairs into
//! chunks and computes, per chunk, the coalesced gather runs (source ->
//! region) and scatter runs (region -> destination).
//!
//! Packing rules:
//! - descriptors are taken in order; zero-length descriptors are skipped;
//! - every piece starts at a 32-byte-aligned offset inside its region;
//! - a descriptor that fits in a chunk is never split: when it does not fit
//!   in the current chunk's remaining space it starts a new chunk;
//! - a descriptor longer than `max_chunk_bytes` is split into pieces: the
//!   first piece fills the current chunk (when at least one aligned byte is
//!   left), then whole chunks, then the remainder starts a new chunk;
//! - a chunk's size is the end offset of its last piece (alignment padding
//!   between pieces included, no trailing padding);
//! - the cap is the request's own ([`chunk_cap`]): `max_chunk_bytes`, or
//!   less, so that a request of several `min_chunk_bytes` is cut into at
//!   least `min_chunks` chunks whose gather, write and scatter overlap.

use thiserror::Error;

use super::{Copies, Run, RunPool, Runs};

/// Alignment of every piece inside a region.
pub const REGION_ALIGN: u64 = 32;

/// Upper bound on chunks per request (the wire carries chunk indices as u32).
pub const MAX_CHUNKS: usize = 1 << 24;

/// One (source, destination) pair of the application's transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Source address (local).
    pub src_addr: u64,
    /// Source device id.
    pub src_dev: u32,
    /// Destination address (on the peer).
    pub dst_addr: u64,
    /// Destination device id.
    pub dst_dev: u32,
    /// Bytes to move.
    pub len: u64,
}

impl Descriptor {
    /// Ok when neither side's range wraps around the address space; the
    /// error names the descriptor as `index`.
    fn fits(&self, index: usize) -> Result<(), PlanError> {
        if self.src_addr.checked_add(self.len).is_none()
            || self.dst_addr.checked_add(self.len).is_none()
        {
            return Err(PlanError::AddressOverflow { index });
        }
        Ok(())
    }
}

/// Why a plan could not be built.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The chunk cap is below the region alignment.
    #[error("max chunk size {0} is below the {REGION_ALIGN}-byte region alignment")]
    ChunkTooSmall(u64),
    /// Sources on different devices.
    #[error("descriptor {index} has source device {found} but descriptor 0 has {expected}; all sources of one bounce transfer must be on one device")]
    MixedSourceDevices {
        /// Index of the first mismatching descriptor.
        index: usize,
        /// Device of the first descriptor.
        expected: u32,
        /// Device found.
        found: u32,
    },
    /// Destinations on different devices.
    #[error("descriptor {index} has destination device {found} but descriptor 0 has {expected}; all destinations of one bounce transfer must be on one device")]
    MixedDestinationDevices {
        /// Index of the first mismatching descriptor.
        index: usize,
        /// Device of the first descriptor.
        expected: u32,
        /// Device found.
        found: u32,
    },
    /// A descriptor's address range wraps around the address space.
    #[error("descriptor {index}: address + length overflows 64 bits")]
    AddressOverflow {
        /// Index of the descriptor.
        index: usize,
    },
    /// The transfer needs more chunks than the protocol can number.
    #[error(
        "transfer needs more than {MAX_CHUNKS} chunks; raise the chunk size or split the transfer"
    )]
    TooManyChunks,
}

/// One chunk: a region's worth of descriptors, moved by one write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Packed bytes (alignment padding included).
    pub bytes: u64,
    /// Source -> region copies (`addr` = source).
    pub gather_runs: Runs,
    /// Region -> destination copies (`addr` = destination).
    pub scatter_runs: Runs,
    /// Number of descriptor pieces packed into this chunk.
    pub pieces: u32,
}

/// The plan for one transfer.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Plan {
    /// The chunks, in order.
    pub chunks: Vec<Chunk>,
    /// Source device (0 when there are no descriptors).
    pub src_dev: u32,
    /// Destination device (0 when there are no descriptors).
    pub dst_dev: u32,
    /// Payload bytes (sum of descriptor lengths).
    pub payload_bytes: u64,
}

impl Plan {
    /// Per-chunk byte sizes (what WANT carries).
    pub fn chunk_sizes(&self) -> Vec<u64> {
        self.chunks.iter().map(|c| c.bytes).collect()
    }

    /// A plan of chunks known by their sizes alone (no copies yet), which
    /// holds the place of a request's plan while it is packed.
    pub fn sized(sizes: &[u64]) -> Plan {
        Plan {
            chunks: sizes
                .iter()
                .map(|&bytes| Chunk {
                    bytes,
                    gather_runs: Runs::default(),
                    scatter_runs: Runs::default(),
                    pieces: 0,
                })
                .collect(),
            payload_bytes: sizes.iter().fold(0, |a, &b| a.saturating_add(b)),
            ..Plan::default()
        }
    }
}

/// Plan options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Chunk byte cap (the receiver refuses larger chunks).
    pub max_chunk_bytes: u64,
    /// Coalesce runs (false = one run per piece, for debugging).
    pub merge_runs: bool,
    /// A request is cut into at least this many chunks (1: only by the
    /// cap), so that its stages overlap ...
    pub min_chunks: u64,
    /// ... but no chunk is made smaller than this for it.
    pub min_chunk_bytes: u64,
}

impl PlanOptions {
    /// Options that cut chunks by `max_chunk_bytes` alone.
    pub fn capped(max_chunk_bytes: u64, merge_runs: bool) -> PlanOptions {
        PlanOptions {
            max_chunk_bytes,
            merge_runs,
            min_chunks: 1,
            min_chunk_bytes: 0,
        }
    }
}

/// The chunk cap of a request of `payload` bytes: `max_chunk_bytes`, or
/// `payload / min_chunks` (aligned up) when that is smaller, but never below
/// `min_chunk_bytes`. One chunk is gathered, written and scattered one
/// stage after another; several overlap (the sender gathers chunk k + 1
/// while chunk k is written, the receiver scatters chunk k while k + 1
/// arrives), so a request no longer waits for its whole gather before its
/// first write.
pub fn chunk_cap(options: &PlanOptions, payload: u64) -> u64 {
    let cap = options.max_chunk_bytes;
    if options.min_chunks <= 1 {
        return cap;
    }
    let share = align_up(payload.div_ceil(options.min_chunks));
    share
        .max(options.min_chunk_bytes)
        .min(cap)
        .max(REGION_ALIGN)
}

fn align_up(x: u64) -> u64 {
    // Offsets are bounded by max_chunk_bytes, far from u64::MAX.
    x.div_ceil(REGION_ALIGN) * REGION_ALIGN
}

/// Builds the plan for `descriptors`.
pub fn build(descriptors: &[Descriptor], options: PlanOptions) -> Result<Plan, PlanError> {
    build_from(descriptors.iter().copied(), options, &RunPool::default())
}

/// Builds the plan for the descriptors `descriptors` yields, in two passes
/// over them ([`Survey`], then [`build_surveyed`]), so that a caller can
/// plan straight from its own lists without collecting them; the run
/// lists' storage comes from `pool` and goes back to it.
pub fn build_from<I>(
    descriptors: I,
    options: PlanOptions,
    pool: &RunPool,
) -> Result<Plan, PlanError>
where
    I: Iterator<Item = Descriptor> + Clone,
{
    if options.max_chunk_bytes < REGION_ALIGN {
        return Err(PlanError::ChunkTooSmall(options.max_chunk_bytes));
    }
    let mut survey = Survey::default();
    for d in descriptors.clone() {
        survey.add(&d)?;
    }
    build_surveyed(descriptors, survey, options, pool)
}

/// What planning must know of every descriptor before it packs any: they
/// are all checked (one source device, one destination device, no range
/// that wraps) and their bytes counted. Fed one descriptor at a time, so
/// that a caller that walks the descriptors anyway (the engine checks them
/// against their regions) surveys them in the same pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Survey {
    devices: Option<(u32, u32)>,
    descriptors: usize,
    pieces: usize,
    payload: u64,
    /// The first descriptor's length, and whether every one so far has it.
    first_len: u64,
    one_len: bool,
}

impl Survey {
    /// Adds the next descriptor; the first that planning refuses is named
    /// by its index.
    pub fn add(&mut self, d: &Descriptor) -> Result<(), PlanError> {
        let index = self.descriptors;
        let (src_dev, dst_dev) = *self.devices.get_or_insert((d.src_dev, d.dst_dev));
        if d.src_dev != src_dev {
            return Err(PlanError::MixedSourceDevices {
                index,
                expected: src_dev,
                found: d.src_dev,
            });
        }
        if d.dst_dev != dst_dev {
            return Err(PlanError::MixedDestinationDevices {
                index,
                expected: dst_dev,
                found: d.dst_dev,
            });
        }
        d.fits(index)?;
        if index == 0 {
            (self.first_len, self.one_len) = (d.len, true);
        }
        self.one_len &= d.len == self.first_len;
        self.descriptors += 1;
        self.pieces += usize::from(d.len > 0);
        self.payload = self.payload.saturating_add(d.len);
        Ok(())
    }

    /// The descriptors surveyed (for a [`Survey::part`], the index after
    /// the last).
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// The bytes of the descriptors surveyed.
    pub fn payload(&self) -> u64 {
        self.payload
    }

    /// Whether every descriptor surveyed has the first one's length.
    pub fn one_len(&self) -> bool {
        self.one_len
    }

    /// A survey of the descriptors from index `start` on, of a transfer
    /// whose descriptor 0 is `first`: it refuses what a survey of all of
    /// them would at the same indices (every device is held to `first`'s,
    /// as there), so that parts can be surveyed apart and put together
    /// ([`Survey::then`]).
    pub fn part(first: &Descriptor, start: usize) -> Survey {
        Survey {
            devices: Some((first.src_dev, first.dst_dev)),
            descriptors: start,
            pieces: 0,
            payload: 0,
            first_len: first.len,
            one_len: true,
        }
    }

    /// The survey `n` descriptors of `first`'s devices and length would
    /// give (none refused): what a plan packed before its survey is known
    /// assumes, to be compared with the survey once it is.
    pub fn uniform(first: &Descriptor, n: usize) -> Survey {
        Survey {
            devices: Some((first.src_dev, first.dst_dev)),
            descriptors: n,
            pieces: if first.len > 0 { n } else { 0 },
            payload: first.len.saturating_mul(n as u64),
            first_len: first.len,
            one_len: true,
        }
    }

    /// This survey followed by `next`, a [`Survey::part`] of the same
    /// transfer that starts where this one ends; `self` is that
    /// transfer's survey so far (its first part, or an empty survey). The
    /// parts hold every device to descriptor 0's, so their devices agree.
    pub fn then(self, next: &Survey) -> Survey {
        if self.devices.is_none() {
            // Nothing surveyed yet.
            return *next;
        }
        debug_assert_eq!(self.devices, next.devices, "parts of one transfer");
        Survey {
            descriptors: next.descriptors,
            pieces: self.pieces + next.pieces,
            payload: self.payload.saturating_add(next.payload),
            one_len: self.one_len && next.one_len && self.first_len == next.first_len,
            ..self
        }
    }
}

/// How a surveyed transfer is cut into chunks ([`cut`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// The request's chunk cap ([`chunk_cap`]).
    pub cap: u64,
    /// When every descriptor is one non-zero length that fits a chunk,
    /// how many each chunk holds (the last may hold fewer): chunk `c` is
    /// then descriptors `c * k ..`, so that runs of whole chunks can be
    /// packed apart ([`pack`]) and put together ([`assemble`]).
    pub per_chunk: Option<usize>,
}

impl Cut {
    /// The chunks' byte sizes (what a WANT carries) of a transfer cut by
    /// whole chunks, known from `survey` alone, before any chunk is packed:
    /// chunk `c` holds descriptors `c k ..` of one length `len`, each
    /// placed at the region's alignment after the one before, so it takes
    /// `(m - 1) align(len) + len` bytes for its `m` of them. `None` when the
    /// cut is not by whole chunks, or the transfer would need more than
    /// [`MAX_CHUNKS`] (planning refuses it).
    pub fn sizes(&self, survey: &Survey) -> Option<Vec<u64>> {
        let k = self.per_chunk?;
        let n = survey.descriptors;
        let len = survey.first_len;
        let chunks = n.div_ceil(k);
        if chunks > MAX_CHUNKS {
            return None;
        }
        let bytes = |m: usize| (m as u64 - 1) * align_up(len) + len;
        Some((0..chunks).map(|c| bytes(k.min(n - c * k))).collect())
    }
}

/// How the descriptors `survey` was fed are cut into chunks.
pub fn cut(survey: &Survey, options: &PlanOptions) -> Cut {
    let cap = chunk_cap(options, survey.payload);
    let len = survey.first_len;
    let per_chunk = (survey.one_len && len > 0 && len <= cap)
        .then(|| ((cap - len) / align_up(len) + 1) as usize);
    Cut { cap, per_chunk }
}

/// Builds the plan of descriptors that `survey` was fed, in the same
/// order (one pass).
pub fn build_surveyed(
    descriptors: impl Iterator<Item = Descriptor>,
    survey: Survey,
    options: PlanOptions,
    pool: &RunPool,
) -> Result<Plan, PlanError> {
    if options.max_chunk_bytes < REGION_ALIGN {
        return Err(PlanError::ChunkTooSmall(options.max_chunk_bytes));
    }
    let cap = cut(&survey, &options).cap;
    let chunks = pack(descriptors, 0, &survey, cap, options.merge_runs, pool)?;
    assemble(&survey, chunks)
}

/// Packs descriptors into chunks of at most `cap` bytes: all that
/// `survey` was fed, or (when its [`Cut`] has `per_chunk`) a run of them
/// that starts a chunk, the first of them numbered `first` among all.
pub fn pack(
    descriptors: impl Iterator<Item = Descriptor>,
    first: usize,
    survey: &Survey,
    cap: u64,
    merge: bool,
    pool: &RunPool,
) -> Result<Vec<Chunk>, PlanError> {
    pack_chunks(descriptors, first, survey, cap, merge, pool, true)
}

/// [`pack`]; with `copies_first` false every chunk goes through the
/// merge rule, without [`CopiesFirst`] (the reference the tests hold
/// copies first to).
fn pack_chunks(
    descriptors: impl Iterator<Item = Descriptor>,
    first: usize,
    survey: &Survey,
    cap: u64,
    merge: bool,
    pool: &RunPool,
    copies_first: bool,
) -> Result<Vec<Chunk>, PlanError> {
    // A chunk holds about cap / (the average piece) pieces: room for that
    // many runs is taken for each.
    let per_chunk = match survey.payload.checked_div(survey.pieces as u64) {
        Some(average) if average > 0 => (cap / average + 1).min(survey.pieces as u64) as usize,
        _ => 0,
    };
    // Descriptors of one length that packs back to back (a multiple of
    // the region's alignment, as real clients' blocks are) make chunks
    // that are also packed copies, kept beside their runs.
    let copies =
        survey.one_len && survey.first_len > 0 && align_up(survey.first_len) == survey.first_len;
    let mut builder = ChunkBuilder {
        merge,
        pool,
        per_chunk,
        used: 0,
        pieces: 0,
        gather: RunBuilder::default(),
        scatter: RunBuilder::default(),
        copies: copies.then(PackedCopies::default),
        packed: None,
        first: None,
        copies_first,
        spare: None,
    };
    let mut chunks = Vec::new();
    for (index, d) in descriptors.enumerate().filter(|(_, d)| d.len > 0) {
        // The survey checked these: a caller that fed it others is refused
        // here rather than packing a range that wraps.
        d.fits(first + index)?;
        // The common case: the whole descriptor fits the chunk being
        // packed (what the loop below does with it then).
        let at = align_up(builder.used);
        if at <= cap && d.len <= cap - at {
            builder.push(at, d.src_addr, d.dst_addr, d.len);
            continue;
        }
        let mut done = 0u64;
        while done < d.len {
            let left = d.len - done;
            let mut at = align_up(builder.used);
            let room = cap.saturating_sub(at);
            // Whole descriptors that fit a fresh chunk are never split.
            let fits_fresh = d.len <= cap && done == 0;
            if (fits_fresh && left > room) || room == 0 {
                builder.finish_into(&mut chunks)?;
                at = 0;
            }
            let room = cap - at;
            let piece = left.min(room);
            builder.push(at, d.src_addr + done, d.dst_addr + done, piece);
            done += piece;
        }
    }
    builder.finish_into(&mut chunks)?;
    Ok(chunks)
}

/// The plan of the descriptors `survey` was fed, from their chunks (packed
/// whole or in runs of whole chunks, in order).
pub fn assemble(survey: &Survey, chunks: Vec<Chunk>) -> Result<Plan, PlanError> {
    if chunks.len() > MAX_CHUNKS {
        return Err(PlanError::TooManyChunks);
    }
    let (src_dev, dst_dev) = survey.devices.unwrap_or_default();
    Ok(Plan {
        chunks,
        src_dev,
        dst_dev,
        payload_bytes: survey.payload,
    })
}

/// The chunk being packed.
struct ChunkBuilder<'p> {
    merge: bool,
    /// Where the chunks' run lists come from ...
    pool: &'p RunPool,
    /// ... with room for this many runs.
    per_chunk: usize,
    used: u64,
    pieces: u32,
    gather: RunBuilder,
    scatter: RunBuilder,
    /// `Some` when the transfer's pieces may be packed copies: the
    /// storage the chunks' copies are built in ...
    copies: Option<PackedCopies>,
    /// ... and the chunk being packed, while its pieces still are.
    packed: Option<PackedCopies>,
    /// `Some` while the chunk is packed copies first ([`CopiesFirst`]):
    /// no run lists, only what bounds them.
    first: Option<CopiesFirst>,
    /// Whether chunks of packed copies start copies first.
    copies_first: bool,
    /// A second storage for packed copies, which a chunk packed again
    /// through the merge rule ([`ChunkBuilder::runs_after_all`]) fills
    /// while it reads its first.
    spare: Option<PackedCopies>,
}

/// A chunk of packed copies is packed copies first, without run lists,
/// while that provably keeps its copies: the planner's merge rule
/// ([`RunBuilder`]) costs a descriptor most of a plan's time (two merge
/// decisions, each a load and store of the last run), and a chunk of
/// scattered blocks, which keeps its copies ([`COPIES_PER_RUN`]), never
/// needs its merged runs: the wire, the registration check and the GPU's
/// tables read its copies, and whatever reads it as runs gets the copies'
/// own runs of one or two copies ([`Runs::from_copies`]). The copies are
/// marked as pairs greedily (a copy after an unmarked one that lies
/// forward of it, by at least its length, on that side), which is what
/// the merge rule makes of them where no three copies continue one
/// step; what it would make otherwise is bounded below here.
///
/// The bound, per side: the merge rule extends a run only with a copy
/// that lies forward of the one before it, and extends it with two copies
/// in a row only where the second continues the first's step. So of `n`
/// copies at most `pairs + continuing` extend a run, where `pairs` is the
/// greedy marking's count (the most copies no two in a row of a stretch
/// of forward copies) and `continuing` counts the forward copies whose
/// step equals the one before: the rule makes at least `n - pairs -
/// continuing` runs. Where that is more than half the copies on either
/// side, the chunk keeps its copies as the rule would (and neither side
/// is packed copies of a longer length, which needs at most half); where
/// it is not, after [`CopiesFirst::CHECKPOINT`] copies or at the chunk's
/// end, the chunk's copies so far are packed again through the merge
/// rule, as every chunk was before (blocks mostly in order, whose runs
/// are few).
#[derive(Debug, Default)]
struct CopiesFirst {
    /// Per side (gather, scatter): the last copy's address ...
    last: [u64; 2],
    /// ... its step from the one before when forward, else 0 (a forward
    /// step is at least the copies' length, never 0) ...
    step: [u64; 2],
    /// ... and whether it is marked.
    marked: [bool; 2],
    pairs: [usize; 2],
    continuing: [usize; 2],
}

impl CopiesFirst {
    /// Copies after which a chunk not on course to keep its copies is
    /// packed through the merge rule instead.
    const CHECKPOINT: usize = 32;

    /// Takes copy `index` (> 0) at `addrs` (gather, scatter) of `len`
    /// bytes; whether it is marked on each side.
    #[inline(always)]
    fn add(&mut self, addrs: [u64; 2], len: u64) -> [bool; 2] {
        let mut second = [false; 2];
        // Without branches on `forward` (`&`, not `&&`): for scattered
        // blocks it is a coin toss, which a branch predictor loses.
        for s in 0..2 {
            let (a, last) = (addrs[s], self.last[s]);
            // `last + len` does not overflow: every range was checked.
            let forward = a >= last + len;
            let step = a.wrapping_sub(last);
            self.continuing[s] += usize::from(forward & (self.step[s] == step));
            self.step[s] = step & u64::from(forward).wrapping_neg();
            second[s] = forward & !self.marked[s];
            self.marked[s] = second[s];
            self.pairs[s] += usize::from(second[s]);
            self.last[s] = a;
        }
        second
    }

    /// Takes the next copy at `addrs` (gather, scatter) of `len` bytes,
    /// the first of a chunk or slice when `first`; whether it is marked on
    /// each side.
    #[inline(always)]
    fn take(&mut self, first: bool, addrs: [u64; 2], len: u64) -> [bool; 2] {
        if first {
            (self.last, self.marked) = (addrs, [false; 2]);
            [false; 2]
        } else {
            self.add(addrs, len)
        }
    }

    /// Whether `n` copies so far provably keep their copies.
    fn keeps(&self, n: usize) -> bool {
        (0..2).any(|s| n.saturating_sub(self.pairs[s] + self.continuing[s]) * 2 > n)
    }
}

/// A chunk keeps its packed copies beside its runs while the copies are
/// at most this many times the runs (on the side with more runs): as
/// many wire entries at most as a list of runs of one or two copies
/// (the bound the control message limits were set for). On the 2-core
/// VM (`chunk_passes_cost`) a 4096-copy chunk's passes cost the sender
/// 6 us as copies against 29 us as 2590 runs, and the receiver 14
/// against 43.
const COPIES_PER_RUN: usize = 2;

/// Whether `runs` are all of one length longer than `len` and of one or
/// two copies each: packed copies of that length themselves, which the
/// wire carries in fewer entries than the copies of `len`.
fn coarser_copies(runs: &[Run], len: u64) -> bool {
    runs.first()
        .is_some_and(|f| f.len > len && runs.iter().all(|r| r.len == f.len && r.count <= 2))
}

/// Both sides of a chunk as packed copies ([`Copies`]) while it is packed:
/// pieces of `len` bytes back to back from region offset 0, each a run of
/// its own or the second of a run of two (marked; two contiguous pieces,
/// which the run list holds as one run, are such a pair). The mark bits of
/// the eight copies being added are kept in `bits` until their byte is
/// full.
#[derive(Debug, Default)]
struct PackedCopies {
    len: u64,
    /// Where the next copy must lie in the region.
    next: u64,
    gather: Vec<u64>,
    scatter: Vec<u64>,
    gather_marks: Vec<u8>,
    scatter_marks: Vec<u8>,
    bits: [u8; 2],
}

impl PackedCopies {
    /// Empty lists with room for `n` copies (reusing the storage of a
    /// chunk that stopped being packed copies).
    fn ready(mut self, len: u64, n: usize) -> Self {
        for v in [&mut self.gather, &mut self.scatter] {
            v.clear();
            v.reserve(n);
        }
        for m in [&mut self.gather_marks, &mut self.scatter_marks] {
            m.clear();
            m.reserve(n.div_ceil(8));
        }
        (self.len, self.next, self.bits) = (len, 0, [0, 0]);
        self
    }

    /// Appends copy `(at, src, dst, len)`, which the run lists took as
    /// `gather` and `scatter`; false when the chunk is no longer packed
    /// copies (a gap, another length). A copy that grew a run past two
    /// copies is one of its own here (the same bytes: the copies need not
    /// be the runs' own shape).
    #[inline(always)]
    fn push(
        &mut self,
        at: u64,
        src: u64,
        dst: u64,
        len: u64,
        gather: Added,
        scatter: Added,
    ) -> bool {
        if len != self.len || at != self.next {
            return false;
        }
        let second = |a: Added| matches!(a, Added::Paired | Added::Joined);
        self.push_marked(src, dst, len, [second(gather), second(scatter)]);
        true
    }

    /// Appends the next copy (the caller checked it is: `len` bytes at
    /// `next`), marked on each side as `second` says.
    #[inline(always)]
    fn push_marked(&mut self, src: u64, dst: u64, len: u64, second: [bool; 2]) {
        let k = self.gather.len() % 8;
        self.next += len;
        self.gather.push(src);
        self.scatter.push(dst);
        self.bits[0] |= u8::from(second[0]) << k;
        self.bits[1] |= u8::from(second[1]) << k;
        if k == 7 {
            self.flush();
        }
    }

    /// Moves the bits of the copies added since the last full byte into
    /// the marks.
    fn flush(&mut self) {
        self.gather_marks.push(self.bits[0]);
        self.scatter_marks.push(self.bits[1]);
        self.bits = [0, 0];
    }

    /// The two sides' copies (their storage goes with them).
    fn finish(&mut self) -> (Copies, Copies) {
        if !self.gather.len().is_multiple_of(8) {
            self.flush();
        }
        let len = self.len;
        let side = |addrs: &mut Vec<u64>, marks: &mut Vec<u8>| {
            Copies::planned(len, std::mem::take(addrs), std::mem::take(marks))
        };
        (
            side(&mut self.gather, &mut self.gather_marks),
            side(&mut self.scatter, &mut self.scatter_marks),
        )
    }
}

/// The descriptors of a slice ([`pack_slice`]) of about `about`: a whole
/// number of mark bytes, and at least [`CopiesFirst::CHECKPOINT`], so
/// that a chunk's first slice decides there as [`pack`] does.
pub fn slice_len(about: usize) -> usize {
    about.next_multiple_of(8).max(CopiesFirst::CHECKPOINT)
}

/// Whether chunks of the descriptors `survey` was fed may be packed in
/// slices on several threads ([`pack_slice`], [`stitch`]): every one is
/// one length that packs back to back, and the plan merges runs (so that
/// its chunks of packed copies are packed copies first).
pub fn sliceable(survey: &Survey, merge: bool) -> bool {
    let len = survey.first_len;
    merge && survey.one_len && len > 0 && align_up(len) == len
}

/// One slice of a chunk of packed copies, packed copies first as if it
/// began its chunk ([`pack_slice`]); [`stitch`] joins a chunk's slices.
#[derive(Debug)]
pub struct Slice {
    copies: PackedCopies,
    /// The greedy marking's state and counts over the slice's copies.
    counts: CopiesFirst,
    /// A chunk's first slice whose first [`CopiesFirst::CHECKPOINT`]
    /// copies do not keep their copies: the chunk is packed through the
    /// merge rule, as [`pack`] would (the slice stopped there).
    gave_up: bool,
}

/// Packs `descriptors`, of one length that packs back to back (the
/// survey's, [`sliceable`]), as one slice of a chunk: packed copies
/// first, from the slice's own first copy. `first` numbers the first
/// descriptor among all (for errors), `starts_chunk` says whether it
/// begins its chunk (which then decides at the checkpoint, as [`pack`]
/// does), and `room` is the copies to make room for (its chunk's, for a
/// first slice, so that [`stitch`] appends the rest without moving it).
pub fn pack_slice(
    descriptors: impl Iterator<Item = Descriptor>,
    first: usize,
    starts_chunk: bool,
    room: usize,
) -> Result<Slice, PlanError> {
    let mut descriptors = descriptors.peekable();
    let len = descriptors.peek().map_or(0, |d| d.len);
    let mut slice = Slice {
        copies: PackedCopies::default().ready(len, room),
        counts: CopiesFirst::default(),
        gave_up: false,
    };
    for (index, d) in descriptors.enumerate() {
        d.fits(first + index)?;
        let (p, f) = (&mut slice.copies, &mut slice.counts);
        if d.len != len {
            // Not what the caller promised: let the chunk be packed whole.
            slice.gave_up = true;
            break;
        }
        let second = f.take(index == 0, [d.src_addr, d.dst_addr], len);
        p.push_marked(d.src_addr, d.dst_addr, len, second);
        if starts_chunk && index + 1 == CopiesFirst::CHECKPOINT && !f.keeps(CopiesFirst::CHECKPOINT)
        {
            slice.gave_up = true;
            break;
        }
    }
    // The marks whole, a partial last byte included ([`stitch`] appends
    // nothing after it).
    if !slice.copies.gather.len().is_multiple_of(8) {
        slice.copies.flush();
    }
    Ok(slice)
}

/// Whether a chunk of `descriptors` (one length that packs back to back,
/// as [`pack_slice`] takes them) is still packed copies first after the
/// checkpoint: what its first slice decides there, from the chunk's
/// first [`CopiesFirst::CHECKPOINT`] descriptors alone, so that its other
/// slices need not wait for that slice to know.
pub fn copies_first_past_checkpoint(descriptors: impl Iterator<Item = Descriptor>) -> bool {
    let mut f = CopiesFirst::default();
    let mut n = 0;
    for d in descriptors.take(CopiesFirst::CHECKPOINT) {
        f.take(n == 0, [d.src_addr, d.dst_addr], d.len);
        n += 1;
    }
    n < CopiesFirst::CHECKPOINT || f.keeps(n)
}

impl Slice {
    /// Whether this is a chunk's first slice that stopped at the
    /// checkpoint: the chunk is packed whole, through the merge rule.
    pub fn gave_up(&self) -> bool {
        self.gave_up
    }

    /// Copies in the slice.
    fn len(&self) -> usize {
        self.copies.gather.len()
    }

    /// Appends `next`, the slice right after this one's last copy: its
    /// copies and marks, the marks at the seam made what one pass over
    /// both would make (`next`'s first copy was packed as if it began a
    /// chunk), and the counts and last copy of both. False when `next`
    /// cannot follow: another length, a slice that gave up or is empty,
    /// or this one ends in a partial mark byte (only a chunk's last slice
    /// may).
    fn append(&mut self, next: Slice) -> bool {
        let (p, q) = (&mut self.copies, &next.copies);
        let base = p.gather.len();
        if next.gave_up || q.len != p.len || q.gather.is_empty() || !base.is_multiple_of(8) {
            return false;
        }
        let len = p.len;
        let (f, g) = (&mut self.counts, &next.counts);
        let mut marks = [
            std::mem::take(&mut p.gather_marks),
            std::mem::take(&mut p.scatter_marks),
        ];
        for (s, (addrs, next_marks)) in
            [(&q.gather, &q.gather_marks), (&q.scatter, &q.scatter_marks)]
                .into_iter()
                .enumerate()
        {
            marks[s].extend_from_slice(next_marks);
            let bit = |marks: &[u8], j: usize| marks[j / 8] >> (j % 8) & 1 != 0;
            let forward = |j: usize| addrs[j] >= addrs[j - 1] + len;
            // The seam's copy as one pass takes it ([`CopiesFirst::add`]).
            let (a, last) = (addrs[0], f.last[s]);
            let seam_forward = a >= last + len;
            let seam_step = a.wrapping_sub(last);
            f.continuing[s] += usize::from(seam_forward & (f.step[s] == seam_step));
            // The copy after it continues the seam's step (its slice saw
            // no step before it).
            if addrs.len() > 1 {
                f.continuing[s] += usize::from(
                    seam_forward & forward(1) & (addrs[1].wrapping_sub(addrs[0]) == seam_step),
                );
            }
            // The greedy marks from the seam on, until they agree with the
            // slice's own (then all after agree).
            let mut mark = seam_forward & !f.marked[s];
            let mut j = 0;
            let mut pairs = f.pairs[s] + g.pairs[s];
            loop {
                let own = bit(next_marks, j);
                if j > 0 && mark == own {
                    break;
                }
                pairs = pairs + usize::from(mark) - usize::from(own);
                marks[s][(base + j) / 8] ^= u8::from(mark != own) << ((base + j) % 8);
                j += 1;
                if j == addrs.len() {
                    break;
                }
                mark = forward(j) & !mark;
            }
            f.pairs[s] = pairs;
            f.continuing[s] += g.continuing[s];
            f.step[s] = if addrs.len() > 1 {
                g.step[s]
            } else {
                seam_step & u64::from(seam_forward).wrapping_neg()
            };
            f.marked[s] = if j == addrs.len() { mark } else { g.marked[s] };
            f.last[s] = g.last[s];
        }
        [p.gather_marks, p.scatter_marks] = marks;
        p.gather.extend_from_slice(&q.gather);
        p.scatter.extend_from_slice(&q.scatter);
        p.next += q.next;
        true
    }
}

/// The chunk `slices` (one chunk's, in order, each from [`pack_slice`])
/// make: what [`pack`] makes of their descriptors, packed copies first.
/// `None` when that chunk is not its packed copies alone (the first slice
/// gave up, or the whole does not provably keep its copies): the caller
/// packs the chunk with [`pack`], as one pass would have.
pub fn stitch(slices: impl IntoIterator<Item = Slice>) -> Option<Chunk> {
    let mut slices = slices.into_iter();
    let mut whole = slices.next().filter(|s| !s.gave_up)?;
    for next in slices {
        if !whole.append(next) {
            return None;
        }
    }
    let n = whole.len();
    if n == 0 || !whole.counts.keeps(n) {
        return None;
    }
    let p = whole.copies;
    Some(Chunk {
        bytes: p.next,
        gather_runs: Runs::from_copies(Copies::planned(p.len, p.gather, p.gather_marks)),
        scatter_runs: Runs::from_copies(Copies::planned(p.len, p.scatter, p.scatter_marks)),
        pieces: u32::try_from(n).ok()?,
    })
}

impl ChunkBuilder<'_> {
    #[inline(always)]
    fn push(&mut self, at: u64, src: u64, dst: u64, len: u64) {
        if self.pieces == 0 {
            self.packed = self.copies.take().map(|c| c.ready(len, self.per_chunk));
            if self.copies_first && self.merge && self.packed.is_some() {
                // Copies first: no run lists unless it turns out they
                // are needed.
                self.first = Some(CopiesFirst::default());
            } else {
                self.take_run_lists();
            }
        }
        if self.first.is_some() {
            if self.push_copy_first(at, src, dst, len) {
                self.used = at + len;
                self.pieces += 1;
                if self.pieces as usize == CopiesFirst::CHECKPOINT
                    && self
                        .first
                        .as_ref()
                        .is_some_and(|f| !f.keeps(CopiesFirst::CHECKPOINT))
                {
                    self.runs_after_all();
                }
                return;
            }
            // A piece that is not the next packed copy: the chunk is
            // runs from here, its copies so far included.
            self.runs_after_all();
        }
        self.push_run(at, src, dst, len);
    }

    /// Run lists for the chunk being packed, from the pool.
    fn take_run_lists(&mut self) {
        self.gather = RunBuilder::new(self.pool.take(self.per_chunk));
        self.scatter = RunBuilder::new(self.pool.take(self.per_chunk));
    }

    /// Adds the next packed copy of a chunk packed copies first; false
    /// when the piece is not one.
    #[inline(always)]
    fn push_copy_first(&mut self, at: u64, src: u64, dst: u64, len: u64) -> bool {
        let (Some(p), Some(f)) = (&mut self.packed, &mut self.first) else {
            return false;
        };
        if len != p.len || at != p.next {
            return false;
        }
        let second = f.take(p.gather.is_empty(), [src, dst], len);
        // Checked above: the next packed copy.
        p.push_marked(src, dst, len, second);
        true
    }

    /// Ends copies first for the chunk being packed: its copies so far are
    /// packed again through the merge rule, runs and copies, as a chunk
    /// packed the rule's way from its first piece.
    fn runs_after_all(&mut self) {
        self.first = None;
        self.take_run_lists();
        let Some(so_far) = self.packed.take() else {
            return;
        };
        let (len, pieces) = (so_far.len, self.pieces);
        let fresh = self.spare.take().unwrap_or_default();
        self.packed = Some(fresh.ready(len, self.per_chunk));
        for (j, (&src, &dst)) in so_far.gather.iter().zip(&so_far.scatter).enumerate() {
            self.push_run(j as u64 * len, src, dst, len);
        }
        // `push_run` counted them again.
        self.pieces = pieces;
        self.park(so_far);
    }

    /// Keeps `storage` for the next chunk's packed copies, or as the
    /// spare when that is taken.
    fn park(&mut self, storage: PackedCopies) {
        if self.copies.is_none() {
            self.copies = Some(storage);
        } else {
            self.spare = Some(storage);
        }
    }

    /// Adds a piece to the run lists (and the packed copies, while the
    /// chunk still is).
    #[inline(always)]
    fn push_run(&mut self, at: u64, src: u64, dst: u64, len: u64) {
        let (g, s) = if self.merge {
            (
                self.gather.add(at, src, len),
                self.scatter.add(at, dst, len),
            )
        } else {
            self.gather.push(at, src, len);
            self.scatter.push(at, dst, len);
            (Added::Single, Added::Single)
        };
        if let Some(p) = &mut self.packed {
            if !p.push(at, src, dst, len, g, s) {
                // Not packed copies: runs alone, the storage kept for the
                // next chunk.
                if let Some(p) = self.packed.take() {
                    self.park(p);
                }
            }
        }
        self.used = at + len;
        self.pieces += 1;
    }

    fn finish_into(&mut self, chunks: &mut Vec<Chunk>) -> Result<(), PlanError> {
        if self.pieces == 0 {
            return Ok(());
        }
        if chunks.len() >= MAX_CHUNKS {
            return Err(PlanError::TooManyChunks);
        }
        // A chunk packed copies first that provably keeps its copies is
        // its copies' own runs; one that does not is packed again through
        // the merge rule, and decided as every other chunk.
        let kept_first = match self.first.take() {
            Some(f) if f.keeps(self.pieces as usize) => self.packed.take(),
            Some(_) => {
                self.runs_after_all();
                None
            }
            None => None,
        };
        let (gather_runs, scatter_runs) = match kept_first {
            Some(mut p) => {
                let (g, s) = p.finish();
                self.park(p);
                (Runs::from_copies(g), Runs::from_copies(s))
            }
            None => {
                // Packed copies pay where runs hardly merge (scattered
                // blocks: a copy costs the hosts' passes and the wire
                // about a quarter of what a run does); where the runs are
                // much fewer (blocks mostly in order), or are themselves
                // packed copies of a longer length (the wire's compact
                // form, fewer entries), the runs are kept alone.
                let runs = self.gather.runs().len().max(self.scatter.runs().len());
                let keep = |p: &PackedCopies| {
                    runs.saturating_mul(COPIES_PER_RUN) >= p.gather.len()
                        && !(coarser_copies(self.gather.runs(), p.len)
                            && coarser_copies(self.scatter.runs(), p.len))
                };
                let (gather, scatter) = match self.packed.take() {
                    Some(mut p) if keep(&p) => {
                        let (g, s) = p.finish();
                        self.park(p);
                        (Some(g), Some(s))
                    }
                    Some(p) => {
                        self.park(p);
                        (None, None)
                    }
                    None => (None, None),
                };
                (
                    Runs::pooled_with_copies(self.gather.take(), gather, self.pool),
                    Runs::pooled_with_copies(self.scatter.take(), scatter, self.pool),
                )
            }
        };
        chunks.push(Chunk {
            bytes: self.used,
            gather_runs,
            scatter_runs,
            pieces: self.pieces,
        });
        self.used = 0;
        self.pieces = 0;
        Ok(())
    }
}

/// A run list being built: each piece appended is merged into the last run
/// when the two are contiguous on both sides (the run grows) or continue a
/// uniform stride on both sides (the run's count grows), else starts a run.
/// The position the last run's next copy would take is kept at hand, so a
/// strided run grows by two comparisons, not two multiplications (the
/// plan's packing is most of an arena preparation). The planner builds
/// both sides of every chunk with it, the peer-mapped path its copies.
#[derive(Debug, Default)]
pub struct RunBuilder {
    runs: Vec<Run>,
    /// The region offset and address of the last run's next copy, when it
    /// has two copies or more (`None` past the address space).
    next: Option<(u64, u64)>,
}

impl RunBuilder {
    /// An empty builder that keeps its runs in `runs`' storage.
    pub fn new(mut runs: Vec<Run>) -> Self {
        runs.clear();
        RunBuilder { runs, next: None }
    }

    /// Appends the piece `(region_offset, addr, len)`; says what became
    /// of it.
    #[inline(always)]
    pub fn add(&mut self, region_offset: u64, addr: u64, len: u64) -> Added {
        if let Some(run) = self.runs.last_mut() {
            if run.count == 1 {
                // Contiguous on both sides: extend.
                if run.region_offset.checked_add(run.len) == Some(region_offset)
                    && run.addr.checked_add(run.len) == Some(addr)
                {
                    // A copy followed by one of its length: the run is the
                    // two of them (as copies, a run of two one block apart).
                    let joined = run.len == len;
                    run.len += len;
                    return if joined { Added::Joined } else { Added::Grown };
                }
                // Equal lengths, both sides moving forward without
                // overlap: start a strided run.
                if len == run.len
                    && region_offset >= run.region_offset + run.len
                    && addr >= run.addr.saturating_add(run.len)
                {
                    run.region_stride = region_offset - run.region_offset;
                    run.addr_stride = addr - run.addr;
                    run.count = 2;
                    self.next = step(region_offset, addr, run);
                    return Added::Paired;
                }
            } else if len == run.len
                && run.count < u32::MAX
                && self.next == Some((region_offset, addr))
            {
                run.count += 1;
                self.next = step(region_offset, addr, run);
                return Added::Grown;
            }
        }
        self.runs.push(Run::single(region_offset, addr, len));
        Added::Single
    }

    /// Appends the piece as a run of its own (a plan without merging).
    #[inline(always)]
    pub fn push(&mut self, region_offset: u64, addr: u64, len: u64) {
        self.runs.push(Run::single(region_offset, addr, len));
    }

    /// Empties the list, keeping its storage.
    pub fn clear(&mut self) {
        self.runs.clear();
        self.next = None;
    }

    /// The runs so far.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// The list, for more room (`reserve`).
    pub fn runs_mut(&mut self) -> &mut Vec<Run> {
        &mut self.runs
    }

    /// The list, the builder left empty.
    pub fn take(&mut self) -> Vec<Run> {
        self.next = None;
        std::mem::take(&mut self.runs)
    }
}

/// What [`RunBuilder::add`] made of a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Added {
    /// A run of its own.
    Single,
    /// The second copy of a strided run begun by the piece before.
    Paired,
    /// The second copy of a run begun by the piece before, contiguous with
    /// it on both sides: the run is one piece twice as long, and as packed
    /// copies the two are a run of two (strides of one piece).
    Joined,
    /// Longer run: appended to a contiguous run of two or more pieces, or
    /// a strided run's third copy or later.
    Grown,
}

/// The copy after the one at `(region_offset, addr)` of a strided `run`.
#[inline]
fn step(region_offset: u64, addr: u64, run: &Run) -> Option<(u64, u64)> {
    Some((
        region_offset.checked_add(run.region_stride)?,
        addr.checked_add(run.addr_stride)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The merge rule as it was first written (a multiplication per
    /// strided piece): the oracle [`RunBuilder`] is checked against.
    /// Appends the piece `(region_offset, addr, len)` to `runs`, merging it into
    /// the last run when the two are contiguous on both sides (the run grows) or
    /// continue a uniform stride on both sides (the run's count grows).
    fn add_piece(runs: &mut Vec<Run>, region_offset: u64, addr: u64, len: u64, merge: bool) {
        if merge {
            if let Some(last) = runs.last_mut() {
                if try_merge(last, region_offset, addr, len) {
                    return;
                }
            }
        }
        runs.push(Run::single(region_offset, addr, len));
    }

    fn try_merge(run: &mut Run, region_offset: u64, addr: u64, len: u64) -> bool {
        if run.count == 1 {
            // Contiguous on both sides: extend.
            if run.region_offset.checked_add(run.len) == Some(region_offset)
                && run.addr.checked_add(run.len) == Some(addr)
            {
                run.len += len;
                return true;
            }
            // Equal lengths, both sides moving forward without overlap: start a
            // strided run.
            if len == run.len
                && region_offset >= run.region_offset + run.len
                && addr >= run.addr.saturating_add(run.len)
            {
                run.region_stride = region_offset - run.region_offset;
                run.addr_stride = addr - run.addr;
                run.count = 2;
                return true;
            }
            return false;
        }
        if len != run.len || run.count == u32::MAX {
            return false;
        }
        let n = u64::from(run.count);
        let next_region = n
            .checked_mul(run.region_stride)
            .and_then(|s| run.region_offset.checked_add(s));
        let next_addr = n
            .checked_mul(run.addr_stride)
            .and_then(|s| run.addr.checked_add(s));
        if next_region == Some(region_offset) && next_addr == Some(addr) {
            run.count += 1;
            return true;
        }
        false
    }
    use proptest::prelude::*;

    fn d(src: u64, dst: u64, len: u64) -> Descriptor {
        Descriptor {
            src_addr: src,
            src_dev: 0,
            dst_addr: dst,
            dst_dev: 1,
            len,
        }
    }

    fn opts(cap: u64) -> PlanOptions {
        PlanOptions::capped(cap, true)
    }

    /// Expands runs into (region_offset, addr, len) triples.
    fn expand(runs: &[Run]) -> Vec<(u64, u64, u64)> {
        runs.iter()
            .flat_map(|r| r.copies().collect::<Vec<_>>())
            .collect()
    }

    #[test]
    fn empty_and_zero_length() {
        let p = build(&[], opts(1024)).unwrap();
        assert!(p.chunks.is_empty());
        let p = build(&[d(0, 0, 0), d(10, 10, 0)], opts(1024)).unwrap();
        assert!(p.chunks.is_empty());
    }

    #[test]
    fn aligned_offsets_and_chunk_boundaries() {
        let p = build(
            &[d(0, 1000, 10), d(100, 2000, 10), d(200, 3000, 40)],
            opts(64),
        )
        .unwrap();
        // 10 @0, 10 @32, 40 does not fit at 64 -> new chunk.
        assert_eq!(p.chunk_sizes(), vec![42, 40]);
        assert_eq!(
            expand(&p.chunks[0].scatter_runs),
            vec![(0, 1000, 10), (32, 2000, 10)]
        );
    }

    #[test]
    fn large_descriptor_is_split() {
        let p = build(&[d(0, 0, 10), d(1000, 5000, 200)], opts(64)).unwrap();
        // 10 @0; 200 bytes: 32 bytes fill chunk 0 at 32, then 64, 64, 40.
        assert_eq!(p.chunk_sizes(), vec![64, 64, 64, 40]);
        let all: Vec<_> = p
            .chunks
            .iter()
            .flat_map(|c| expand(&c.gather_runs))
            .collect();
        assert_eq!(all[1], (32, 1000, 32));
        assert_eq!(all[2], (0, 1032, 64));
        assert_eq!(all.last(), Some(&(0, 1160, 40)));
    }

    #[test]
    fn mixed_devices_rejected() {
        let mut x = d(0, 0, 8);
        x.src_dev = 3;
        assert_eq!(
            build(&[d(0, 0, 8), x], opts(64)),
            Err(PlanError::MixedSourceDevices {
                index: 1,
                expected: 0,
                found: 3
            })
        );
        let mut y = d(0, 0, 8);
        y.dst_dev = 7;
        assert!(matches!(
            build(&[d(0, 0, 8), y], opts(64)),
            Err(PlanError::MixedDestinationDevices { index: 1, .. })
        ));
        assert!(matches!(
            build(&[d(u64::MAX, 0, 8)], opts(64)),
            Err(PlanError::AddressOverflow { index: 0 })
        ));
        assert!(matches!(
            build(&[d(0, 0, 8)], opts(16)),
            Err(PlanError::ChunkTooSmall(16))
        ));
    }

    #[test]
    fn run_lists_go_back_to_their_pool_and_are_reused() {
        let pool = RunPool::default();
        // Scattered: one run per descriptor, 4 chunks of 4 (cap 4 x 64).
        let descs: Vec<_> = (0..16u64)
            .map(|i| d(i * 1000, (1 << 30) + i * 3000, 64))
            .collect();
        let plan = build_from(descs.iter().copied(), opts(256), &pool).unwrap();
        assert_eq!(plan.chunks.len(), 4);
        let lists: Vec<*const Run> = plan
            .chunks
            .iter()
            .flat_map(|c| [c.gather_runs.as_ptr(), c.scatter_runs.as_ptr()])
            .collect();
        // A holder of one list keeps it out of the pool.
        let held = plan.chunks[0].gather_runs.clone();
        drop(plan);
        let again = build_from(descs.iter().copied(), opts(256), &pool).unwrap();
        let reused: Vec<*const Run> = again
            .chunks
            .iter()
            .flat_map(|c| [c.gather_runs.as_ptr(), c.scatter_runs.as_ptr()])
            .collect();
        let from_before = reused.iter().filter(|p| lists.contains(p)).count();
        assert_eq!(from_before, 7, "every list but the held one is reused");
        assert!(!reused.contains(&held.as_ptr()));
        assert_eq!(again, build(&descs, opts(256)).unwrap());
    }

    #[test]
    fn a_pool_keeps_a_bounded_number_of_runs() {
        let pool = RunPool::default();
        let big = || Runs::pooled(pool.take(RunPool::KEPT_RUNS / 2 + 1), &pool);
        let (a, b) = (big(), big());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        drop((a, b));
        // Only one of the two fits under the bound: one list comes back.
        let kept = [pool.take(0), pool.take(0)];
        let back = kept.iter().filter(|v| v.as_ptr() == pa || v.as_ptr() == pb);
        assert_eq!(back.count(), 1);
    }

    #[test]
    fn dense_descriptors_collapse_to_one_run() {
        let descs: Vec<_> = (0..64)
            .map(|i| d(i * 4096, (1 << 30) | (i * 4096), 4096))
            .collect();
        let p = build(&descs, opts(1 << 20)).unwrap();
        assert_eq!(p.chunks.len(), 1);
        assert_eq!(p.chunks[0].scatter_runs.len(), 1);
        assert_eq!(p.chunks[0].scatter_runs[0].len, 64 * 4096);
    }

    #[test]
    fn strided_descriptors_collapse_to_one_strided_run() {
        // Every other 4 KiB block on the destination (tp split), dense source.
        let descs: Vec<_> = (0..100).map(|i| d(i * 4096, i * 8192, 4096)).collect();
        let p = build(&descs, opts(1 << 20)).unwrap();
        let s = &p.chunks[0].scatter_runs;
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].count, s[0].region_stride, s[0].addr_stride),
            (100, 4096, 8192)
        );
        assert_eq!(p.chunks[0].gather_runs.len(), 1);
        // Debug option: no merging.
        let p = build(&descs, PlanOptions::capped(1 << 20, false)).unwrap();
        assert_eq!(p.chunks[0].scatter_runs.len(), 100);
    }

    #[test]
    fn unaligned_lengths_stride_over_padding() {
        let descs: Vec<_> = (0..10).map(|i| d(i * 100, 5000 + i * 100, 100)).collect();
        let p = build(&descs, opts(1 << 20)).unwrap();
        let s = &p.chunks[0].scatter_runs;
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].count, s[0].region_stride, s[0].addr_stride),
            (10, 128, 100)
        );
        assert_eq!(p.chunks[0].bytes, 9 * 128 + 100);
    }

    /// Scattered blocks keep their copies copies first: their runs are
    /// the copies' own (one copy, or a marked pair), where the merge rule
    /// makes three blocks one step apart one run; blocks in order go
    /// through the merge rule after the checkpoint (one run).
    #[test]
    fn scattered_blocks_are_packed_copies_first_and_blocks_in_order_are_not() {
        let len = 4096;
        let mut r = crate::splitmix::SplitMix64::new(3);
        let (mut a, mut b): (Vec<u64>, Vec<u64>) = ((0..4096).collect(), (0..4096).collect());
        r.shuffle(&mut a);
        r.shuffle(&mut b);
        // Blocks 0, 2 and 4 on one side and 0, 3 and 6 on the other
        // first (one strided run to the rule), then scattered ones.
        let mut scattered: Vec<_> = (0..3u64)
            .map(|i| d((1 << 30) + 2 * i * len, (1 << 38) + 3 * i * len, len))
            .collect();
        scattered.extend((0..1021).map(|i| d((1 << 32) + a[i] * len, (1 << 40) + b[i] * len, len)));
        let in_order: Vec<_> = (0..1024u64)
            .map(|i| d((1 << 32) + i * len, (1 << 40) + i * len, len))
            .collect();
        let options = PlanOptions::capped(1 << 20, true);
        let mut survey = Survey::default();
        for x in &scattered {
            survey.add(x).unwrap();
        }
        let pool = RunPool::default();
        let rule = pack_chunks(
            scattered.iter().copied(),
            0,
            &survey,
            1 << 20,
            true,
            &pool,
            false,
        );
        assert_eq!(
            rule.unwrap()[0].gather_runs[0].count,
            3,
            "the rule's strided run"
        );
        for c in &build(&scattered, options).unwrap().chunks {
            for runs in [&c.gather_runs, &c.scatter_runs] {
                let copies = runs.copies().expect("kept");
                let pairs = (0..copies.addrs().len())
                    .filter(|&j| copies.marked(j))
                    .count();
                assert_eq!(runs.len(), copies.addrs().len() - pairs);
                assert!(runs.iter().all(|r| r.count <= 2), "the copies' own runs");
            }
        }
        for c in &build(&in_order, options).unwrap().chunks {
            assert!(c.gather_runs.copies().is_none());
            assert_eq!(c.gather_runs.len(), 1);
        }
    }

    #[test]
    fn a_chunk_of_scattered_blocks_stitched_from_slices_is_the_one_pass_chunk() {
        let (len, n) = (4096u64, 2048usize + 100);
        let mut r = crate::splitmix::SplitMix64::new(11);
        let (mut a, mut b): (Vec<u64>, Vec<u64>) = ((0..1 << 16).collect(), (0..1 << 16).collect());
        r.shuffle(&mut a);
        r.shuffle(&mut b);
        let descs: Vec<_> = (0..n)
            .map(|i| d((1 << 32) + a[i] * len, (1 << 40) + b[i] * len, len))
            .collect();
        let mut survey = Survey::default();
        for x in &descs {
            survey.add(x).unwrap();
        }
        let cap = n as u64 * len;
        let rule = pack(
            descs.iter().copied(),
            0,
            &survey,
            cap,
            true,
            &RunPool::default(),
        )
        .unwrap();
        // Slices of 512, the last a partial mark byte.
        let slice = slice_len(512);
        let slices = (0..n).step_by(slice).map(|at| {
            let end = (at + slice).min(n);
            pack_slice(
                descs[at..end].iter().copied(),
                at,
                at == 0,
                if at == 0 { n } else { end - at },
            )
            .unwrap()
        });
        let chunk = stitch(slices).expect("scattered blocks keep their copies");
        assert_eq!(chunk, rule[0]);
        assert_eq!(chunk.gather_runs.copies(), rule[0].gather_runs.copies());
        assert_eq!(chunk.scatter_runs.copies(), rule[0].scatter_runs.copies());
        assert!(chunk.gather_runs.copies().is_some());
        assert!(copies_first_past_checkpoint(descs.iter().copied()));
        // Blocks in order: the first slice gives up at the checkpoint.
        let in_order: Vec<_> = (0..n as u64)
            .map(|i| d((1 << 32) + i * len, (1 << 40) + i * len, len))
            .collect();
        let first = pack_slice(in_order[..slice].iter().copied(), 0, true, n).unwrap();
        assert!(first.gave_up && first.len() == CopiesFirst::CHECKPOINT);
        assert!(!copies_first_past_checkpoint(in_order.iter().copied()));
        assert!(stitch([first]).is_none());
    }

    /// Layouts of `len`-byte blocks for the packing proptests.
    const LAYOUTS: u8 = 9;

    /// `picks.len()` descriptors of `len` bytes (a pick `(a, b)` of 0..600
    /// each) in `layout`: random blocks, blocks in order with gaps, strides
    /// with jumps, in order then random, contiguous, one step, random then
    /// in order, random with contiguous stretches, and blocks that start
    /// inside the one before (quarter blocks: not forward, a step all the
    /// same); with `high`, at the top of the address space.
    fn layout_descs(layout: u8, picks: &[(u64, u64)], len: u64, high: bool) -> Vec<Descriptor> {
        let n = picks.len();
        let (src0, dst0) = if high {
            (u64::MAX - 4096 * len, u64::MAX - 4096 * len)
        } else {
            (1 << 24, 1 << 36)
        };
        let block = |i: usize, (a, b): (u64, u64)| -> (u64, u64) {
            let (first_half, i) = (i < n / 2, i as u64);
            let (x, y) = match layout {
                0 => (a, b),
                1 => (i + a / 200, 2 * i + b / 300),
                2 if a % 17 == 0 => (a, b),
                2 => (3 * i, 5 * i + 1),
                3 if first_half => (i, i),
                3 => (a, b),
                4 => (i, i),
                5 => (2 * i, 3 * i),
                6 if first_half => (a, b),
                6 => (i, i),
                7 if a % 5 == 0 => (i, i),
                7 => (a, b),
                _ => return ((2 * i + a % 3) * (len / 4), b * len),
            };
            (x * len, y * len)
        };
        picks
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let (x, y) = block(i, p);
                d(src0 + x, dst0 + y, len)
            })
            .collect()
    }

    proptest! {
        /// Descriptors of one length packed in runs of whole chunks (as the
        /// engine packs them on several threads) and assembled make the
        /// plan that one pass makes.
        #[test]
        fn runs_of_whole_chunks_assemble_into_the_same_plan(
            n in 1usize..300,
            len in 1u64..200,
            cap in 32u64..1024,
            min_chunks in 1u64..6,
            gaps in proptest::collection::vec(0u64..3, 300),
            cuts in proptest::collection::vec(1usize..5, 1..8),
        ) {
            let descs: Vec<_> = (0..n)
                .map(|i| d(1 << 20 | (i as u64 * 300 + gaps[i] * 64), 1 << 32 | (i as u64 * 256 + gaps[(i * 7) % 300] * 8), len))
                .collect();
            let options = PlanOptions { max_chunk_bytes: cap, merge_runs: true, min_chunks, min_chunk_bytes: 64 };
            let whole = build(&descs, options).unwrap();
            let mut survey = Survey::default();
            for x in &descs {
                survey.add(x).unwrap();
            }
            let c = cut(&survey, &options);
            let Some(k) = c.per_chunk else {
                prop_assert!(len > c.cap);
                prop_assert_eq!(c.sizes(&survey), None);
                return Ok(());
            };
            // The sizes a WANT sent before the packing carries.
            prop_assert_eq!(c.sizes(&survey), Some(whole.chunk_sizes()));
            let pool = RunPool::default();
            let (mut chunks, mut at, mut i) = (Vec::new(), 0, 0);
            while at < n {
                let end = (at + cuts[i % cuts.len()] * k).min(n);
                chunks.extend(pack(descs[at..end].iter().copied(), at, &survey, c.cap, true, &pool).unwrap());
                (at, i) = (end, i + 1);
            }
            prop_assert_eq!(assemble(&survey, chunks).unwrap(), whole);
        }

        /// A chunk's packed copies move exactly what its runs move (a run
        /// of contiguous blocks or of three strided ones or more is copies
        /// of their own), their marks are what `Copies::new` takes, and a
        /// chunk of one length's blocks back to back has them on both
        /// sides, merged or not, unless its runs are far fewer
        /// (`COPIES_PER_RUN`) or packed copies of a longer length.
        #[test]
        fn chunks_of_equal_blocks_are_packed_copies_of_their_runs(
            n in 1usize..200,
            unit in 1u64..5,
            cap_blocks in 1u64..64,
            picks in proptest::collection::vec((0u64..400, 0u64..400), 200),
            merge in any::<bool>(),
        ) {
            let len = unit * REGION_ALIGN * 4;
            // Blocks drawn from a 400-block pool on each side (repeats
            // allowed): pairs, strides, contiguous runs and gaps all occur.
            let descs: Vec<_> = picks[..n]
                .iter()
                .map(|&(a, b)| d((1 << 24) + a * len, (1 << 34) + b * len, len))
                .collect();
            let options = PlanOptions { max_chunk_bytes: cap_blocks.max(1) * len, merge_runs: merge, min_chunks: 1, min_chunk_bytes: 64 };
            let plan = build(&descs, options).unwrap();
            for (i, c) in plan.chunks.iter().enumerate() {
                let sides = [("gather", &c.gather_runs), ("scatter", &c.scatter_runs)];
                // Every piece is a whole block here (a chunk holds whole
                // blocks): packed copies unless the runs are much fewer or
                // packed copies of a longer length themselves.
                let most_runs = sides.iter().map(|(_, runs)| runs.len()).max().unwrap_or(0);
                let packable = most_runs * COPIES_PER_RUN >= c.pieces as usize
                    && !sides.iter().all(|(_, runs)| coarser_copies(runs, len));
                for (side, runs) in sides {
                    match runs.copies() {
                        Some(copies) => {
                            prop_assert!(copies.same_copies_as(runs), "chunk {} {}: {:?} against {:?}", i, side, copies, runs);
                            prop_assert!(packable, "chunk {} {}: copies beside {} runs", i, side, runs.len());
                            // Checked as Copies::new checks them.
                            let own = Copies::new(len, 0, copies.addrs().to_vec(), copies.marks().to_vec());
                            prop_assert!(own.as_ref().is_ok_and(Copies::addresses_fit), "chunk {} {}: {:?}", i, side, own);
                        }
                        None => prop_assert!(!packable, "chunk {} {}: runs {:?} have no copies", i, side, runs),
                    }
                }
            }
        }

        /// Chunks packed copies first ([`CopiesFirst`]) are what the
        /// merge rule makes of them, whatever the layout: the same chunks
        /// (bytes, pieces), the same copies kept or not, at the same
        /// addresses, the same bytes moved; a chunk that kept its copies
        /// copies first reads as the copies' own runs, with marks
        /// `Copies::new` takes.
        #[test]
        fn copies_first_keeps_what_the_merge_rule_keeps(
            n in 1usize..300,
            cap_blocks in 0u64..160,
            cap_rest in 1u64..128,
            layout in 0u8..LAYOUTS,
            high in any::<bool>(),
            picks in proptest::collection::vec((0u64..600, 0u64..600), 300),
        ) {
            let len = 4 * REGION_ALIGN * 32;
            let descs = layout_descs(layout, &picks[..n], len, high);
            // A cap that is not whole blocks, and at times less than one
            // (every block split across chunks: no packed copies).
            let cap = cap_blocks * len + cap_rest * REGION_ALIGN;
            let options = PlanOptions { max_chunk_bytes: cap, merge_runs: true, min_chunks: 1, min_chunk_bytes: 64 };
            let mut survey = Survey::default();
            for x in &descs {
                survey.add(x).unwrap();
            }
            let cap = cut(&survey, &options).cap;
            let pool = RunPool::default();
            let first = pack_chunks(descs.iter().copied(), 0, &survey, cap, true, &pool, true).unwrap();
            let rule = pack_chunks(descs.iter().copied(), 0, &survey, cap, true, &pool, false).unwrap();
            prop_assert_eq!(first.len(), rule.len());
            // Each side's bytes in pieces of at most one block, in order.
            let pieces = |runs: &Runs| -> Vec<(u64, u64, u64)> {
                expand(runs)
                    .into_iter()
                    .flat_map(|(o, a, l)| (0..l.div_ceil(len)).map(move |k| (o + k * len, a + k * len, len.min(l - k * len))))
                    .collect()
            };
            for (i, (a, b)) in first.iter().zip(&rule).enumerate() {
                prop_assert_eq!((a.bytes, a.pieces), (b.bytes, b.pieces), "chunk {}", i);
                for (x, y) in [(&a.gather_runs, &b.gather_runs), (&a.scatter_runs, &b.scatter_runs)] {
                    prop_assert_eq!(x.copies().map(Copies::addrs), y.copies().map(Copies::addrs), "chunk {}", i);
                    prop_assert_eq!(pieces(x), pieces(y), "chunk {}", i);
                    if y.copies().is_none() {
                        // Runs alone: the merge rule's, exactly.
                        prop_assert_eq!(x, y, "chunk {}", i);
                    }
                    if let Some(c) = x.copies() {
                        prop_assert!(c.same_copies_as(x), "chunk {}", i);
                        let own = Copies::new(len, 0, c.addrs().to_vec(), c.marks().to_vec());
                        prop_assert!(own.is_ok_and(|o| o.addresses_fit()), "chunk {}", i);
                    }
                }
            }
        }

        /// A chunk packed in slices ([`pack_slice`]) and stitched is the
        /// chunk [`pack`] makes of the same descriptors, its copies and
        /// marks included, whatever the layout and wherever the slices
        /// are cut (whole mark bytes, the first at least the checkpoint),
        /// blocks that overlap the one before included;
        /// and where `stitch` declines, so does the chunk as one slice
        /// (slicing never changes the decision).
        #[test]
        fn slices_stitch_into_the_chunk_one_pass_makes(
            n in 1usize..400,
            layout in 0u8..LAYOUTS,
            high in any::<bool>(),
            picks in proptest::collection::vec((0u64..600, 0u64..600), 400),
            cuts in proptest::collection::vec(1usize..12, 1..12),
        ) {
            let len = 4 * REGION_ALIGN * 32;
            let descs = layout_descs(layout, &picks[..n], len, high);
            let mut survey = Survey::default();
            for x in &descs {
                survey.add(x).unwrap();
            }
            // One chunk of all n.
            let cap = n as u64 * len;
            prop_assert!(sliceable(&survey, true));
            let rule = pack(descs.iter().copied(), 0, &survey, cap, true, &RunPool::default()).unwrap();
            prop_assert_eq!(rule.len(), 1);
            // Slices of whole mark bytes, the first at least the checkpoint.
            let (mut slices, mut at, mut i) = (Vec::new(), 0, 0);
            while at < n {
                let size = 8 * cuts[i % cuts.len()];
                let size = if at == 0 { size.max(CopiesFirst::CHECKPOINT) } else { size };
                let end = (at + size).min(n);
                let room = if at == 0 { n } else { end - at };
                slices.push(pack_slice(descs[at..end].iter().copied(), at, at == 0, room).unwrap());
                (at, i) = (end, i + 1);
            }
            let count = slices.len();
            prop_assert_eq!(copies_first_past_checkpoint(descs.iter().copied()), !slices[0].gave_up());
            let whole = stitch([pack_slice(descs.iter().copied(), 0, true, n).unwrap()]);
            match stitch(slices) {
                Some(c) => {
                    prop_assert_eq!(&c, &rule[0], "{} slices", count);
                    prop_assert_eq!(c.gather_runs.copies(), rule[0].gather_runs.copies());
                    prop_assert_eq!(c.scatter_runs.copies(), rule[0].scatter_runs.copies());
                    prop_assert!(whole.is_some());
                }
                None => prop_assert!(whole.is_none(), "{} slices declined, one took it", count),
            }
        }

        /// [`RunBuilder`] (the next copy kept at hand) and the rule as
        /// first written make the same runs.
        #[test]
        fn run_builder_merges_by_the_rule(
            pieces in proptest::collection::vec((0u64..4, 0u64..3, 1u64..4, any::<bool>()), 1..80),
        ) {
            let (mut fast, mut rule) = (RunBuilder::default(), Vec::new());
            let (mut region, mut addr) = (0u64, 1u64 << 20);
            for (region_gap, addr_gap, len, near_end) in pieces {
                let len = len * 8;
                region += region_gap * 8;
                // Addresses mostly climb by small strides; now and then
                // they jump near the end of the address space.
                addr = if near_end { u64::MAX - len - addr_gap } else { addr.wrapping_add(addr_gap * 8) % (1 << 40) };
                fast.add(region, addr, len);
                add_piece(&mut rule, region, addr, len, true);
                region += len;
                addr = addr.wrapping_add(len);
            }
            prop_assert_eq!(fast.take(), rule);
        }

        /// Every descriptor byte is moved exactly once, pieces never overlap
        /// in a region, offsets are aligned, chunks respect the cap, and
        /// merged and unmerged plans move the same bytes.
        #[test]
        fn plan_covers_every_byte_once(
            lens in proptest::collection::vec(0u64..300, 0..60),
            gaps in proptest::collection::vec(0u64..3, 60),
            cap in 32u64..512,
            merge in any::<bool>(),
        ) {
            let mut descs = Vec::new();
            let (mut src, mut dst) = (1u64 << 20, 1u64 << 30);
            for (i, &len) in lens.iter().enumerate() {
                descs.push(d(src, dst, len));
                src += len + gaps[i] * 7;
                dst += len + gaps[(i + 1) % 60] * 16;
            }
            let p = build(&descs, PlanOptions::capped(cap, merge)).unwrap();
            let mut moved_src = Vec::new();
            let mut moved_dst = Vec::new();
            for c in &p.chunks {
                prop_assert!(c.bytes <= cap && c.bytes > 0);
                let g = expand(&c.gather_runs);
                let s = expand(&c.scatter_runs);
                let gb: u64 = g.iter().map(|x| x.2).sum();
                let sb: u64 = s.iter().map(|x| x.2).sum();
                prop_assert_eq!(gb, sb);
                let mut spans: Vec<(u64, u64)> = g.iter().map(|&(o, _, l)| (o, o + l)).collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "overlap in region");
                }
                prop_assert_eq!(spans.last().map(|s| s.1), Some(c.bytes));
                for r in c.scatter_runs.iter().chain(c.gather_runs.iter()) {
                    prop_assert!(r.region_end().unwrap() <= c.bytes);
                }
                // Map region bytes back to src and dst byte by byte.
                for &(o, a, l) in &g { for k in 0..l { moved_src.push((o + k, a + k)); } }
                for &(o, a, l) in &s { for k in 0..l { moved_dst.push((o + k, a + k)); } }
                let mut ms = std::mem::take(&mut moved_src);
                let mut md = std::mem::take(&mut moved_dst);
                ms.sort_unstable(); md.sort_unstable();
                prop_assert_eq!(ms.len(), md.len());
                for (x, y) in ms.iter().zip(&md) {
                    prop_assert_eq!(x.0, y.0);
                    // Same descriptor byte: src and dst offsets agree.
                    let di = descs.iter().position(|dd| x.1 >= dd.src_addr && x.1 < dd.src_addr + dd.len).unwrap();
                    prop_assert_eq!(x.1 - descs[di].src_addr, y.1 - descs[di].dst_addr);
                }
                for r in c.gather_runs.iter() {
                    prop_assert_eq!(r.region_offset % REGION_ALIGN, 0);
                }
            }
            let total: u64 = lens.iter().sum();
            let planned: u64 = p.chunks.iter().flat_map(|c| c.scatter_runs.iter()).map(|r| r.total_bytes().unwrap()).sum();
            prop_assert_eq!(total, planned);
        }
    }

    #[test]
    fn a_request_is_cut_into_at_least_min_chunks() {
        let o = PlanOptions {
            max_chunk_bytes: 32 << 20,
            merge_runs: true,
            min_chunks: 4,
            min_chunk_bytes: 1 << 20,
        };
        // 16 MiB: four chunks of 4 MiB, not one of 16.
        let descs: Vec<_> = (0..4096).map(|i| d(i * 8192, i * 4096, 4096)).collect();
        assert_eq!(chunk_cap(&o, 16 << 20), 4 << 20);
        assert_eq!(build(&descs, o).unwrap().chunk_sizes(), vec![4 << 20; 4]);
        // 2 MiB: 1 MiB chunks at the least, so two.
        assert_eq!(chunk_cap(&o, 2 << 20), 1 << 20);
        assert_eq!(build(&descs[..512], o).unwrap().chunks.len(), 2);
        // Small requests stay one chunk; large ones keep the cap.
        assert_eq!(build(&descs[..64], o).unwrap().chunks.len(), 1);
        assert_eq!(chunk_cap(&o, 1 << 30), 32 << 20);
        // An odd share is aligned up (every piece starts 32-byte aligned).
        assert_eq!(chunk_cap(&o, (16 << 20) + 4), (4 << 20) + 32);
        // Off: the cap alone.
        assert_eq!(
            chunk_cap(&PlanOptions::capped(32 << 20, true), 16 << 20),
            32 << 20
        );
    }
}

#[cfg(test)]
mod cost {
    use super::*;

    /// Not a benchmark: how long a plan of vLLM's TP=8 READ at 2048 tokens
    /// (64 regions x 128 scattered 4 KiB blocks) takes here, warm, its run
    /// lists from a pool.
    /// `cargo test --release --lib plan_cost -- --ignored --nocapture`;
    /// `PLAN_COST_ROUNDS=N` plans N times (1000), e.g. under callgrind,
    /// whose counts are steady where this VM's times are not.
    /// `PLAN_COST_RANDOM=N`: N blocks of 4 KiB in a random order on both
    /// sides instead (as `bounce-vram bench` makes them);
    /// `PLAN_COST_IN_ORDER=N`: N blocks in order on both sides instead;
    /// `PLAN_COST_COLD=1`: the caches evicted before each plan (64 MiB
    /// touched), as a lone request's plan finds them.
    #[test]
    #[ignore]
    fn plan_cost() {
        let (regions, blocks, len) = (64u64, 128u64, 4096u64);
        let mut v = Vec::new();
        let random: Option<u64> = std::env::var("PLAN_COST_RANDOM")
            .ok()
            .and_then(|n| n.parse().ok());
        let random_layout = |n: u64, seed: u64| {
            let mut r = crate::splitmix::SplitMix64::new(seed);
            let (mut a, mut b): (Vec<u64>, Vec<u64>) = ((0..4 * n).collect(), (0..4 * n).collect());
            r.shuffle(&mut a);
            r.shuffle(&mut b);
            a.iter()
                .zip(&b)
                .take(n as usize)
                .map(|(a, b)| Descriptor {
                    src_addr: (1 << 32) + a * len,
                    src_dev: 0,
                    dst_addr: (1 << 40) + b * len,
                    dst_dev: 0,
                    len,
                })
                .collect::<Vec<_>>()
        };
        if let Some(n) = random {
            v.extend(random_layout(n, 7));
        }
        // `PLAN_COST_FRESH=1` (with PLAN_COST_RANDOM): each plan of
        // another of 16 random layouts, as every real request brings its
        // own blocks; one layout planned again and again lets the branch
        // predictor learn it, which no client's requests allow.
        let fresh: Vec<Vec<Descriptor>> = match (random, std::env::var_os("PLAN_COST_FRESH")) {
            (Some(n), Some(_)) => (0..16).map(|i| random_layout(n, 100 + i)).collect(),
            _ => Vec::new(),
        };
        // `PLAN_COST_IN_ORDER=N`: N blocks in order on both sides (the
        // layout copies first leaves to the merge rule).
        let in_order: Option<u64> = std::env::var("PLAN_COST_IN_ORDER")
            .ok()
            .and_then(|n| n.parse().ok());
        if let Some(n) = in_order {
            v.extend((0..n).map(|i| Descriptor {
                src_addr: (1 << 32) + i * len,
                src_dev: 0,
                dst_addr: (1 << 40) + i * len,
                dst_dev: 0,
                len,
            }));
        }
        for r in 0..if random.is_some() || in_order.is_some() {
            0
        } else {
            regions
        } {
            for b in 0..blocks {
                v.push(Descriptor {
                    src_addr: (1 << 32) + r * (1 << 24) + ((b * 7919) % 256) * len,
                    src_dev: 0,
                    dst_addr: (1 << 40) + r * (1 << 24) + ((b * 104_729) % 256) * len,
                    dst_dev: 0,
                    len,
                });
            }
        }
        let options = PlanOptions {
            max_chunk_bytes: 32 << 20,
            merge_runs: true,
            min_chunks: 4,
            min_chunk_bytes: 4 << 20,
        };
        let pool = RunPool::default();
        let rounds: usize = std::env::var("PLAN_COST_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(1000)
            .max(1);
        let cold = std::env::var_os("PLAN_COST_COLD").is_some();
        let mut evict = vec![0u8; if cold { 64 << 20 } else { 0 }];
        let mut times = Vec::with_capacity(rounds);
        for i in 0..rounds {
            for b in evict.iter_mut().step_by(64) {
                *b = b.wrapping_add(i as u8);
            }
            std::hint::black_box(&evict);
            let list = fresh.get(i % 16).unwrap_or(&v);
            let t = std::time::Instant::now();
            let p = build_from(list.iter().copied(), options, &pool).expect("planned");
            times.push(t.elapsed().as_nanos());
            std::hint::black_box(p);
        }
        times.sort_unstable();
        let us = |ns: u128| ns as f64 / 1e3;
        println!(
            "plan of {} descriptors{}: {:.1} us best, {:.1} us median (of {rounds})",
            v.len(),
            if cold { ", caches evicted" } else { "" },
            us(times[0]),
            us(times[times.len() / 2])
        );
    }
}
