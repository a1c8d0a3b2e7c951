//! `--on-rank-loss`: whether the group goes on without a lost rank, decided by the leader once
//! it knows the group (the ranks' nodes), and said in its startup log with the reason.

use anyhow::bail;
use tracing::info;

use crate::backend::ep_settings::EpSettings;
use crate::config::{Ingress, OnRankLoss};
use crate::eplb::SlotMap;
use crate::nodes::Roster;

/// Why the group cannot go on without some rank, or None where it can.
fn cannot(
    ingress: Ingress,
    ep: Option<&EpSettings>,
    slots: &SlotMap,
    roster: &Roster,
) -> Option<String> {
    // A step in flight waits in NCCL EP's kernels for the lost rank: LL's give up on it after
    // their timeout (the group's mask, `--step-timeout`); HT's have none in NCCL EP 0.2 (no
    // mask: they trap the GPU, ~100 s on), so the ranks left could never end that step.
    if ep.is_some_and(|e| e.ht) {
        return Some(
            "nccl-ep runs high-throughput kernels (buckets above --ep-ll-max-tokens), which cannot end a step whose peer is gone (NCCL EP 0.2 masks a lost rank in low-latency mode only); --ep-mode ll, or --max-tokens-per-step within --ep-ll-max-tokens, lets the group go on"
                .into(),
        );
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
    ingress: Ingress,
    ep: Option<&EpSettings>,
    slots: &SlotMap,
    roster: &Roster,
) -> anyhow::Result<bool> {
    let why_not = cannot(ingress, ep, slots, roster);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::RankNode;

    fn roster(world: usize) -> Roster {
        let seat = |_| RankNode {
            node: "n0".into(),
            data: String::new(),
            pid: 0,
        };
        Roster((0..world).map(seat).collect())
    }

    /// nccl-ep goes on where every bucket runs LL (its kernels mask a lost peer), and not where
    /// one runs HT, saying why; room for the experts is still asked for.
    #[test]
    fn nccl_ep_goes_on_only_where_no_bucket_runs_high_throughput() {
        let room = SlotMap::contiguous(16, 2, 16, 2).unwrap();
        let ep = |ll_max, ht| EpSettings {
            ll_max,
            ht,
            zero_copy: true,
        };
        let two = roster(2);
        assert_eq!(
            cannot(Ingress::Leader, Some(&ep(64, false)), &room, &two),
            None
        );
        let ht = cannot(Ingress::Leader, Some(&ep(64, true)), &room, &two).unwrap();
        assert!(
            ht.contains("high-throughput") && ht.contains("--ep-mode ll"),
            "{ht}"
        );
        let tight = SlotMap::contiguous(16, 2, 0, 2).unwrap();
        let why = cannot(Ingress::Leader, Some(&ep(64, false)), &tight, &two).unwrap();
        assert!(why.starts_with("without rank 1"), "{why}");
    }
}
