//! What BOUNCE publishes through NIXL's metadata: the connection info (once
//! per agent) and the public data of each registered region.
//!
//! Connection info layout (little-endian):
//! ```text
//! magic    8 bytes  "NXBOUNCE"
//! version  u16      CONN_INFO_VERSION
//! md_len   u32      length of the inner agent's metadata
//! md       md_len   the inner NIXL agent's own metadata (its UCX connection,
//!                   for the bounce arena's writes and control notifications)
//! uc_len   u32      length of the UCX delegate's connection info
//! uc       uc_len   the UCX delegate's connection info (its worker address)
//! ```
//! Version 1 carried an (always empty) bounce handshake where version 2
//! carries the UCX delegate's connection: bounce handshakes travel with
//! each region's public data.
//! Nothing may follow. A peer that cannot parse this (another version, a
//! truncated blob) is refused with an error that says what was wrong.

use crate::proto::wire::{Reader, WireError, Writer};

pub const MAGIC: &[u8; 8] = b"NXBOUNCE";
pub const CONN_INFO_VERSION: u16 = 2;
pub const PUBLIC_MAGIC: &[u8; 8] = b"NXBPUBLC";
/// Version 2 added the peer-map block, version 3 the CMA block, version 4
/// the host-staged bounce block; each
/// region is written in the lowest version that carries its blocks, and
/// every earlier version is still read. A plugin that knows only an
/// earlier version refuses a region written in a later one (naming the
/// version): DRAM regions are version 3 while the CMA path is on.
pub const PUBLIC_VERSION: u16 = 4;
pub const DATA_PATH_MAGIC: &[u8; 8] = b"NXBDPATH";
/// Version 2 added the CMA block; a data path is written in the lowest
/// version that carries it, and both are read.
pub const DATA_PATH_VERSION: u16 = 2;

/// Why a peer's metadata (connection info, a region's public data, a
/// READ's data path) was refused; the text says what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    #[error("BOUNCE metadata: {0}")]
    Malformed(#[from] WireError),
    #[error("not BOUNCE connection info (magic {found:02x?}, expected {MAGIC:02x?}); is the peer running BOUNCE?")]
    NotConnInfo { found: [u8; 8] },
    #[error("not BOUNCE region metadata; is the peer running BOUNCE?")]
    NotRegionMetadata,
    #[error("not a BOUNCE data-path description")]
    NotDataPath,
    #[error("{who} speaks BOUNCE {what} version {found}, this plugin speaks {}", speaks(*.lowest, *.highest))]
    Version {
        who: &'static str,
        what: &'static str,
        found: u16,
        lowest: u16,
        highest: u16,
    },
    #[error("connection info carries no {0}")]
    Missing(&'static str),
    #[error("unknown arena memory kind {0}")]
    UnknownMemKind(u8),
    #[error("{what} of {found} bytes (expected {}{expected})", if *.or_empty { "0 or " } else { "" })]
    BlockLength {
        what: &'static str,
        found: usize,
        expected: usize,
        /// An empty block is read too.
        or_empty: bool,
    },
    #[error("peer-map block describes an impossible allocation ({len} bytes at {base:#x})")]
    ImpossibleAllocation { base: u64, len: u64 },
    #[error("host-staged bounce block: {0}")]
    Staged(Box<MetadataError>),
    #[error(
        "host-staged bounce block names arena memory kind {0} (its arena is host memory, kind 0)"
    )]
    StagedNotHost(u8),
    #[error("the reader's inner agent name is not UTF-8")]
    AgentNotUtf8,
    #[error("data path names no agent or no arena")]
    DataPathIncomplete,
}

/// The versions a plugin speaks, as a refusal words them.
fn speaks(lowest: u16, highest: u16) -> String {
    if lowest == highest {
        highest.to_string()
    } else {
        format!("{lowest} to {highest}")
    }
}

/// Parsed connection info of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnInfo {
    /// The peer's inner agent metadata, loaded into our inner agent.
    pub inner_md: Vec<u8>,
    /// The connection info of the peer's UCX delegate, loaded into ours.
    pub ucx_conn: Vec<u8>,
}

