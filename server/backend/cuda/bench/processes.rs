//! `epserve bench --rank-processes`: each rank a process of its own, as `epserve launch` runs
//! them (a rank thread shares its process's host threads and CUDA driver with the others; a
//! serving rank does not). Each process is this binary again, with the same arguments and
//! `--bench-child`: it measures its rank of one run and leaves the result in a file.

use std::path::PathBuf;
use std::process::{Child as Proc, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::backend::bench::{Child, RankResult};

/// The most one run's processes may take, bring-up included: a rank waits at most 300 s for
/// its peers, and 1,500 steps of the largest config take well under a minute.
const BOUND: Duration = Duration::from_secs(900);

/// The run's processes and their result files: whatever way `run` leaves, no process outlives
/// it and no file is left behind.
struct Ranks {
    procs: Vec<Proc>,
    files: Vec<PathBuf>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for p in &mut self.procs {
            if matches!(p.try_wait(), Ok(None)) {
                let _ = p.kill();
                let _ = p.wait();
            }
        }
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Run `run` of this bench with each of `world` ranks in a process of its own.
pub fn run(run: usize, id: &[u8], world: usize, clock_us: u64) -> anyhow::Result<Vec<RankResult>> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut ranks = Ranks {
        procs: Vec::new(),
        files: Vec::new(),
    };
    for rank in 0..world {
        let file = std::env::temp_dir().join(format!(
            "epserve-bench-{}-{run}-{rank}.json",
            std::process::id()
        ));
        ranks.files.push(file.clone());
        let spec = Child {
            run,
            rank,
            id: id.to_vec(),
            clock_us,
            file,
        }
        .spec();
        let p = Command::new(&exe)
            .args(&args)
            .args(["--bench-child", &spec])
            .spawn()
            .with_context(|| format!("starting rank {rank}'s process"))?;
        ranks.procs.push(p);
    }
    let deadline = Instant::now() + BOUND;
    let mut done = vec![false; world];
    while done.contains(&false) {
        for (rank, p) in ranks.procs.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = p.try_wait()? {
                if !status.success() {
                    bail!("rank {rank}'s process ended: {status}");
                }
                done[rank] = true;
            }
        }
        if Instant::now() >= deadline {
            bail!("the ranks' processes took over {} s", BOUND.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (ranks.files.iter())
        .map(|f| {
            let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", f.display()))
        })
        .collect()
}
