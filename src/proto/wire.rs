//! Control-plane wire codec: messages and the capability handshake blob.
//!
//! All integers little-endian. Every message starts with a 12-byte header:
//!
//! | bytes | field | value |
//! |---|---|---|
//! | 0..4 | magic | `NXBM` |
//! | 4..6 | wire version | [`WIRE_VERSION`] |
//! | 6 | type | [`MessageType`] |
//! | 7 | flags | 0 (reserved; non-zero is rejected) |
//! | 8..12 | payload length | bytes after the header |
//!
//! The decoder checks every field, bounds every count against the bytes that
//! are actually present before allocating, rejects trailing bytes and
//! returns a [`WireError`] naming what was wrong. It never panics.

use thiserror::Error;

use super::{check_marks, runs_of_marked_copies, Copies, RegionHandle, RequestId, Run, Runs};

/// Message header magic.
pub const MESSAGE_MAGIC: [u8; 4] = *b"NXBM";
/// Handshake blob magic.
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"NXBH";
/// The wire version this build speaks.
pub const WIRE_VERSION: u16 = 3;
/// Handshake blob format version.
pub const HANDSHAKE_FORMAT: u16 = 2;
/// Header length.
pub const HEADER_LEN: usize = 12;

/// Maximum chunks in one WANT.
pub const MAX_WANT_CHUNKS: u32 = 1 << 24;
/// Maximum credits in one GRANT.
pub const MAX_GRANT_CREDITS: u32 = 1 << 16;
/// Maximum runs in one DATA.
pub const MAX_DATA_RUNS: u32 = 1 << 22;
/// Maximum endpoint length (bytes).
pub const MAX_ENDPOINT_LEN: u32 = 64 * 1024;
/// Maximum chunks in one READ.
pub const MAX_READ_CHUNKS: u32 = MAX_WANT_CHUNKS;
/// Maximum length of the reader's data-path description in a READ (bytes).
pub const MAX_DATA_PATH_LEN: u32 = 1 << 20;
/// Largest encoded control message a channel carries (the ZMQ channel
/// disconnects a peer that sends more). A DATA stays far below it (one
/// chunk's runs); a READ carries every chunk's runs, so a READ plan is
/// checked against it before it starts.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Most run-list entries one message may carry (a READ's over all its
/// chunks): as many as fit [`MAX_MESSAGE_BYTES`] at 44 bytes each, so a
/// list of 8-byte copies decodes to no more memory than a full one could.
pub const MAX_MESSAGE_RUNS: usize = MAX_MESSAGE_BYTES / RUN_BYTES;

const CREDIT_LEN: usize = 4 + 8 + 8;
const RUN_LEN: usize = 8 + 8 + 8 + 4 + 8 + 8;

/// Declares a wire enum whose codes are written once: the `#[repr(u8)]`
/// enum with its discriminants, [`WireCode`] (the code to write) and
/// `TryFrom<u8>` (`Err(code)` for a code of no variant), which
/// [`Reader::code`] decodes with.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $code:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u8)]
        $vis enum $name {
            $($(#[$vmeta])* $variant = $code,)*
        }

        impl TryFrom<u8> for $name {
            type Error = u8;
            fn try_from(code: u8) -> Result<Self, u8> {
                match code {
                    $($code => Ok(Self::$variant),)*
                    other => Err(other),
                }
            }
        }

        impl WireCode for $name {
            fn code(self) -> u8 {
                self as u8
            }
        }
    };
}

/// A one-byte code on the wire (declared with `wire_enum!`).
pub trait WireCode: TryFrom<u8, Error = u8> + Copy {
    fn code(self) -> u8;
}

wire_enum! {
/// Message type codes. 1-5 serve WRITE flows; 16-21 serve READ flows
/// (22-31 stay reserved for the READ direction). A READ flow's GRANT, DATA,
/// ACK and REFUSE are their WRITE twins with 16 added to the type code, in
/// the opposite direction (the reader grants, the data owner writes).
pub enum MessageType {
    /// Sender asks for credits (an empty WANT is a CANCEL).
    Want = 1,
    /// Receiver hands out credits.
    Grant = 2,
    /// Sender reports a chunk written.
    Data = 3,
    /// Receiver reports a chunk scattered.
    Ack = 4,
    /// Receiver refuses or aborts a flow.
    Refuse = 5,
    /// A WANT that also says what the sender does with the receiver's
    /// standing credit ([`StandingUse`]): sent only to a receiver whose
    /// handshake advertises [`Capabilities::STANDING`], and telling the
    /// receiver that the sender takes STANDING messages. An empty one is
    /// the CANCEL of a request that claimed an offer, naming the claim.
    WantStanding = 6,
    /// Receiver offers a standing credit: one region the sender may write
    /// a request's first chunk into without asking ([`Message::Standing`]).
    Standing = 7,
    /// Reader asks the data owner to move sources into regions it grants.
    Read = 16,
    /// Data owner stops serving a READ (none of its writes can still land).
    ReadEnd = 17,
    /// Reader hands the data owner credits (GRANT's payload).
    ReadGrant = 18,
    /// Data owner reports a chunk written (no runs: the reader scatters by
    /// its own plan).
    ReadData = 19,
    /// Reader reports a chunk scattered (ACK's payload).
    ReadAck = 20,
    /// Reader aborts a READ (REFUSE's payload).
    ReadRefuse = 21,
}
}

/// The type code, request id and (for DATA and ACK) chunk index of an
/// encoded message, read from their fixed positions without validating
/// anything else: for instrumentation that must not decode twice. The
/// message may still be rejected by [`Message::decode`]. `None` for a
/// STANDING, which names no request.
pub fn peek(bytes: &[u8]) -> Option<(u8, RequestId, Option<u32>)> {
    let field = |at: usize, n: usize| bytes.get(at..at + n);
    if field(0, 4)? != MESSAGE_MAGIC {
        return None;
    }
    let ty = *bytes.get(6)?;
    if ty == MessageType::Standing as u8 {
        return None;
    }
    let request = RequestId(u64::from_le_bytes(field(HEADER_LEN, 8)?.try_into().ok()?));
    let chunk = if [
        MessageType::Data,
        MessageType::Ack,
        MessageType::ReadData,
        MessageType::ReadAck,
    ]
    .iter()
    .any(|&t| t as u8 == ty)
    {
        Some(u32::from_le_bytes(
            field(HEADER_LEN + 8, 4)?.try_into().ok()?,
        ))
    } else {
        None
    };
    Some((ty, request, chunk))
}

/// First type code of the READ range.
pub const RESERVED_READ_FIRST: u8 = 16;
/// First READ-range type code this build does not know (22..=31 stay
/// reserved).
pub const RESERVED_READ_UNUSED_FIRST: u8 = 22;
/// Last type code reserved for READ messages.
pub const RESERVED_READ_LAST: u8 = 31;