impl ConnInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes(MAGIC);
        w.u16(CONN_INFO_VERSION);
        w.len_prefixed(&self.inner_md);
        w.len_prefixed(&self.ucx_conn);
        w.into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        let mut r = Reader::new(bytes);
        let magic: [u8; 8] = r.array("magic")?;
        if &magic != MAGIC {
            return Err(MetadataError::NotConnInfo { found: magic });
        }
        let version = r.u16("version")?;
        if version != CONN_INFO_VERSION {
            return Err(MetadataError::Version {
                who: "peer",
                what: "connection-info",
                found: version,
                lowest: CONN_INFO_VERSION,
                highest: CONN_INFO_VERSION,
            });
        }
        let inner_md = len_prefixed(&mut r, "inner metadata")?.to_vec();
        let ucx_conn = len_prefixed(&mut r, "UCX connection info")?.to_vec();
        r.finish("connection info")?;
        if inner_md.is_empty() {
            return Err(MetadataError::Missing("inner-agent metadata"));
        }
        if ucx_conn.is_empty() {
            return Err(MetadataError::Missing("UCX connection info"));
        }
        Ok(Self { inner_md, ucx_conn })
    }
}

/// The public data of one registered region.
///
/// ```text
/// magic    8 bytes  "NXBPUBLC"
/// version  u16      PUBLIC_VERSION
/// md_len   u32, md  the UCX delegate's public data of the region (its remote key)
/// bb_len   u32      0 when the region's location offers no bounce path, else:
///   kind      u8      0 DRAM, 1 VRAM
///   am_len    u32, am the inner agent's metadata for the bounce arena
///   handshake rest    the bounce handshake of the region's location
/// pm_len u32      (version 2) 0 when the region is not exported for
///                 peer mapping, else PEER_EXPORT_LEN bytes of [`IpcExport`]
/// cm_len u32      (version 3) 0 when the region is not offered to the CMA
///                 path, else CMA_EXPORT_LEN bytes of [`CmaExport`]
/// hs_len u32      (version 4) 0 when the region has no host-staged
///                 instance, else a bounce block as above (kind 0: its
///                 arena is host memory) for its transfers with DRAM
/// ```
/// The bounce handshake travels with the memory it serves because an arena
/// (one per memory location) is created when memory at that location is
/// first registered, after NIXL took the connection info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicData {
    /// The UCX delegate's public data of the region.
    pub region_md: Vec<u8>,
    pub bounce: Option<PublicBounce>,
    /// How a peer on the same host may map the region's allocation (the
    /// peer-mapped path, docs/design.md §3).
    pub peer_map: Option<IpcExport>,
    /// How a peer on the same host may copy to and from the region by
    /// cross-memory attach (the CMA path, docs/design.md §3).
    pub cma: Option<CmaExport>,
    /// The bounce instance of a VRAM region's GPU whose arena is pinned
    /// host memory: the one its transfers with DRAM take (mixed memory,
    /// docs/design.md §3).
    pub staged: Option<PublicBounce>,
}

/// Bytes of an encoded [`CmaExport`].
pub const CMA_EXPORT_LEN: usize = 16 + 16 + 4 + 8;

/// A DRAM region's owner as a peer on the same host reaches it by
/// cross-memory attach:
///
/// ```text
/// host        16 bytes  the kernel's boot id (same boot id: same host)
/// process     16 bytes  a random token of the exporting process
/// pid         u32       its process id, as it sees itself
/// token_addr  u64       where the token lies in its memory
/// ```
/// A peer believes the pid only once it read the token at `token_addr`
/// of that pid (`engine::cma`): that proves the same host, the same PID
/// namespace and the permission to reach the process, in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaExport {
    pub host: [u8; 16],
    pub process: [u8; 16],
    pub pid: u32,
    pub token_addr: u64,
}

impl CmaExport {
    fn encode_into(&self, w: &mut Writer) {
        w.bytes(&self.host);
        w.bytes(&self.process);
        w.u32(self.pid);
        w.u64(self.token_addr);
    }

