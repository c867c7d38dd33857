//! The connection info BOUNCE publishes through NIXL's metadata.
//!
//! Layout (little-endian):
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
    fn rejects_foreign_blobs() {
        assert!(ConnInfo::decode(b"UCX-worker-address-bytes")
            .unwrap_err()
            .contains("not BOUNCE"));
    }
}