/// Decode failures.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Input ended early.
    #[error("truncated {what}: need {need} more bytes, {have} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// Wrong magic.
    #[error("bad magic {found:02x?} (expected {expected:02x?})")]
    BadMagic {
        /// Bytes found.
        found: [u8; 4],
        /// Bytes expected.
        expected: [u8; 4],
    },
    /// Unsupported version.
    #[error("unsupported {what} version {found} (this build speaks {supported})")]
    Version {
        /// Which version field.
        what: &'static str,
        /// Version found.
        found: u16,
        /// Version supported.
        supported: u16,
    },
    /// Unknown message type.
    #[error("unknown message type {0}")]
    UnknownType(u8),
    /// A type reserved for a later protocol revision (READ range, unused).
    #[error("message type {0} is reserved for READ messages, not supported by this build")]
    ReservedType(u8),
    /// Non-zero reserved header flags.
    #[error("reserved header flags {0:#04x} must be zero")]
    BadFlags(u8),
    /// Header length disagrees with the bytes present.
    #[error("header says {declared} payload bytes but {actual} are present")]
    LengthMismatch {
        /// Declared length.
        declared: u64,
        /// Actual length.
        actual: u64,
    },
    /// Bytes left after the last field.
    #[error("{0} trailing bytes after the {1}")]
    Trailing(usize, &'static str),
    /// A count above its protocol bound.
    #[error("{what} count {count} exceeds the limit {limit}")]
    CountTooLarge {
        /// The counted thing.
        what: &'static str,
        /// Count found.
        count: u64,
        /// Bound.
        limit: u64,
    },
    /// A field with an invalid value.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

/// Reads little-endian fields from a byte slice, with bounds checks.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Reads from `buf`.
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Takes the next `n` bytes.
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                what,
                need: n,
                have: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Reads `N` bytes as an array.
    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    /// Reads a u8.
    pub fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(what)?[0])
    }

    /// Reads a one-byte code of `T`; an unknown code is invalid.
    pub fn code<T: WireCode>(&mut self, what: &'static str) -> Result<T, WireError> {
        T::try_from(self.u8(what)?).map_err(|other| WireError::Invalid {
            what,
            why: format!("unknown code {other}"),
        })
    }

    /// Reads a little-endian u16.
    pub fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    /// Reads a little-endian u32.
    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// Reads a little-endian u64.
    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a u32 element count, checks it against `limit` and against the
    /// bytes left (`elem_len` bytes per element) before anything is
    /// allocated.
    pub fn count(
        &mut self,
        what: &'static str,
        limit: u32,
        elem_len: usize,
    ) -> Result<usize, WireError> {
        let n = self.u32(what)?;
        if n > limit {
            return Err(WireError::CountTooLarge {
                what,
                count: u64::from(n),
                limit: u64::from(limit),
            });
        }
        let n = n as usize;
        let need = n.saturating_mul(elem_len);
        if need > self.remaining() {
            return Err(WireError::Truncated {
                what,
                need,
                have: self.remaining(),
            });
        }
        Ok(n)
    }

    /// Reads and checks a 4-byte magic then a u16 version (named `magic`
    /// and `version` in errors).
    pub fn header(
        &mut self,
        magic: [u8; 4],
        magic_name: &'static str,
        version: u16,
        version_name: &'static str,
    ) -> Result<(), WireError> {
        let found: [u8; 4] = self.array(magic_name)?;
        if found != magic {
            return Err(WireError::BadMagic {
                found,
                expected: magic,
            });
        }
        let found = self.u16(version_name)?;
        if found != version {
            return Err(WireError::Version {
                what: version_name,
                found,
                supported: version,
            });
        }
        Ok(())
    }

    /// Fails if any byte is left.
    pub fn finish(&self, what: &'static str) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n, what)),
        }
    }
}

/// Appends little-endian fields to a byte vector.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Writer {
        Writer::default()
    }

    /// An empty writer with room for `n` bytes.
    pub fn with_capacity(n: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }

    /// Overwrites the u32 at byte `at` (a length written before its
    /// contents were known). Panics if `at..at + 4` was not written.
    pub fn patch_u32(&mut self, at: usize, v: u32) {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Appends a u8.
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    /// Appends a u16.
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Appends a u32.
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Appends a u64.
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }

    /// Appends `n` zero bytes and returns them, to be written in place.
    pub fn room(&mut self, n: usize) -> &mut [u8] {
        let at = self.buf.len();
        self.buf.resize(at + n, 0);
        &mut self.buf[at..]
    }

    /// Appends a u32 length then the bytes.
    pub fn len_prefixed(&mut self, v: &[u8]) {
        self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        self.bytes(v);
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Nothing written yet.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
}

/// One credit: exclusive permission to write chunk `chunk` into the
/// receiver's region `region` of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credit {
    /// Chunk index within the request.
    pub chunk: u32,
    /// Region in the receiver's arena.
    pub region: RegionHandle,
    /// Granted bytes (the chunk's size).
    pub len: u64,
}

/// What a WANT says about the receiver's standing credit
/// ([`Message::Standing`]). Anything but `None` is encoded as a
/// WANT_STANDING, which only a receiver advertising
/// [`Capabilities::STANDING`] is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StandingUse {
    /// Nothing: a plain WANT (the receiver offers no standing credits).
    None,
    /// The sender takes standing credits and holds none of this receiver's:
    /// offer one.
    Wanted,
    /// The sender holds one and keeps it for a later request (this one's
    /// first chunk does not fit it).
    Held,
    /// The request's first chunk is written into the standing region
    /// `region`, offered as `token`: the receiver grants that chunk no
    /// credit, the region is the chunk's.
    Claimed {
        /// The offer's token.
        token: u64,
        /// The offered region.
        region: RegionHandle,
    },
    /// Only in [`Message::Return`] (a WANT_STANDING with no chunks): the
    /// offer `token` of `region`, held and never claimed, is given back.
    Returned {
        /// The offer's token.
        token: u64,
        /// The offered region.
        region: RegionHandle,
    },
}

/// A standing offer a request claimed ([`StandingUse::Claimed`]),
/// named again by that request's CANCEL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The offer's token.
    pub token: u64,
    /// The offered region.
    pub region: RegionHandle,
}

impl StandingUse {
    /// The offer it claims, if it does.
    pub fn claim(self) -> Option<Claim> {
        match self {
            StandingUse::Claimed { token, region } => Some(Claim { token, region }),
            _ => None,
        }
    }

    /// Bytes it adds to a WANT's payload.
    fn encoded_len(self) -> usize {
        match self {
            StandingUse::None => 0,
            StandingUse::Wanted | StandingUse::Held => 9,
            StandingUse::Claimed { .. } | StandingUse::Returned { .. } => 25,
        }
    }
}