    fn decode(block: &[u8]) -> Result<Self, MetadataError> {
        if block.len() != CMA_EXPORT_LEN {
            return Err(MetadataError::BlockLength {
                what: "CMA block",
                found: block.len(),
                expected: CMA_EXPORT_LEN,
                or_empty: false,
            });
        }
        let mut r = Reader::new(block);
        Ok(CmaExport {
            host: r.array("host id")?,
            process: r.array("process token")?,
            pid: r.u32("pid")?,
            token_addr: r.u64("token address")?,
        })
    }
}

/// Bytes of an encoded [`IpcExport`].
pub const PEER_EXPORT_LEN: usize = 16 + 16 + 16 + 8 + 8 + 64;

/// A VRAM region's allocation as a peer on the same host can map it:
///
/// ```text
/// host        16 bytes  the kernel's boot id (same boot id: same host)
/// process     16 bytes  a random token of the exporting process
/// device_uuid 16 bytes  the GPU holding the allocation
/// alloc_base  u64       the allocation's base address in the exporter
/// alloc_len   u64       its length; the region lies inside it
/// ipc_handle  64 bytes  CUDA's IPC handle of the allocation
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcExport {
    pub host: [u8; 16],
    pub process: [u8; 16],
    pub device_uuid: [u8; 16],
    pub alloc_base: u64,
    pub alloc_len: u64,
    pub ipc_handle: [u8; 64],
}

impl IpcExport {
    fn encode_into(&self, w: &mut Writer) {
        w.bytes(&self.host);
        w.bytes(&self.process);
        w.bytes(&self.device_uuid);
        w.u64(self.alloc_base);
        w.u64(self.alloc_len);
        w.bytes(&self.ipc_handle);
    }

    fn decode(block: &[u8]) -> Result<Self, MetadataError> {
        if block.len() != PEER_EXPORT_LEN {
            return Err(MetadataError::BlockLength {
                what: "peer-map block",
                found: block.len(),
                expected: PEER_EXPORT_LEN,
                or_empty: false,
            });
        }
        let mut r = Reader::new(block);
        let export = IpcExport {
            host: r.array("host id")?,
            process: r.array("process token")?,
            device_uuid: r.array("device uuid")?,
            alloc_base: r.u64("allocation base")?,
            alloc_len: r.u64("allocation length")?,
            ipc_handle: r.array("ipc handle")?,
        };
        if export.alloc_len == 0 || export.alloc_base.checked_add(export.alloc_len).is_none() {
            return Err(MetadataError::ImpossibleAllocation {
                base: export.alloc_base,
                len: export.alloc_len,
            });
        }
        Ok(export)
    }

    /// Whether `[addr, addr + len)` lies inside the exported allocation.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.alloc_base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.alloc_base + self.alloc_len)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicBounce {
    /// The arena's memory: 0 DRAM, 1 VRAM (NIXL's numbering).
    pub kind: u8,
    pub arena_md: Vec<u8>,
    pub handshake: Vec<u8>,
}

impl PublicBounce {
    /// The block: nothing for `None`.
    fn encode(bounce: Option<&Self>) -> Vec<u8> {
        let mut block = Writer::new();
        if let Some(b) = bounce {
            block.u8(b.kind);
            block.len_prefixed(&b.arena_md);
            block.bytes(&b.handshake);
        }
        block.into_bytes()
    }

    /// `None` for an empty block.
    fn decode(block: &[u8]) -> Result<Option<Self>, MetadataError> {
        if block.is_empty() {
            return Ok(None);
        }
        let mut b = Reader::new(block);
        let kind = b.u8("memory kind")?;
        if kind > 1 {
            return Err(MetadataError::UnknownMemKind(kind));
        }
        let arena_md = len_prefixed(&mut b, "arena metadata")?.to_vec();
        let handshake = b.take(b.remaining(), "handshake")?.to_vec();
        Ok(Some(PublicBounce {
            kind,
            arena_md,
            handshake,
        }))
    }
}

