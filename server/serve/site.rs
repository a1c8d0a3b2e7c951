//! Where a rank's group lives on its host (its segment directory and step ring), and the
//! group's info series.

use std::path::Path;

use anyhow::Context;

use crate::config::{BackendKind, ServeArgs};
use crate::metric_names;

/// This user's private directory for the group's segments under --shm-dir.
pub(super) fn segment_dir(args: &ServeArgs) -> anyhow::Result<std::path::PathBuf> {
    crate::sys::shm::private_dir(&args.shm_dir)
        .with_context(|| format!("the segment directory under {}", args.shm_dir.display()))
}

pub(super) fn ring_path(dir: &Path, group: &str) -> std::path::PathBuf {
    dir.join(format!("epserve-{group}-ring"))
}

/// The group's info series: its backend, size and this rank.
pub(super) fn group_info(backend: BackendKind, rank: usize, world: usize) {
    metrics::gauge!(
        metric_names::GROUP_INFO,
        "backend" => super::prepare::backend_name(backend),
        "world_size" => world.to_string(),
        "ranks_joined" => world.to_string(),
        "rank" => rank.to_string()
    )
    .set(1.0);
}