wire_enum! {
/// Why a receiver refuses or aborts a flow.
pub enum RefuseReason {
    /// The receiver's arena is poisoned.
    Poisoned = 1,
    /// The receiver is shutting down.
    ShuttingDown = 2,
    /// A chunk is larger than the receiver can ever grant.
    ChunkTooLarge = 3,
    /// The sender broke the protocol (bad DATA runs, duplicate flow, ...).
    ProtocolViolation = 4,
    /// The receiver's scatter failed.
    ScatterFailed = 5,
    /// The flow expired at the receiver (no activity).
    Expired = 6,
    /// READ: a requested source range is not memory the data owner
    /// registered with BOUNCE (nothing was read).
    SourceRefused = 7,
    /// READ: the data owner's gather or write failed, or it timed out.
    SenderFailed = 8,
    /// READ: the reader gave up (cancelled, timed out, deadline).
    Cancelled = 9,
}
}

/// One chunk of a READ: its size in the reader's arena and the copies the
/// data owner gathers into it (`addr` = the owner's source address,
/// `region_offset` relative to the chunk's region).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadChunk {
    /// Packed bytes of the chunk (what the reader will grant).
    pub size: u64,
    /// Owner memory -> region copies.
    pub runs: Runs,
}

/// A control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Sender -> receiver: the chunk sizes of a new request.
    Want {
        /// The sender's request id (the flow id together with the peer).
        request: RequestId,
        /// Per-chunk byte sizes (never empty; empty is [`Message::Cancel`]).
        chunk_sizes: Vec<u64>,
        /// The sender's own control endpoint (reverse-path bootstrap).
        endpoint: Vec<u8>,
        /// The receiver's access key, from the receiver's handshake (which
        /// only peers that loaded its metadata have).
        key: u64,
        /// What the sender does with the receiver's standing credit
        /// (encoded as a WANT_STANDING unless [`StandingUse::None`]).
        standing: StandingUse,
        /// The sender's incarnation, carried by a WANT_STANDING (0 in a
        /// plain WANT, which has none): a receiver sends an offer to one
        /// incarnation of a peer name, and only that one may claim it.
        incarnation: u64,
    },
    /// Sender -> receiver: retract the flow (encoded as a WANT with no
    /// chunks; as a WANT_STANDING with none when it names a claim). Sent
    /// only once none of the request's writes can still land.
    Cancel {
        /// The sender's request id.
        request: RequestId,
        /// The sender's control endpoint.
        endpoint: Vec<u8>,
        /// The receiver's access key.
        key: u64,
        /// The standing offer the request claimed in its WANT, if it did:
        /// spent here if that WANT never arrived (or was refused), since
        /// none of the request's writes into the slot can land any more.
        claim: Option<Claim>,
        /// The sender's incarnation, carried with a claim (0 without one).
        incarnation: u64,
    },
    /// Sender -> receiver: this incarnation gives back the standing offer
    /// it holds and never claimed (it is shutting down), and takes no more
    /// (encoded as a WANT_STANDING with no chunks, request 0, use 4). The
    /// receiver may offer the slot to the sender's next incarnation at
    /// once: nothing was written into it. No reply goes to it (its
    /// endpoint is sent empty).
    Return {
        /// The receiver's access key.
        key: u64,
        /// The offer given back.
        offer: Claim,
        /// The sender's incarnation (the one the offer went to).
        incarnation: u64,
    },
    /// Receiver -> sender: credits.
    Grant {
        /// The request.
        request: RequestId,
        /// The credits, in chunk order.
        credits: Vec<Credit>,
    },
    /// Sender -> receiver: chunk `chunk` landed in `region`; scatter it.
    Data {
        /// The request.
        request: RequestId,
        /// The chunk.
        chunk: u32,
        /// The receiver region written.
        region: RegionHandle,
        /// Region -> destination runs (offsets relative to the region).
        runs: Runs,
    },
    /// Receiver -> sender: chunk `chunk` scattered, region recycled.
    Ack {
        /// The request.
        request: RequestId,
        /// The chunk.
        chunk: u32,
        /// The region it used.
        region: RegionHandle,
    },
    /// Receiver -> sender: the flow is refused or aborted.
    Refuse {
        /// The request.
        request: RequestId,
        /// Why.
        reason: RefuseReason,
    },
    /// Receiver -> sender: a standing credit. The sender may write the
    /// first chunk of its next request (at most `len` bytes) into `region`
    /// at once, naming `token` in that request's WANT
    /// ([`StandingUse::Claimed`]), without waiting for a GRANT. One region
    /// per sender at a time; a new offer (a larger token) follows each claim
    /// once the region is free again.
    Standing {
        /// Names this offer; offers to one sender grow (a sender takes only
        /// a token above every one it has claimed).
        token: u64,
        /// The region in the receiver's arena.
        region: RegionHandle,
        /// Its bytes.
        len: u64,
        /// The incarnation of the sender it is offered to (from its
        /// WANT_STANDING): another incarnation under the same name, which
        /// cannot know what the first claimed, does not take it.
        incarnation: u64,
    },
    /// Reader -> data owner: gather these sources, chunk by chunk, and
    /// write each chunk into the region the reader grants for it.
    Read {
        /// The reader's request id (the flow id together with the reader).
        request: RequestId,
        /// The owner's access key, from the owner's handshake.
        key: u64,
        /// The reader's control endpoint (reverse-path bootstrap).
        endpoint: Vec<u8>,
        /// How to write into the reader's arena (opaque to the protocol:
        /// the runtime loads it; see [`super::endpoint::Action::LoadDataPath`]).
        data_path: Vec<u8>,
        /// The chunks (never empty).
        chunks: Vec<ReadChunk>,
    },
    /// Data owner -> reader: the owner stopped serving the READ; none of its
    /// writes can still land, so every region of the flow may be reused.
    ReadEnd {
        /// The reader's request id.
        request: RequestId,
        /// Why.
        reason: RefuseReason,
    },
    /// Reader -> data owner: credits for a READ.
    ReadGrant {
        /// The reader's request id.
        request: RequestId,
        /// The credits.
        credits: Vec<Credit>,
    },
    /// Data owner -> reader: chunk `chunk` landed in `region`.
    ReadData {
        /// The reader's request id.
        request: RequestId,
        /// The chunk.
        chunk: u32,
        /// The reader region written.
        region: RegionHandle,
    },
    /// Reader -> data owner: chunk `chunk` scattered, region recycled.
    ReadAck {
        /// The reader's request id.
        request: RequestId,
        /// The chunk.
        chunk: u32,
        /// The region it used.
        region: RegionHandle,
    },
    /// Reader -> data owner: the reader aborts the READ (the owner stops
    /// and answers with READ_END once its writes ended).
    ReadRefuse {
        /// The reader's request id.
        request: RequestId,
        /// Why.
        reason: RefuseReason,
    },
}

impl Message {
    /// A CANCEL (empty WANT) for `request`, which claimed no offer.
    pub fn cancel(request: RequestId, endpoint: Vec<u8>, key: u64) -> Message {
        Message::Cancel {
            request,
            endpoint,
            key,
            claim: None,
            incarnation: 0,
        }
    }