impl PublicData {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes(PUBLIC_MAGIC);
        // The lowest version that carries the region's blocks, so that
        // plugins of an earlier version still read every region without
        // the later blocks.
        let version = if self.staged.is_some() {
            4
        } else if self.cma.is_some() {
            3
        } else if self.peer_map.is_some() {
            2
        } else {
            1
        };
        w.u16(version);
        w.len_prefixed(&self.region_md);
        w.len_prefixed(&PublicBounce::encode(self.bounce.as_ref()));
        if version >= 2 {
            let mut pm = Writer::new();
            if let Some(p) = &self.peer_map {
                p.encode_into(&mut pm);
            }
            w.len_prefixed(&pm.into_bytes());
        }
        if version >= 3 {
            let mut cm = Writer::new();
            if let Some(c) = &self.cma {
                c.encode_into(&mut cm);
            }
            w.len_prefixed(&cm.into_bytes());
        }
        if version >= 4 {
            w.len_prefixed(&PublicBounce::encode(self.staged.as_ref()));
        }
        w.into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        let mut r = Reader::new(bytes);
        let magic: [u8; 8] = r.array("magic")?;
        if &magic != PUBLIC_MAGIC {
            return Err(MetadataError::NotRegionMetadata);
        }
        let version = r.u16("version")?;
        if !(1..=PUBLIC_VERSION).contains(&version) {
            return Err(MetadataError::Version {
                who: "peer",
                what: "region-metadata",
                found: version,
                lowest: 1,
                highest: PUBLIC_VERSION,
            });
        }
        let region_md = len_prefixed(&mut r, "region metadata")?.to_vec();
        let block = len_prefixed(&mut r, "bounce block")?;
        let peer_block = if version >= 2 {
            len_prefixed(&mut r, "peer-map block")?
        } else {
            &[]
        };
        let cma_block = if version >= 3 {
            len_prefixed(&mut r, "CMA block")?
        } else {
            &[]
        };
        let staged_block = if version >= 4 {
            len_prefixed(&mut r, "host-staged bounce block")?
        } else {
            &[]
        };
        r.finish("region metadata")?;
        let cma = if cma_block.is_empty() {
            None
        } else {
            Some(CmaExport::decode(cma_block)?)
        };
        let peer_map = if peer_block.is_empty() {
            None
        } else {
            Some(IpcExport::decode(peer_block)?)
        };
        Ok(Self {
            region_md,
            bounce: PublicBounce::decode(block)?,
            peer_map,
            cma,
            staged: match PublicBounce::decode(staged_block)
                .map_err(|e| MetadataError::Staged(Box::new(e)))?
            {
                Some(b) if b.kind != 0 => return Err(MetadataError::StagedNotHost(b.kind)),
                staged => staged,
            },
        })
    }
}

/// How a data owner writes into a reader's arena: what a reader puts in
/// every READ (the owner may never have loaded the reader's metadata: with
/// vLLM only the reader loads the owner's).
///
/// ```text
/// magic    8 bytes  "NXBDPATH"
/// version  u16      DATA_PATH_VERSION
/// kind     u8       0 DRAM, 1 VRAM
/// device   u64      the arena's device
/// base     u64      the arena's address
/// name     u32 + n  the reader's inner agent name
/// conn     u32 + n  the inner agent's metadata from its creation (its UCX connection)
/// arena    u32 + n  the inner agent's metadata for the arena
/// cma_len  u32      (version 2) 0, or DATA_PATH_CMA_LEN bytes: the
///                   reader's [`CmaExport`] and its arena's [`ArenaSeal`],
///                   when the arena is host memory a same-host owner may
///                   write by cross-memory attach
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataPath {
    pub kind: u8,
    pub device: u64,
    pub base: u64,
    pub inner_agent: String,
    pub conn_md: Vec<u8>,
    pub arena_md: Vec<u8>,
    /// The reader's process and its arena's seal, for chunk writes by
    /// cross-memory attach (`dataplane::CmaTarget`).
    pub cma: Option<(CmaExport, ArenaSeal)>,
}

/// Bytes of a data path's CMA block.
pub const DATA_PATH_CMA_LEN: usize = CMA_EXPORT_LEN + ArenaSeal::LEN;

