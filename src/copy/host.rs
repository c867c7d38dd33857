//! The host (DRAM) copy engine: `memcpy`, with large jobs split over threads.

use super::{check_runs, CopyEngine, CopyError, Direction, RegionSpan};
use crate::proto::Run;

/// Copies with the CPU. Jobs of at least `parallel_threshold` bytes are
/// split across `threads` scoped threads (by run, then by copy).
#[derive(Debug, Clone)]
pub struct HostCopy {
    pub threads: usize,
    pub parallel_threshold: u64,
}

impl Default for HostCopy {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(4);
        Self {
            threads,
            parallel_threshold: 8 << 20,
        }
    }
}

impl CopyEngine for HostCopy {
    fn copy(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<(), CopyError> {
        let total = check_runs(direction, region.len, runs)?;
        let copies: Vec<(u64, u64, u64)> = runs.iter().flat_map(|r| r.copies()).collect();
        if self.threads > 1 && total >= self.parallel_threshold && copies.len() > 1 {
            let per = copies.len().div_ceil(self.threads);
            std::thread::scope(|s| {
                for part in copies.chunks(per) {
                    s.spawn(move || copy_all(direction, region, part));
                }
            });
        } else {
            copy_all(direction, region, &copies);
        }
        Ok(())
    }
}

fn copy_all(direction: Direction, region: RegionSpan, copies: &[(u64, u64, u64)]) {
    for &(off, addr, len) in copies {
        let region_ptr = (region.addr + off as usize) as *mut u8;
        let app_ptr = addr as usize as *mut u8;
        // SAFETY: check_runs proved [off, off+len) lies inside the region,
        // which is arena memory this process owns for the life of the copy
        // (the protocol hands a region to exactly one copy at a time). The
        // application range was validated by the caller (see CopyEngine).
        // The two ranges never overlap: one is inside the arena, the other
        // is application memory registered outside it.
        unsafe {
            match direction {
                Direction::Gather => {
                    std::ptr::copy_nonoverlapping(app_ptr as *const u8, region_ptr, len as usize)
                }
                Direction::Scatter => {
                    std::ptr::copy_nonoverlapping(region_ptr as *const u8, app_ptr, len as usize)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(region_offset: u64, addr: usize, len: u64, count: u32, rs: u64, as_: u64) -> Run {
        Run {
            region_offset,
            addr: addr as u64,
            len,
            count,
            region_stride: rs,
            addr_stride: as_,
        }
    }

    #[test]
    fn gather_then_scatter_round_trips_strided_runs() {
        for engine in [
            HostCopy {
                threads: 1,
                parallel_threshold: u64::MAX,
            },
            HostCopy {
                threads: 3,
                parallel_threshold: 0,
            },
        ] {
            let src: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
            let mut region = vec![0u8; 32 * 1024];
            let mut dst = vec![0xAAu8; 64 * 1024];
            let span = RegionSpan {
                addr: region.as_mut_ptr() as usize,
                len: region.len(),
            };
            // 8 blocks of 1000 bytes every 4096 bytes -> packed every 1024.
            let g = [
                run(0, src.as_ptr() as usize + 100, 1000, 8, 1024, 4096),
                run(9000, src.as_ptr() as usize, 5, 1, 0, 0),
            ];
            engine.copy(Direction::Gather, span, &g).unwrap();
            let s = [
                run(0, dst.as_mut_ptr() as usize + 8, 1000, 8, 1024, 2000),
                run(9000, dst.as_mut_ptr() as usize + 60000, 5, 1, 0, 0),
            ];
            engine.copy(Direction::Scatter, span, &s).unwrap();
            for i in 0..8 {
                assert_eq!(
                    &dst[8 + i * 2000..8 + i * 2000 + 1000],
                    &src[100 + i * 4096..100 + i * 4096 + 1000]
                );
            }
            assert_eq!(&dst[60000..60005], &src[..5]);
            assert_eq!(dst[7], 0xAA);
            assert_eq!(dst[60005], 0xAA);
        }
    }

    #[test]
    fn runs_outside_the_region_are_refused_before_copying() {
        let mut region = vec![0u8; 4096];
        let src = vec![1u8; 8192];
        let span = RegionSpan {
            addr: region.as_mut_ptr() as usize,
            len: region.len(),
        };
        let e = HostCopy::default()
            .copy(
                Direction::Gather,
                span,
                &[
                    run(0, src.as_ptr() as usize, 100, 1, 0, 0),
                    run(4000, src.as_ptr() as usize, 200, 1, 0, 0),
                ],
            )
            .unwrap_err();
        assert!(e.reason.contains("run 1"), "{e}");
        assert!(
            region.iter().all(|&b| b == 0),
            "nothing may be copied when any run is bad"
        );
    }
}