    /// The wire type.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::Want {
                standing: StandingUse::None,
                ..
            }
            | Message::Cancel { claim: None, .. } => MessageType::Want,
            Message::Want { .. } | Message::Cancel { .. } | Message::Return { .. } => {
                MessageType::WantStanding
            }
            Message::Standing { .. } => MessageType::Standing,
            Message::Grant { .. } => MessageType::Grant,
            Message::Data { .. } => MessageType::Data,
            Message::Ack { .. } => MessageType::Ack,
            Message::Refuse { .. } => MessageType::Refuse,
            Message::Read { .. } => MessageType::Read,
            Message::ReadEnd { .. } => MessageType::ReadEnd,
            Message::ReadGrant { .. } => MessageType::ReadGrant,
            Message::ReadData { .. } => MessageType::ReadData,
            Message::ReadAck { .. } => MessageType::ReadAck,
            Message::ReadRefuse { .. } => MessageType::ReadRefuse,
        }
    }

    /// Encodes header + payload.
    pub fn encode(&self) -> Vec<u8> {
        // One buffer, sized up front: a DATA of thousands of runs is
        // hundreds of KiB, encoded on every post.
        let mut p = Writer::with_capacity(HEADER_LEN + self.payload_len_bound());
        p.bytes(&MESSAGE_MAGIC);
        p.u16(WIRE_VERSION);
        p.u8(self.message_type().code());
        p.u8(0);
        p.u32(0); // payload length, patched below
        match self {
            Message::Want {
                request,
                chunk_sizes,
                endpoint,
                key,
                standing,
                incarnation,
            } => {
                encode_want(&mut p, *request, chunk_sizes, endpoint, *key);
                encode_standing_use(&mut p, *standing, *incarnation);
            }
            Message::Standing {
                token,
                region,
                len,
                incarnation,
            } => {
                p.u64(*token);
                p.u64(region.0);
                p.u64(*len);
                p.u64(*incarnation);
            }
            Message::Cancel {
                request,
                endpoint,
                key,
                claim,
                incarnation,
            } => {
                encode_want(&mut p, *request, &[], endpoint, *key);
                if let Some(Claim { token, region }) = *claim {
                    let claimed = StandingUse::Claimed { token, region };
                    encode_standing_use(&mut p, claimed, *incarnation);
                }
            }
            Message::Return {
                key,
                offer,
                incarnation,
            } => {
                encode_want(&mut p, RequestId(0), &[], &[], *key);
                let returned = StandingUse::Returned {
                    token: offer.token,
                    region: offer.region,
                };
                encode_standing_use(&mut p, returned, *incarnation);
            }
            Message::Grant { request, credits } | Message::ReadGrant { request, credits } => {
                encode_grant(&mut p, *request, credits)
            }
            Message::Data {
                request,
                chunk,
                region,
                runs,
            } => {
                p.u64(request.0);
                p.u32(*chunk);
                p.u64(region.0);
                encode_runs(&mut p, runs);
            }
            Message::Ack {
                request,
                chunk,
                region,
            }
            | Message::ReadData {
                request,
                chunk,
                region,
            }
            | Message::ReadAck {
                request,
                chunk,
                region,
            } => {
                p.u64(request.0);
                p.u32(*chunk);
                p.u64(region.0);
            }
            Message::Refuse { request, reason }
            | Message::ReadEnd { request, reason }
            | Message::ReadRefuse { request, reason } => {
                p.u64(request.0);
                p.u8(reason.code());
            }
            Message::Read {
                request,
                key,
                endpoint,
                data_path,
                chunks,
            } => {
                p.u64(request.0);
                p.u64(*key);
                p.len_prefixed(endpoint);
                p.len_prefixed(data_path);
                p.u32(chunks.len() as u32);
                for c in chunks {
                    p.u64(c.size);
                    encode_runs(&mut p, &c.runs);
                }
            }
        }
        let payload_len = p.len() - HEADER_LEN;
        p.patch_u32(HEADER_LEN - 4, payload_len as u32);
        p.into_bytes()
    }

    /// At least the payload's encoded size, without looking at the runs
    /// (every run list in its full form): what `encode` reserves.
    fn payload_len_bound(&self) -> usize {
        self.payload_len_with(|runs| match packed_copies(runs) {
            Some(c) => packed_len(c.addrs().len()),
            None => 5 + RUN_LEN * runs.len(),
        })
    }

    /// The run-list entries the encoding carries (runs, or copies in the
    /// compact forms), at most [`MAX_MESSAGE_RUNS`] for the receiver.
    pub fn run_entries(&self) -> usize {
        match self {
            Message::Data { runs, .. } => list_wire(runs).entries,
            Message::Read { chunks, .. } => chunks.iter().map(|c| list_wire(&c.runs).entries).sum(),
            _ => 0,
        }
    }

    /// The payload's encoded size (exact; checked by `messages_round_trip`).
    pub fn payload_len_hint(&self) -> usize {
        self.payload_len_with(runs_len)
    }

    /// The payload's size with each run list taking `list(runs)` bytes.
    fn payload_len_with(&self, list: impl Fn(&Runs) -> usize) -> usize {
        match self {
            Message::Want {
                chunk_sizes,
                endpoint,
                standing,
                ..
            } => 24 + 8 * chunk_sizes.len() + endpoint.len() + standing.encoded_len(),
            Message::Standing { .. } => 32,
            Message::Cancel {
                endpoint, claim, ..
            } => 24 + endpoint.len() + if claim.is_some() { 25 } else { 0 },
            Message::Return { .. } => 24 + 25,
            Message::Grant { credits, .. } => 12 + 20 * credits.len(),
            Message::Data { runs, .. } => 20 + list(runs),
            Message::Read {
                endpoint,
                data_path,
                chunks,
                ..
            } => {
                28 + endpoint.len()
                    + data_path.len()
                    + chunks.iter().map(|c| 8 + list(&c.runs)).sum::<usize>()
            }
            Message::ReadGrant { credits, .. } => 12 + 20 * credits.len(),
            Message::Ack { .. } | Message::ReadData { .. } | Message::ReadAck { .. } => 20,
            Message::Refuse { .. } | Message::ReadEnd { .. } | Message::ReadRefuse { .. } => 9,
        }
    }

    /// Decodes one message; the input must be exactly one message.
    pub fn decode(bytes: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader::new(bytes);
        r.header(MESSAGE_MAGIC, "magic", WIRE_VERSION, "wire")?;
        let ty = r.u8("message type")?;
        let flags = r.u8("header flags")?;
        let declared = r.u32("payload length")?;
        if u64::from(declared) != r.remaining() as u64 {
            return Err(WireError::LengthMismatch {
                declared: u64::from(declared),
                actual: r.remaining() as u64,
            });
        }
        if (RESERVED_READ_UNUSED_FIRST..=RESERVED_READ_LAST).contains(&ty) {
            return Err(WireError::ReservedType(ty));
        }
        if flags != 0 {
            return Err(WireError::BadFlags(flags));
        }
        let ty = MessageType::try_from(ty).map_err(WireError::UnknownType)?;
        let msg = match ty {
            MessageType::Want => decode_want(&mut r, false)?,
            MessageType::WantStanding => decode_want(&mut r, true)?,
            MessageType::Standing => Message::Standing {
                token: r.u64("standing token")?,
                region: RegionHandle(r.u64("region")?),
                len: r.u64("standing length")?,
                incarnation: r.u64("incarnation")?,
            },
            MessageType::Grant => {
                let (request, credits) = decode_grant(&mut r)?;
                Message::Grant { request, credits }
            }
            MessageType::Data => Message::Data {
                request: RequestId(r.u64("request id")?),
                chunk: r.u32("chunk index")?,
                region: RegionHandle(r.u64("region")?),
                runs: decode_runs(&mut r, &mut MAX_MESSAGE_RUNS.clone())?,
            },
            MessageType::Ack => Message::Ack {
                request: RequestId(r.u64("request id")?),
                chunk: r.u32("chunk index")?,
                region: RegionHandle(r.u64("region")?),
            },
            MessageType::Refuse => Message::Refuse {
                request: RequestId(r.u64("request id")?),
                reason: r.code::<RefuseReason>("refuse reason")?,
            },
            MessageType::Read => decode_read(&mut r)?,
            MessageType::ReadEnd => Message::ReadEnd {
                request: RequestId(r.u64("request id")?),
                reason: r.code::<RefuseReason>("READ_END reason")?,
            },
            MessageType::ReadGrant => {
                let (request, credits) = decode_grant(&mut r)?;
                Message::ReadGrant { request, credits }
            }
            MessageType::ReadData => Message::ReadData {
                request: RequestId(r.u64("request id")?),
                chunk: r.u32("chunk index")?,
                region: RegionHandle(r.u64("region")?),
            },
            MessageType::ReadAck => Message::ReadAck {
                request: RequestId(r.u64("request id")?),
                chunk: r.u32("chunk index")?,
                region: RegionHandle(r.u64("region")?),
            },
            MessageType::ReadRefuse => Message::ReadRefuse {
                request: RequestId(r.u64("request id")?),
                reason: r.code::<RefuseReason>("READ_REFUSE reason")?,
            },
        };
        r.finish("message")?;
        Ok(msg)
    }
}