/// Where a host arena's seal lies in its process, and what it says: 16
/// random bytes, the arena's base and its length, kept by the arena's
/// instance at `addr` while it lives.
///
/// ```text
/// addr   u64       where the seal lies in the reader's memory
/// token  16 bytes  random, per arena
/// len    u64       the arena's length (its base is the data path's)
/// ```
/// A data path comes over the control channel, from any peer that knows
/// the owner's access key. Before writing by cross-memory attach, the
/// owner reads the seal at `addr` in the reader's process and believes the
/// arena only if token, base and length are all there: the writes then land
/// in a live arena of that process, as a NIXL write lands only in memory
/// its target registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSeal {
    pub addr: u64,
    pub token: [u8; 16],
    pub len: u64,
}

impl ArenaSeal {
    pub const LEN: usize = 8 + 16 + 8;

    /// The 32 bytes that lie at `addr`: token, base, length.
    pub fn image(&self, base: u64) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(&self.token);
        b[16..24].copy_from_slice(&base.to_le_bytes());
        b[24..].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

impl DataPath {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes(DATA_PATH_MAGIC);
        w.u16(if self.cma.is_some() { 2 } else { 1 });
        w.u8(self.kind);
        w.u64(self.device);
        w.u64(self.base);
        w.len_prefixed(self.inner_agent.as_bytes());
        w.len_prefixed(&self.conn_md);
        w.len_prefixed(&self.arena_md);
        if let Some((e, seal)) = &self.cma {
            w.u32(DATA_PATH_CMA_LEN as u32);
            e.encode_into(&mut w);
            w.u64(seal.addr);
            w.bytes(&seal.token);
            w.u64(seal.len);
        }
        w.into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        Self::decode_up_to(bytes, DATA_PATH_VERSION)
    }

    /// [`DataPath::decode`] refusing versions above `max` (as a plugin that
    /// speaks only up to `max` does).
    pub fn decode_up_to(bytes: &[u8], max: u16) -> Result<Self, MetadataError> {
        let max = max.min(DATA_PATH_VERSION);
        let mut r = Reader::new(bytes);
        let magic: [u8; 8] = r.array("magic")?;
        if &magic != DATA_PATH_MAGIC {
            return Err(MetadataError::NotDataPath);
        }
        let version = r.u16("version")?;
        if !(1..=max).contains(&version) {
            return Err(MetadataError::Version {
                who: "reader",
                what: "data-path",
                found: version,
                lowest: 1,
                highest: max,
            });
        }
        let kind = r.u8("memory kind")?;
        if kind > 1 {
            return Err(MetadataError::UnknownMemKind(kind));
        }
        let device = r.u64("device")?;
        let base = r.u64("arena base")?;
        let inner_agent = std::str::from_utf8(len_prefixed(&mut r, "inner agent name")?)
            .map_err(|_| MetadataError::AgentNotUtf8)?
            .to_string();
        let conn_md = len_prefixed(&mut r, "connection metadata")?.to_vec();
        let arena_md = len_prefixed(&mut r, "arena metadata")?.to_vec();
        let cma = match version {
            1 => None,
            _ => match len_prefixed(&mut r, "CMA block")? {
                [] => None,
                b if b.len() == DATA_PATH_CMA_LEN => {
                    let (export, seal) = b.split_at(CMA_EXPORT_LEN);
                    let mut r = Reader::new(seal);
                    let seal = ArenaSeal {
                        addr: r.u64("seal address")?,
                        token: r.array("seal token")?,
                        len: r.u64("arena length")?,
                    };
                    Some((CmaExport::decode(export)?, seal))
                }
                b => {
                    return Err(MetadataError::BlockLength {
                        what: "data path's CMA block",
                        found: b.len(),
                        expected: DATA_PATH_CMA_LEN,
                        or_empty: true,
                    })
                }
            },
        };
        r.finish("data path")?;
        if inner_agent.is_empty() || arena_md.is_empty() {
            return Err(MetadataError::DataPathIncomplete);
        }
        Ok(Self {
            kind,
            device,
            base,
            inner_agent,
            conn_md,
            arena_md,
            cma,
        })
    }
}

