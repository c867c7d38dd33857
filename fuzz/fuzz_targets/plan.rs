//! Any descriptor list: planning never panics, and a successful plan moves
//! every descriptor byte exactly once within the chunk cap.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_bounce::proto::plan::{build, Descriptor, PlanOptions};

fn u64_at(data: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    for (k, byte) in b.iter_mut().enumerate() {
        *byte = data.get(i + k).copied().unwrap_or(0);
    }
    u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let max_chunk_bytes = u64_at(data, 0) % (1 << 20);
    let merge_runs = data[8] & 1 == 0;
    let descs: Vec<Descriptor> = data[9..]
        .chunks(20)
        .take(512)
        .map(|c| Descriptor {
            src_addr: u64_at(c, 0),
            dst_addr: u64_at(c, 8),
            // Mostly small lengths, sometimes huge ones.
            len: u64::from(u16::from_le_bytes([c.get(16).copied().unwrap_or(0), c.get(17).copied().unwrap_or(0)]))
                << (c.get(18).copied().unwrap_or(0) % 24),
            src_dev: u32::from(c.get(19).copied().unwrap_or(0) == 255),
            dst_dev: 0,
        })
        .collect();
    let total: u128 = descs.iter().map(|d| u128::from(d.len)).sum();
    if total > 1 << 26 || total / u128::from(max_chunk_bytes.max(32)) > 50_000 {
        return; // keep runs fast
    }
    if let Ok(plan) = build(&descs, PlanOptions { max_chunk_bytes, merge_runs }) {
        let mut moved: u128 = 0;
        for chunk in &plan.chunks {
            assert!(chunk.bytes <= max_chunk_bytes);
            for run in chunk.scatter_runs.iter() {
                assert!(run.region_end().expect("run overflows") <= chunk.bytes);
                moved += u128::from(run.total_bytes().expect("run size overflows"));
            }
        }
        assert_eq!(moved, total);
    }
});