/// The little-endian u64 at the start of `b` (at least 8 bytes).
fn le_u64(b: &[u8]) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[..8]);
    u64::from_le_bytes(v)
}

/// One run from its `RUN_LEN` encoded bytes.
fn parse_run(b: &[u8]) -> Run {
    let u64_at = |at: usize| le_u64(&b[at..]);
    let mut count = [0u8; 4];
    count.copy_from_slice(&b[24..28]);
    Run {
        region_offset: u64_at(0),
        addr: u64_at(8),
        len: u64_at(16),
        count: u32::from_le_bytes(count),
        region_stride: u64_at(28),
        addr_stride: u64_at(36),
    }
}

fn encode_grant(p: &mut Writer, request: RequestId, credits: &[Credit]) {
    p.u64(request.0);
    p.u32(credits.len() as u32);
    for c in credits {
        p.u32(c.chunk);
        p.u64(c.region.0);
        p.u64(c.len);
    }
}

fn decode_grant(r: &mut Reader<'_>) -> Result<(RequestId, Vec<Credit>), WireError> {
    let request = RequestId(r.u64("request id")?);
    let n = r.count("credit", MAX_GRANT_CREDITS, CREDIT_LEN)?;
    if n == 0 {
        return Err(WireError::Invalid {
            what: "GRANT",
            why: "no credits".into(),
        });
    }
    let mut credits = Vec::with_capacity(n);
    for _ in 0..n {
        credits.push(Credit {
            chunk: r.u32("credit chunk")?,
            region: RegionHandle(r.u64("credit region")?),
            len: r.u64("credit length")?,
        });
    }
    Ok((request, credits))
}

/// Bytes of one encoded run in the full form.
const RUN_BYTES: usize = 44;

wire_enum! {
/// How a run list is laid out (wire version 3): the encoder takes the most
/// compact form the list allows. A list's copies are all of one length in
/// real clients' transfers (vLLM's blocks), and the plan packs them back
/// to back in the region, so a copy is its address alone: 8 bytes on the
/// wire instead of a run's 44. DATA and READ carry these lists; at 16,384
/// blocks a READ shrinks from about 0.5 MB to 131 KB.
enum RunForm {
    /// Every field of every run (`RUN_BYTES` a run).
    Full = 0,
    /// Copies of one length: the length, which copies are a run's second,
    /// then (region offset, address) a copy.
    Copies = 1,
    /// Copies of one length back to back in the region: the length, the
    /// first region offset, which copies are a run's second, then the
    /// address a copy.
    Packed = 2,
}
}

/// A run list's encoding: its form and how many entries it writes (runs
/// in the full form, copies in the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RunWire {
    form: RunForm,
    entries: usize,
}

/// The most compact form of `runs`. The compact forms list copies: a run
/// of two copies (the plan merges two blocks whose addresses both step
/// forward) is two entries, the second marked in a bitmap, so the decoder
/// rebuilds exactly the runs encoded. A run of more copies, mixed lengths,
/// anything whose copies overflow, or a list whose copies would pass
/// [`MAX_DATA_RUNS`] keeps the full form.
fn run_wire(runs: &[Run]) -> RunWire {
    let full = RunWire {
        form: RunForm::Full,
        entries: runs.len(),
    };
    let Some(first) = runs.first() else {
        return full;
    };
    let len = first.len;
    let mut copies = 0usize;
    let mut packed = true;
    // Where the next copy lies if the list is packed.
    let mut next = Some(first.region_offset);
    for r in runs {
        if r.len != len || r.count == 0 || r.count > 2 {
            return full;
        }
        if r.count == 2 {
            let (Some(off), Some(_)) = (
                r.region_offset.checked_add(r.region_stride),
                r.addr.checked_add(r.addr_stride),
            ) else {
                return full;
            };
            packed &= next == Some(r.region_offset);
            next = next.and_then(|x| x.checked_add(len));
            packed &= next == Some(off);
        } else {
            packed &= next == Some(r.region_offset);
            // A single copy's strides mean nothing; the full form keeps
            // them, so a list with any set keeps it too (decoding gives
            // back exactly what was encoded).
            if r.region_stride != 0 || r.addr_stride != 0 {
                return full;
            }
        }
        next = next.and_then(|x| x.checked_add(len));
        copies += r.count as usize;
    }
    if copies > MAX_DATA_RUNS as usize {
        return full;
    }
    RunWire {
        form: if packed {
            RunForm::Packed
        } else {
            RunForm::Copies
        },
        entries: copies,
    }
}