/// A u32 length, then that many bytes.
fn len_prefixed<'a>(r: &mut Reader<'a>, what: &'static str) -> Result<&'a [u8], MetadataError> {
    let n = r.u32(what)?;
    Ok(r.take(n as usize, what)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let c = ConnInfo {
            inner_md: vec![1, 2, 3],
            ucx_conn: vec![9; 40],
        };
        assert_eq!(ConnInfo::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn rejects_every_malformed_prefix_and_trailing_bytes() {
        let good = ConnInfo {
            inner_md: vec![7; 10],
            ucx_conn: vec![8; 3],
        }
        .encode();
        for n in 0..good.len() {
            assert!(
                ConnInfo::decode(&good[..n]).is_err(),
                "prefix of {n} bytes accepted"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert!(ConnInfo::decode(&long)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
    }

    #[test]
    fn names_the_version_mismatch() {
        let mut b = ConnInfo {
            inner_md: vec![1],
            ucx_conn: vec![2],
        }
        .encode();
        b[8] = 9;
        let e = ConnInfo::decode(&b).unwrap_err().to_string();
        assert!(e.contains("version 9"), "{e}");
    }

    fn export() -> IpcExport {
        IpcExport {
            host: [1; 16],
            process: [2; 16],
            device_uuid: [3; 16],
            alloc_base: 0x7f00_0000_0000,
            alloc_len: 1 << 30,
            ipc_handle: [4; 64],
        }
    }

    #[test]
    fn public_data_round_trips_and_rejects_malformed_input() {
        let bounces = [
            None,
            Some(PublicBounce {
                kind: 1,
                arena_md: vec![5; 7],
                handshake: vec![6; 30],
            }),
        ];
        let cmas = [None, Some(cma_export())];
        let staged = [
            None,
            Some(PublicBounce {
                kind: 0,
                arena_md: vec![8; 5],
                handshake: vec![9; 12],
            }),
        ];
        for (((bounce, peer_map), cma), staged) in bounces
            .iter()
            .flat_map(|b| [(b.clone(), None), (b.clone(), Some(export()))])
            .flat_map(|bp| cmas.map(|c| (bp.clone(), c)))
            .flat_map(|bpc| staged.clone().map(|h| (bpc.clone(), h)))
        {
            let p = PublicData {
                region_md: vec![1, 2, 3],
                bounce,
                peer_map,
                cma,
                staged,
            };
            let bytes = p.encode();
            assert_eq!(PublicData::decode(&bytes).unwrap(), p);
            for n in 0..bytes.len() {
                assert!(
                    PublicData::decode(&bytes[..n]).is_err(),
                    "prefix {n} accepted"
                );
            }
            let mut long = bytes.clone();
            long.push(9);
            assert!(PublicData::decode(&long).is_err());
        }
    }

    #[test]
    fn version_1_public_data_is_still_read() {
        // A version-1 peer: no peer-map block after the bounce block.
        let mut w = Writer::new();
        w.bytes(PUBLIC_MAGIC);
        w.u16(1);
        w.len_prefixed(&[7, 7]);
        w.len_prefixed(&[]);
        let p = PublicData::decode(&w.into_bytes()).unwrap();
        assert_eq!(p.region_md, vec![7, 7]);
        assert_eq!((p.bounce, p.peer_map), (None, None));
        // Only data with a peer-map block needs version 2.
        let plain = PublicData {
            region_md: vec![1],
            bounce: None,
            peer_map: None,
            cma: None,
            staged: None,
        };
        assert_eq!(
            u16::from_le_bytes([plain.encode()[8], plain.encode()[9]]),
            1
        );
        let mut future = PublicData {
            peer_map: Some(export()),
            ..plain.clone()
        }
        .encode();
        assert_eq!(u16::from_le_bytes([future[8], future[9]]), 2);
        // Only data with a CMA block needs version 3.
        let dram = PublicData {
            cma: Some(cma_export()),
            ..plain.clone()
        };
        let bytes = dram.encode();
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 3);
        assert_eq!(PublicData::decode(&bytes).unwrap(), dram);
        // Only a VRAM region with a host-staged instance needs version 4.
        let vram = PublicData {
            peer_map: Some(export()),
            staged: Some(PublicBounce {
                kind: 0,
                arena_md: vec![1],
                handshake: vec![2; 9],
            }),
            ..plain
        };
        let bytes = vram.encode();
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 4);
        assert_eq!(PublicData::decode(&bytes).unwrap(), vram);
        // A host-staged block whose arena is not host memory is refused.
        let wrong = PublicData {
            staged: Some(PublicBounce {
                kind: 1,
                arena_md: vec![1],
                handshake: vec![2; 9],
            }),
            ..vram
        };
        let e = PublicData::decode(&wrong.encode()).unwrap_err().to_string();
        assert!(e.contains("host-staged") && e.contains("kind 1"), "{e}");
        future[8] = 5;
        let e = PublicData::decode(&future).unwrap_err().to_string();
        assert!(e.contains("version 5"), "{e}");
    }

    fn cma_export() -> CmaExport {
        CmaExport {
            host: [1; 16],
            process: [2; 16],
            pid: 4242,
            token_addr: 0x5555_0000_1000,
        }
    }

    #[test]
    fn peer_export_block_is_checked() {
        let p = PublicData {
            region_md: vec![1],
            bounce: None,
            cma: None,
            staged: None,
            peer_map: Some(IpcExport {
                alloc_len: 0,
                ..export()
            }),
        };
        let e = PublicData::decode(&p.encode()).unwrap_err().to_string();
        assert!(e.contains("impossible allocation"), "{e}");
        let p = PublicData {
            peer_map: Some(IpcExport {
                alloc_base: u64::MAX - 4,
                ..export()
            }),
            ..p
        };
        assert!(PublicData::decode(&p.encode()).is_err());
        let x = export();
        assert!(x.covers(x.alloc_base, x.alloc_len));
        assert!(x.covers(x.alloc_base + 4096, 4096));
        assert!(!x.covers(x.alloc_base - 1, 2));
        assert!(!x.covers(x.alloc_base + x.alloc_len - 1, 2));
        assert!(!x.covers(u64::MAX, 2));
    }

    #[test]
    fn data_path_round_trips_and_rejects_malformed_input() {
        let plain = DataPath {
            kind: 1,
            device: 3,
            base: 0x7f00_0000_0000,
            inner_agent: "reader/bounce".into(),
            conn_md: vec![1; 9],
            arena_md: vec![2; 5],
            cma: None,
        };
        let with_cma = DataPath {
            kind: 0,
            cma: Some((
                CmaExport {
                    host: [3; 16],
                    process: [4; 16],
                    pid: 4242,
                    token_addr: 0x5555_0000,
                },
                ArenaSeal {
                    addr: 0x6666_0000,
                    token: [5; 16],
                    len: 256 << 20,
                },
            )),
            ..plain.clone()
        };
        for (d, version) in [(plain, 1u16), (with_cma, 2)] {
            let bytes = d.encode();
            assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), version);
            assert_eq!(DataPath::decode(&bytes).unwrap(), d);
            for n in 0..bytes.len() {
                assert!(
                    DataPath::decode(&bytes[..n]).is_err(),
                    "prefix {n} accepted"
                );
            }
            let mut long = bytes.clone();
            long.push(0);
            assert!(DataPath::decode(&long)
                .unwrap_err()
                .to_string()
                .contains("trailing"));
            let mut later = bytes.clone();
            later[8] = 3;
            assert!(DataPath::decode(&later)
                .unwrap_err()
                .to_string()
                .contains("data-path version 3"));
            // A plugin that speaks only version 1 reads the plain one alone.
            match version {
                1 => assert_eq!(DataPath::decode_up_to(&bytes, 1).unwrap(), d),
                _ => assert!(DataPath::decode_up_to(&bytes, 1)
                    .unwrap_err()
                    .to_string()
                    .ends_with("version 2, this plugin speaks 1")),
            }
        }
    }

    #[test]
    fn rejects_foreign_blobs() {
        assert!(ConnInfo::decode(b"UCX-worker-address-bytes")
            .unwrap_err()
            .to_string()
            .contains("not BOUNCE"));
    }
}
