//! `--on-rank-loss`: whether the group goes on without a lost rank, decided by the leader once
//! it knows the group (the ranks' nodes), and said in its startup log with the reason.

use anyhow::bail;
use tracing::info;

use crate::config::{BackendKind, Ingress, OnRankLoss};
use crate::eplb::SlotMap;
use crate::nodes::Roster;

/// Why the group cannot go on without some rank, or None where it can.
fn cannot(
    backend: BackendKind,
    ingress: Ingress,
    slots: &SlotMap,
    roster: &Roster,
) -> Option<String> {
    match backend {
        BackendKind::Cpu | BackendKind::Nccl => {}
        BackendKind::NcclEp | BackendKind::Auto => {
            return Some("the nccl-ep exchange is not yet rebuilt over the ranks left".into())
        }
    }
    if ingress == Ingress::All {
        return Some("under --ingress all a lost rank's clients are not yet moved".into());
    }
    if roster.world() < 2 {
        return Some("a group of one rank has no other rank to go on with".into());
    }
    // Rank 0 holds the clients' connections: its loss ends the group. Another node's first
    // rank takes its node's ranks with it (`Roster::lost_with`).
    (1..roster.world()).find_map(|r| {
        let lost: Vec<u32> = roster.lost_with(r).iter().map(|&o| o as u32).collect();
        let e = slots.survive(&lost).err()?;
        Some(format!("without rank {r}: {e}"))
    })
}

/// Whether the group goes on without a lost rank; Err where `continue` was asked and cannot be.
pub fn decide(
    asked: OnRankLoss,
    backend: BackendKind,
    ingress: Ingress,
    slots: &SlotMap,
    roster: &Roster,
) -> anyhow::Result<bool> {
    let why_not = cannot(backend, ingress, slots, roster);
    let go_on = match (asked, why_not) {
        (OnRankLoss::Exit, _) => {
            info!("on rank loss: exit (--on-rank-loss exit)");
            false
        }
        (OnRankLoss::Continue, Some(why)) => bail!("--on-rank-loss continue: {why}"),
        (OnRankLoss::Auto, Some(why)) => {
            info!("on rank loss: exit, the group cannot go on without a rank: {why}");
            false
        }
        (_, None) => {
            info!(
                "on rank loss: continue (the ranks left take the lost rank's experts; \
                 the leader's loss still ends the group)"
            );
            true
        }
    };
    Ok(go_on)
}