/// The packed copies a list is encoded from, when it has them (the
/// planner's chunks of equal blocks, a decoded packed list): the bytes
/// [`run_wire`] would write from the copies' own runs
/// (`copies_encode_as_their_runs`), without a pass over runs. A plan's
/// runs may differ from those (two neighbouring copies as one run, a run
/// of three strided copies or more): the same bytes move either way
/// (`Copies::same_copies_as`).
fn packed_copies(list: &Runs) -> Option<&Copies> {
    list.copies()
        .filter(|c| c.addresses_fit() && c.addrs().len() <= MAX_DATA_RUNS as usize)
}

/// The form of a list: its packed copies', else its runs' ([`run_wire`]).
fn list_wire(list: &Runs) -> RunWire {
    match packed_copies(list) {
        Some(c) => RunWire {
            form: RunForm::Packed,
            entries: c.addrs().len(),
        },
        None => run_wire(list),
    }
}

/// The encoded bytes of a packed list of `n` copies.
fn packed_len(n: usize) -> usize {
    5 + 16 + n.div_ceil(8) + 8 * n
}

/// The encoded bytes of `runs` (form, count and entries).
fn runs_len(runs: &Runs) -> usize {
    let w = list_wire(runs);
    let marks = w.entries.div_ceil(8);
    match w.form {
        RunForm::Full => 5 + RUN_BYTES * w.entries,
        RunForm::Copies => 5 + 8 + marks + 16 * w.entries,
        RunForm::Packed => packed_len(w.entries),
    }
}

/// Writes the compact forms' marks and entries: `marks` (one bit a copy)
/// and `entries` (`WIDTH` bytes a copy: the address, after the region
/// offset when `WIDTH` is 16), both zeroed and sized for `runs`' copies
/// (checked by [`run_wire`] not to overflow). One indexed loop (iterator
/// chains were several times slower: docs/benchmarks.md).
fn write_copies<const WIDTH: usize>(runs: &[Run], marks: &mut [u8], entries: &mut [u8]) {
    let mut put = |j: usize, off: u64, addr: u64| {
        let e = &mut entries[j * WIDTH..(j + 1) * WIDTH];
        if WIDTH == 16 {
            e[..8].copy_from_slice(&off.to_le_bytes());
        }
        e[WIDTH - 8..].copy_from_slice(&addr.to_le_bytes());
    };
    let mut j = 0;
    for r in runs {
        put(j, r.region_offset, r.addr);
        if r.count == 2 {
            marks[(j + 1) / 8] |= 1 << ((j + 1) % 8);
            put(
                j + 1,
                r.region_offset.wrapping_add(r.region_stride),
                r.addr.wrapping_add(r.addr_stride),
            );
        }
        j += r.count as usize;
    }
}

fn encode_runs(p: &mut Writer, list: &Runs) {
    if let Some(c) = packed_copies(list) {
        // Straight from the copies: the marks as they are, an address a
        // copy (the same bytes as from their runs).
        let n = c.addrs().len();
        p.u8(RunForm::Packed.code());
        p.u32(n as u32);
        p.u64(c.copy_len());
        p.u64(c.first());
        let (m, e) = p.room(n.div_ceil(8) + 8 * n).split_at_mut(n.div_ceil(8));
        m.copy_from_slice(c.marks());
        for (b, a) in e.chunks_exact_mut(8).zip(c.addrs()) {
            b.copy_from_slice(&a.to_le_bytes());
        }
        return;
    }
    let runs: &[Run] = list;
    let w = run_wire(runs);
    p.u8(w.form.code());
    p.u32(w.entries as u32);
    match w.form {
        RunForm::Full => {
            // Every run's bytes written in place into room made at once:
            // a DATA of 4096 runs is encoded on every chunk's post, and
            // appended field by field the appends' capacity checks were
            // most of its cost.
            for (r, b) in runs
                .iter()
                .zip(p.room(runs.len() * RUN_BYTES).chunks_exact_mut(RUN_BYTES))
            {
                b[0..8].copy_from_slice(&r.region_offset.to_le_bytes());
                b[8..16].copy_from_slice(&r.addr.to_le_bytes());
                b[16..24].copy_from_slice(&r.len.to_le_bytes());
                b[24..28].copy_from_slice(&r.count.to_le_bytes());
                b[28..36].copy_from_slice(&r.region_stride.to_le_bytes());
                b[36..44].copy_from_slice(&r.addr_stride.to_le_bytes());
            }
        }
        RunForm::Copies => {
            p.u64(runs[0].len);
            let marks = w.entries.div_ceil(8);
            let (m, e) = p.room(marks + w.entries * 16).split_at_mut(marks);
            write_copies::<16>(runs, m, e);
        }
        RunForm::Packed => {
            p.u64(runs[0].len);
            p.u64(runs[0].region_offset);
            let marks = w.entries.div_ceil(8);
            let (m, e) = p.room(marks + w.entries * 8).split_at_mut(marks);
            write_copies::<8>(runs, m, e);
        }
    }
}

/// One run list; `left` is what the message may still carry (entries),
/// checked before anything is allocated.
fn decode_runs(r: &mut Reader<'_>, left: &mut usize) -> Result<Runs, WireError> {
    let mut charge = |n: usize| {
        *left = left.checked_sub(n).ok_or(WireError::CountTooLarge {
            what: "run-list entries in one message",
            count: n as u64,
            limit: *left as u64,
        })?;
        Ok::<usize, WireError>(n)
    };
    match r.code::<RunForm>("run list form")? {
        RunForm::Full => {
            let n = charge(r.count("run", MAX_DATA_RUNS, RUN_LEN)?)?;
            // `count` checked that the n runs are all there: parse them
            // from one slice straight into the shared list (one
            // allocation; a run list can be hundreds of KiB).
            let raw = r.take(n * RUN_LEN, "runs")?;
            Ok(raw.chunks_exact(RUN_LEN).map(parse_run).collect())
        }
        RunForm::Copies => {
            let n = charge(r.count("copy", MAX_DATA_RUNS, 16)?)?;
            let len = r.u64("copy length")?;
            let marks = r.take(n.div_ceil(8), "second-copy marks")?;
            let raw = r.take(n * 16, "copies")?;
            rebuild_runs::<16>(n, len, 0, marks, raw)
        }
        RunForm::Packed => {
            let n = charge(r.count("copy", MAX_DATA_RUNS, 8)?)?;
            let len = r.u64("copy length")?;
            let first = r.u64("first region offset")?;
            // The last copy's offset must not overflow (nor any before it).
            let last = (n as u64).checked_sub(1).map_or(Some(first), |m| {
                m.checked_mul(len).and_then(|x| x.checked_add(first))
            });
            if last.is_none() {
                return Err(WireError::Invalid {
                    what: "packed run list",
                    why: format!("{n} copies of {len} bytes from offset {first} overflow"),
                });
            }
            let marks = r.take(n.div_ceil(8), "second-copy marks")?;
            let raw = r.take(n * 8, "copies")?;
            // Kept as copies: the receiver's checks and its table read
            // them so, and no run is built (one pass over the addresses).
            // A list that is no runs of copies (none, empty, past the end
            // of the address space) is decoded as runs, as before, for the
            // receiver's check to refuse with what is wrong.
            // Filled in place: compiles to a plain copy on little-endian
            // hosts (collecting `le_u64` of each took 7 instructions a
            // copy).
            let mut addrs = vec![0u64; n];
            for (a, b) in addrs.iter_mut().zip(raw.chunks_exact(8)) {
                *a = u64::from_le_bytes(b.try_into().expect("chunks of 8 bytes"));
            }
            match Copies::new(len, first, addrs, marks.to_vec()) {
                Ok(copies) => Ok(Runs::from_copies(copies)),
                Err(_) => rebuild_runs::<8>(n, len, first, marks, raw),
            }
        }
    }
}

