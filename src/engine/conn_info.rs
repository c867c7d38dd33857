//! What BOUNCE publishes through NIXL's metadata: the connection info (once
//! per agent) and the public data of each registered region.
//!
//! Connection info layout (little-endian):
//! ```text
//! magic    8 bytes  "NXBOUNCE"
//! version  u16      CONN_INFO_VERSION
//! md_len   u32      length of the inner agent's metadata
//! md       md_len   the inner NIXL agent's own metadata (its UCX connection)
//! hs_len   u32      length of the bounce handshake (0: bounce not offered)
//! hs       hs_len   the bounce capability handshake
//! ```
//! Nothing may follow. A peer that cannot parse this (another version, a
//! truncated blob) is refused with an error that says what was wrong.

pub const MAGIC: &[u8; 8] = b"NXBOUNCE";
pub const CONN_INFO_VERSION: u16 = 1;
pub const PUBLIC_MAGIC: &[u8; 8] = b"NXBPUBLC";
pub const PUBLIC_VERSION: u16 = 1;

/// Parsed connection info of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnInfo {
    /// The peer's inner agent metadata, loaded into our inner agent.
    pub inner_md: Vec<u8>,
    /// The peer's bounce handshake; empty when it offers no bounce path.
    pub handshake: Vec<u8>,
}

impl ConnInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + self.inner_md.len() + self.handshake.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&CONN_INFO_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.inner_md.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.inner_md);
        out.extend_from_slice(&(self.handshake.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.handshake);
        out
    }

    pub fn decode(mut bytes: &[u8]) -> Result<Self, String> {
        let total = bytes.len();
        let magic = take(&mut bytes, 8, "magic")?;
        if magic != MAGIC {
            return Err(format!(
                "not BOUNCE connection info (magic {:02x?}, expected {:02x?}); is the peer running BOUNCE?",
                magic, MAGIC
            ));
        }
        let version =
            u16::from_le_bytes(take(&mut bytes, 2, "version")?.try_into().expect("2 bytes"));
        if version != CONN_INFO_VERSION {
            return Err(format!(
                "peer speaks BOUNCE connection-info version {version}, this plugin speaks {CONN_INFO_VERSION}"
            ));
        }
        let md_len = u32::from_le_bytes(
            take(&mut bytes, 4, "metadata length")?
                .try_into()
                .expect("4 bytes"),
        );
        let inner_md = take(&mut bytes, md_len as usize, "inner metadata")?.to_vec();
        let hs_len = u32::from_le_bytes(
            take(&mut bytes, 4, "handshake length")?
                .try_into()
                .expect("4 bytes"),
        );
        let handshake = take(&mut bytes, hs_len as usize, "handshake")?.to_vec();
        if !bytes.is_empty() {
            return Err(format!(
                "{} unexpected trailing bytes after {} bytes of connection info",
                bytes.len(),
                total - bytes.len()
            ));
        }
        if inner_md.is_empty() {
            return Err("connection info carries no inner-agent metadata".into());
        }
        Ok(Self {
            inner_md,
            handshake,
        })
    }
}

/// The public data of one registered region.
///
/// ```text
/// magic    8 bytes  "NXBPUBLC"
/// version  u16      PUBLIC_VERSION
/// md_len   u32, md  the inner agent's metadata for the region
/// bb_len   u32      0 when the region's location offers no bounce path, else:
///   kind      u8      0 DRAM, 1 VRAM
///   am_len    u32, am the inner agent's metadata for the bounce arena
///   handshake rest    the bounce handshake of the region's location
/// ```
/// The bounce handshake travels with the memory it serves because an arena
/// (one per memory location) is created when memory at that location is
/// first registered, after NIXL took the connection info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicData {
    pub region_md: Vec<u8>,
    pub bounce: Option<PublicBounce>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicBounce {
    /// 0 DRAM, 1 VRAM (NIXL's numbering).
    pub kind: u8,
    pub arena_md: Vec<u8>,
    pub handshake: Vec<u8>,
}

