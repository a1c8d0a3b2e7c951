//! The control channel's messages, one enum per phase and direction, so each reader matches only
//! what its phase can carry:
//! - `Bringup`, both ways, in lockstep: the rendezvous (hello, welcome) and the startup barriers.
//! - after `Go`, leader → rank: `Order` (steps and the end of the group), its `--ingress all`
//!   part in `IngressOrder`;
//! - after `Go`, rank → leader: `Report` (failures), its `--ingress all` part in `IngressReport`.
//!
//! Frames are JSON objects tagged by `msg` (`ingress` names the ingress variant); a `failed`
//! frame reads the same in `Bringup` and `Report`, so a rank failing across `Go` is heard either
//! way.

use serde::{Deserialize, Serialize};

use crate::nodes::RankNode;
use crate::step::{StepDesc, StepKey};

pub type Fingerprint = Vec<(String, String)>;

/// The rendezvous and startup barriers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Bringup {
    Hello {
        rank: usize,
        world: usize,
        host: String,
        /// Its node and data address (`nodes::RankNode`).
        seat: RankNode,
        fingerprint: Fingerprint,
        /// --group-token, when the group has one.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        token: String,
    },
    Welcome {
        group: String,
        /// Every rank's node and data address, by rank.
        seats: Vec<RankNode>,
        /// The NCCL unique id of the group's communicator (GPU backends).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nccl_id: Option<Vec<u8>>,
        /// The group goes on without a lost rank (`--on-rank-loss continue`): segment and ring
        /// files stay while it runs, for a restarted rank to map when it rejoins.
        #[serde(default)]
        go_on: bool,
        /// The group runs already and this rank comes back into it (`group::rejoin`): the ranks
        /// still out of it. A GPU rank's communicator is without them, and it warms up and
        /// captures its steps with the others, at the roster that has it live again.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rejoining: Option<Vec<u32>>,
    },
    /// Leader to a rank: startup failed, or this rank may not join.
    Reject {
        reason: String,
    },
    /// The rank's exchange segment exists (or its GPU and weights are loaded).
    Created {
        rank: usize,
    },
    /// Every segment exists: map the peers'.
    Map,
    Mapped {
        rank: usize,
    },
    /// Every rank mapped every segment: unlink your files and start.
    Go,
    /// Rank to leader: this rank's startup failed.
    Failed {
        rank: usize,
        reason: String,
    },
}

impl Bringup {
    /// The message's kind, for logs (a stray's payload is not echoed).
    pub fn name(&self) -> &'static str {
        match self {
            Bringup::Hello { .. } => "hello",
            Bringup::Welcome { .. } => "welcome",
            Bringup::Reject { .. } => "reject",
            Bringup::Created { .. } => "created",
            Bringup::Map => "map",
            Bringup::Mapped { .. } => "mapped",
            Bringup::Go => "go",
            Bringup::Failed { .. } => "failed",
        }
    }
}

/// Leader to ranks, after startup.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Order {
    Step(StepDesc),
    /// Leave the step loop and exit cleanly.
    Shutdown,
    /// The group broke (`rank` is the leader's own, 0).
    Failed {
        rank: usize,
        reason: String,
    },
    Ingress(IngressOrder),
    /// A new expert placement (per layer, the logical expert of every slot): stage the weights
    /// of your rewritten slots and report `Staged`; the first step whose `placement` is `epoch`
    /// runs on it.
    Placement {
        epoch: u32,
        phy2log: Vec<Vec<u32>>,
        /// Ranks out of the group: their slots take no rows.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lost: Vec<u32>,
    },
    /// A rank is lost or a step failed: end every step in flight (their rows run again later),
    /// run none until `Roster`, and report `Halted`.
    Halt {
        epoch: u32,
    },
    /// The group goes on without `lost` (every rank lost so far): steps run again, once the
    /// ranks left regrouped (a GPU rank's communicator shrinks without the lost ones).
    Roster {
        epoch: u32,
        lost: Vec<u32>,
    },
    /// Lost `rank` restarted and made its segment again: map it (`Report::Rejoined`); it takes
    /// rows once a `Roster` no longer lists it.
    Rejoin {
        rank: usize,
        pid: u32,
        /// The unique id of the communicator it joins with every rank in the group (GPU
        /// backends; the rank had it in its welcome).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nccl_id: Option<Vec<u8>>,
    },
}