/// The runs of a compact list: `n` copies of `len` bytes (`WIDTH` bytes
/// each in `raw`: the region offset and the address, or with `WIDTH` 8
/// the address alone, copy j at `first + j * len`, checked by the caller
/// not to overflow), each starting a run of its own unless marked the
/// second of a run of two. Marks that make no runs are an error
/// ([`check_marks`]); strides that wrap are left for the receiver's
/// checks to refuse (the run then overflows).
fn rebuild_runs<const WIDTH: usize>(
    n: usize,
    len: u64,
    first: u64,
    marks: &[u8],
    raw: &[u8],
) -> Result<Runs, WireError> {
    check_marks(n, marks).map_err(|why| WireError::Invalid {
        what: "run list",
        why,
    })?;
    let copy = |j: usize| {
        let e = &raw[j * WIDTH..(j + 1) * WIDTH];
        let off = if WIDTH == 16 {
            le_u64(e)
        } else {
            first + j as u64 * len
        };
        (off, le_u64(&e[WIDTH - 8..]))
    };
    Ok(runs_of_marked_copies(n, len, marks, copy).into())
}

fn decode_read(r: &mut Reader<'_>) -> Result<Message, WireError> {
    let request = RequestId(r.u64("request id")?);
    let key = r.u64("access key")?;
    let elen = r.count("endpoint byte", MAX_ENDPOINT_LEN, 1)?;
    let endpoint = r.take(elen, "endpoint")?.to_vec();
    let dlen = r.count("data path byte", MAX_DATA_PATH_LEN, 1)?;
    let data_path = r.take(dlen, "data path")?.to_vec();
    // Each chunk takes at least its size and its run count.
    let n = r.count("READ chunk", MAX_READ_CHUNKS, 8 + 4)?;
    if n == 0 {
        return Err(WireError::Invalid {
            what: "READ",
            why: "no chunks".into(),
        });
    }
    let mut chunks = Vec::with_capacity(n);
    let mut left = MAX_MESSAGE_RUNS;
    for _ in 0..n {
        chunks.push(ReadChunk {
            size: r.u64("READ chunk size")?,
            runs: decode_runs(r, &mut left)?,
        });
    }
    Ok(Message::Read {
        request,
        key,
        endpoint,
        data_path,
        chunks,
    })
}

fn encode_want(p: &mut Writer, request: RequestId, sizes: &[u64], endpoint: &[u8], key: u64) {
    p.u64(request.0);
    p.u64(key);
    p.u32(sizes.len() as u32);
    for &s in sizes {
        p.u64(s);
    }
    p.len_prefixed(endpoint);
}

/// A WANT_STANDING's trailer: the sender's incarnation, the [`StandingUse`]
/// code (1 wanted, 2 held, 3 claimed), a claim's token and region. Nothing
/// for [`StandingUse::None`] (a plain WANT).
fn encode_standing_use(p: &mut Writer, standing: StandingUse, incarnation: u64) {
    if standing == StandingUse::None {
        return;
    }
    p.u64(incarnation);
    match standing {
        StandingUse::None => {}
        StandingUse::Wanted => p.u8(1),
        StandingUse::Held => p.u8(2),
        StandingUse::Claimed { token, region } => {
            p.u8(3);
            p.u64(token);
            p.u64(region.0);
        }
        StandingUse::Returned { token, region } => {
            p.u8(4);
            p.u64(token);
            p.u64(region.0);
        }
    }
}

fn decode_standing_use(r: &mut Reader<'_>) -> Result<StandingUse, WireError> {
    Ok(match r.u8("standing use")? {
        1 => StandingUse::Wanted,
        2 => StandingUse::Held,
        3 => StandingUse::Claimed {
            token: r.u64("standing token")?,
            region: RegionHandle(r.u64("standing region")?),
        },
        4 => StandingUse::Returned {
            token: r.u64("standing token")?,
            region: RegionHandle(r.u64("standing region")?),
        },
        other => {
            return Err(WireError::Invalid {
                what: "standing use",
                why: format!("{other} is not 1 (wanted), 2 (held), 3 (claimed) or 4 (returned)"),
            })
        }
    })
}

/// A WANT (or CANCEL, an empty one); a WANT_STANDING (`standing`) carries
/// the sender's incarnation and its [`StandingUse`] after the WANT's
/// fields, a claim when it is empty (the CANCEL of a request that claimed
/// an offer).
fn decode_want(r: &mut Reader<'_>, standing: bool) -> Result<Message, WireError> {
    let request = RequestId(r.u64("request id")?);
    let key = r.u64("access key")?;
    let n = r.count("chunk size", MAX_WANT_CHUNKS, 8)?;
    let mut chunk_sizes = Vec::with_capacity(n);
    for _ in 0..n {
        chunk_sizes.push(r.u64("chunk size")?);
    }
    let elen = r.count("endpoint byte", MAX_ENDPOINT_LEN, 1)?;
    let endpoint = r.take(elen, "endpoint")?.to_vec();
    let (standing, incarnation) = match standing {
        true => {
            let incarnation = r.u64("incarnation")?;
            (decode_standing_use(r)?, incarnation)
        }
        false => (StandingUse::None, 0),
    };
    Ok(if chunk_sizes.is_empty() {
        if let StandingUse::Returned { token, region } = standing {
            return Ok(Message::Return {
                key,
                offer: Claim { token, region },
                incarnation,
            });
        }
        let claim = standing.claim();
        if standing != StandingUse::None && claim.is_none() {
            return Err(WireError::Invalid {
                what: "WANT_STANDING",
                why: format!("no chunks (a CANCEL) and {standing:?}, not a claim"),
            });
        }
        Message::Cancel {
            request,
            endpoint,
            key,
            claim,
            incarnation,
        }
    } else {
        if matches!(standing, StandingUse::Returned { .. }) {
            return Err(WireError::Invalid {
                what: "WANT_STANDING",
                why: "chunks with an offer given back (4), which only an empty one carries".into(),
            });
        }
        Message::Want {
            request,
            chunk_sizes,
            endpoint,
            key,
            standing,
            incarnation,
        }
    })
}