impl PublicData {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(PUBLIC_MAGIC);
        out.extend_from_slice(&PUBLIC_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.region_md.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.region_md);
        match &self.bounce {
            None => out.extend_from_slice(&0u32.to_le_bytes()),
            Some(b) => {
                let len = 1 + 4 + b.arena_md.len() + b.handshake.len();
                out.extend_from_slice(&(len as u32).to_le_bytes());
                out.push(b.kind);
                out.extend_from_slice(&(b.arena_md.len() as u32).to_le_bytes());
                out.extend_from_slice(&b.arena_md);
                out.extend_from_slice(&b.handshake);
            }
        }
        out
    }

    pub fn decode(mut bytes: &[u8]) -> Result<Self, String> {
        let magic = take(&mut bytes, 8, "magic")?;
        if magic != PUBLIC_MAGIC {
            return Err("not BOUNCE region metadata; is the peer running BOUNCE?".into());
        }
        let version =
            u16::from_le_bytes(take(&mut bytes, 2, "version")?.try_into().expect("2 bytes"));
        if version != PUBLIC_VERSION {
            return Err(format!(
                "peer speaks BOUNCE region-metadata version {version}, this plugin speaks {PUBLIC_VERSION}"
            ));
        }
        let n = u32::from_le_bytes(
            take(&mut bytes, 4, "metadata length")?
                .try_into()
                .expect("4 bytes"),
        );
        let region_md = take(&mut bytes, n as usize, "region metadata")?.to_vec();
        let n = u32::from_le_bytes(
            take(&mut bytes, 4, "bounce length")?
                .try_into()
                .expect("4 bytes"),
        );
        let mut b = take(&mut bytes, n as usize, "bounce block")?;
        if !bytes.is_empty() {
            return Err(format!(
                "{} unexpected trailing bytes after the region metadata",
                bytes.len()
            ));
        }
        let bounce = if n == 0 {
            None
        } else {
            let kind = take(&mut b, 1, "memory kind")?[0];
            if kind > 1 {
                return Err(format!("unknown arena memory kind {kind}"));
            }
            let m = u32::from_le_bytes(
                take(&mut b, 4, "arena metadata length")?
                    .try_into()
                    .expect("4 bytes"),
            );
            let arena_md = take(&mut b, m as usize, "arena metadata")?.to_vec();
            Some(PublicBounce {
                kind,
                arena_md,
                handshake: b.to_vec(),
            })
        };
        Ok(Self { region_md, bounce })
    }
}

fn take<'a>(bytes: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if bytes.len() < n {
        return Err(format!(
            "connection info truncated: {what} needs {n} bytes, {} left",
            bytes.len()
        ));
    }
    let (head, tail) = bytes.split_at(n);
    *bytes = tail;
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let c = ConnInfo {
            inner_md: vec![1, 2, 3],
            handshake: vec![9; 40],
        };
        assert_eq!(ConnInfo::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn rejects_every_malformed_prefix_and_trailing_bytes() {
        let good = ConnInfo {
            inner_md: vec![7; 10],
            handshake: vec![],
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
        assert!(ConnInfo::decode(&long).unwrap_err().contains("trailing"));
    }

    #[test]
    fn names_the_version_mismatch() {
        let mut b = ConnInfo {
            inner_md: vec![1],
            handshake: vec![],
        }
        .encode();
        b[8] = 9;
        let e = ConnInfo::decode(&b).unwrap_err();
        assert!(e.contains("version 9"), "{e}");
    }

    #[test]
    fn public_data_round_trips_and_rejects_malformed_input() {
        for bounce in [
            None,
            Some(PublicBounce {
                kind: 1,
                arena_md: vec![5; 7],
                handshake: vec![6; 30],
            }),
        ] {
            let p = PublicData {
                region_md: vec![1, 2, 3],
                bounce,
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
    fn rejects_foreign_blobs() {
        assert!(ConnInfo::decode(b"UCX-worker-address-bytes")
            .unwrap_err()
            .contains("not BOUNCE"));
    }
}