/// Leader to ranks, `--ingress all` only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ingress", rename_all = "snake_case")]
pub enum IngressOrder {
    /// The group is ready: where every rank serves, by rank.
    Open { addrs: Vec<String> },
    /// Before the step's descriptor: the step that takes `homes[rank]` rows of your offers goes
    /// in ring cell `cell`; pack them now.
    Pack {
        cell: u32,
        key: StepKey,
        homes: Vec<u32>,
    },
    /// Refuse new requests, finish the admitted ones.
    Drain,
}

/// Rank to leader, after startup.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Report {
    /// This rank cannot go on (a lost peer, a stuck step, a failed device call).
    Failed {
        rank: usize,
        reason: String,
    },
    /// A step on this rank computed something wrong (its output was not stored).
    Corrupt {
        rank: usize,
        reason: String,
    },
    Ingress(IngressReport),
    /// This rank's steps in flight are ended (after `Order::Halt`): it waits for `Roster`.
    Halted {
        rank: usize,
        epoch: u32,
    },
    /// This rank mapped the segment of rejoining rank `of` (or could not: `error`).
    Rejoined {
        rank: usize,
        of: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A step failed here for want of a peer (`--on-rank-loss continue`): this rank goes on and
    /// waits for the leader to halt the group.
    StepFailed {
        rank: usize,
        reason: String,
    },
    /// This rank has the weights of placement `epoch` staged (`bytes` loaded), or could not
    /// (`error`).
    Staged {
        rank: usize,
        epoch: u32,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// Rank to leader, `--ingress all` only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ingress", rename_all = "snake_case")]
pub enum IngressReport {
    /// Right after `Go`: where this rank serves gRPC.
    Listening { rank: usize, addr: String },
    /// This many tokens of `key` are packed for the leader to schedule.
    Offer { key: StepKey, tokens: u32 },
    /// This rank was signalled: drain the group.
    Drain,
    /// Every request this rank admitted is answered (after a drain).
    Drained { rank: usize },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn json<T: Serialize>(m: &T) -> serde_json::Value {
        serde_json::to_value(m).unwrap()
    }

    fn back<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn ingress_messages_nest_under_one_tag_and_round_trip() {
        let pack = Order::Ingress(IngressOrder::Pack {
            cell: 3,
            key: StepKey {
                layer: 1,
                client_routing: false,
                input: Dtype::Bf16,
                output: Dtype::F32,
            },
            homes: vec![0, 5],
        });
        let v = json(&pack);
        assert_eq!(v["msg"], "ingress");
        assert_eq!(v["ingress"], "pack");
        assert_eq!(back::<Order>(v), pack);
        let drain = Report::Ingress(IngressReport::Drain);
        assert_eq!(
            json(&drain),
            serde_json::json!({"msg": "ingress", "ingress": "drain"})
        );
        assert_eq!(back::<Report>(json(&drain)), drain);
    }

    #[test]
    fn a_failure_reads_the_same_on_either_side_of_go() {
        let (rank, reason) = (2, "no GPU".to_string());
        let v = json(&Bringup::Failed {
            rank,
            reason: reason.clone(),
        });
        assert_eq!(back::<Report>(v.clone()), Report::Failed { rank, reason });
        assert_eq!(
            json(&Report::Failed {
                rank,
                reason: "no GPU".into()
            }),
            v
        );
    }

    #[test]
    fn a_message_of_another_phase_is_refused() {
        let step_msg = json(&Order::Shutdown);
        assert!(serde_json::from_value::<Bringup>(step_msg.clone()).is_err());
        assert!(serde_json::from_value::<Report>(step_msg).is_err());
        assert!(serde_json::from_value::<Order>(json(&Bringup::Go)).is_err());
    }
}