wire_enum! {
/// The control transport an agent uses; peers must agree.
pub enum ControlKind {
    /// ZMQ over TCP.
    Zmq = 1,
    /// NIXL notifications.
    NixlNotif = 2,
    /// TCP sockets the reactor owns (`control::tcp`).
    Tcp = 3,
}
}

/// Capability flags advertised in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// Understands CANCEL (empty WANT) and REFUSE.
    pub const CANCEL: Capabilities = Capabilities(1 << 0);
    /// Serves and issues READs over the bounce path (types 16-21).
    pub const READ: Capabilities = Capabilities(1 << 1);
    /// Answers the NIXL-notification control channel's heartbeats (a PING
    /// with a PONG; `control::notif`): only such a peer is sent them, and
    /// only such a peer can be found unreachable over that channel.
    pub const HEARTBEATS: Capabilities = Capabilities(1 << 2);
    /// Reads a READ's data path of version 2 (`engine::conn_info::DataPath`,
    /// with the reader's cross-memory-attach block): a reader sends version
    /// 1 to an owner without it, which refuses any later version.
    pub const DATA_PATH_V2: Capabilities = Capabilities(1 << 3);
    /// Offers standing credits (STANDING, type 7) to senders whose WANTs
    /// are WANT_STANDINGs (type 6), and takes their claims, and the
    /// CANCELs that name them (an empty type 6): only a sender to such a
    /// receiver sends type 6.
    pub const STANDING: Capabilities = Capabilities(1 << 4);

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
    }

    /// Union.
    pub fn with(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// Every flag of `self` but those of `other`.
    pub fn without(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & !other.0)
    }
}

/// The per-agent capability blob carried in the agent metadata.
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | magic `NXBH` |
/// | 4..6 | handshake format version |
/// | 6..8 | wire version |
/// | 8 | control kind |
/// | 9..17 | capability flags |
/// | 17..25 | arena usable capacity |
/// | 25..33 | max chunk size |
/// | 33..41 | arena base address |
/// | 41..45 | arena device id |
/// | 45..53 | access key |
/// | 53..57 | endpoint length n |
/// | 57..57+n | endpoint |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// Wire version spoken.
    pub wire_version: u16,
    /// Control transport.
    pub control: ControlKind,
    /// Capability flags.
    pub capabilities: Capabilities,
    /// Usable arena capacity (largest grantable region).
    pub arena_usable_capacity: u64,
    /// Max chunk size (must match).
    pub max_chunk_size: u64,
    /// Arena base address (remote write targets are base + region offset).
    pub arena_base: u64,
    /// Arena device id.
    pub arena_device: u32,
    /// The key every WANT and CANCEL to this agent must carry: random per
    /// arena, known only to peers that loaded this agent's metadata (the
    /// bounce path's counterpart of an RDMA remote key).
    pub access_key: u64,
    /// Control endpoint.
    pub endpoint: Vec<u8>,
}

/// Why a peer's handshake is not compatible.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Incompatible {
    /// Different wire versions.
    #[error("peer speaks wire version {peer}, this agent {local}")]
    WireVersion {
        /// Local.
        local: u16,
        /// Peer.
        peer: u16,
    },
    /// Different control transports.
    #[error("peer uses control kind {peer:?}, this agent {local:?} (set NIXL_BOUNCE_USE_NIXL_NOTIFICATIONS alike on both)")]
    ControlKind {
        /// Local.
        local: ControlKind,
        /// Peer.
        peer: ControlKind,
    },
    /// Different chunk sizes.
    #[error("peer max chunk size {peer} differs from this agent's {local} (set NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES alike on both)")]
    MaxChunk {
        /// Local.
        local: u64,
        /// Peer.
        peer: u64,
    },
    /// The peer cannot cancel.
    #[error("peer lacks the CANCEL capability")]
    NoCancel,
    /// The peer has no endpoint.
    #[error("peer advertises an empty control endpoint")]
    NoEndpoint,
}

impl Handshake {
    /// Encodes the blob.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes(&HANDSHAKE_MAGIC);
        w.u16(HANDSHAKE_FORMAT);
        w.u16(self.wire_version);
        w.u8(self.control.code());
        w.u64(self.capabilities.0);
        w.u64(self.arena_usable_capacity);
        w.u64(self.max_chunk_size);
        w.u64(self.arena_base);
        w.u32(self.arena_device);
        w.u64(self.access_key);
        w.len_prefixed(&self.endpoint);
        w.into_bytes()
    }

    /// Decodes a blob; the input must be exactly one blob.
    pub fn decode(bytes: &[u8]) -> Result<Handshake, WireError> {
        let mut r = Reader::new(bytes);
        r.header(
            HANDSHAKE_MAGIC,
            "handshake magic",
            HANDSHAKE_FORMAT,
            "handshake format",
        )?;
        let wire_version = r.u16("wire version")?;
        let control = r.code::<ControlKind>("control kind")?;
        let capabilities = Capabilities(r.u64("capabilities")?);
        let arena_usable_capacity = r.u64("arena usable capacity")?;
        let max_chunk_size = r.u64("max chunk size")?;
        let arena_base = r.u64("arena base")?;
        let arena_device = r.u32("arena device")?;
        let access_key = r.u64("access key")?;
        let n = r.count("endpoint byte", MAX_ENDPOINT_LEN, 1)?;
        let endpoint = r.take(n, "endpoint")?.to_vec();
        r.finish("handshake")?;
        if max_chunk_size == 0 || max_chunk_size > arena_usable_capacity {
            return Err(WireError::Invalid {
                what: "max chunk size",
                why: format!(
                    "{max_chunk_size} is zero or above the usable capacity {arena_usable_capacity}"
                ),
            });
        }
        Ok(Handshake {
            wire_version,
            control,
            capabilities,
            arena_usable_capacity,
            max_chunk_size,
            arena_base,
            arena_device,
            access_key,
            endpoint,
        })
    }

    /// Whether this agent (`self`) may use the bounce path with `peer`.
    pub fn check_compatible(&self, peer: &Handshake) -> Result<(), Incompatible> {
        if peer.wire_version != self.wire_version {
            return Err(Incompatible::WireVersion {
                local: self.wire_version,
                peer: peer.wire_version,
            });
        }
        if peer.control != self.control {
            return Err(Incompatible::ControlKind {
                local: self.control,
                peer: peer.control,
            });
        }
        if peer.max_chunk_size != self.max_chunk_size {
            return Err(Incompatible::MaxChunk {
                local: self.max_chunk_size,
                peer: peer.max_chunk_size,
            });
        }
        if !peer.capabilities.contains(Capabilities::CANCEL) {
            return Err(Incompatible::NoCancel);
        }
        if peer.endpoint.is_empty() {
            return Err(Incompatible::NoEndpoint);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
