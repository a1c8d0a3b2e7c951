//! Groups that span nodes. A node is the ranks that share one host's memory (`--node-id`; each
//! node its own `--shm-dir`). Within a node ranks write into each other's shared memory as
//! before; to a rank of another node the same writes and flag raises travel over a TCP data
//! connection (`mirror`) and are applied to the receiver's own mapping, in order, so readers on
//! either side wait on the same flags. `plane` makes those connections once, at startup.
//!
//! The rendezvous hands every rank the `Roster`: each rank's node and data address.

pub mod mirror;
pub mod plane;

use serde::{Deserialize, Serialize};

/// Where one rank runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankNode {
    /// Its `--node-id`.
    pub node: String,
    /// Its data listener, as peers on other nodes reach it (HOST:PORT).
    pub data: String,
    /// Its process id: a rank declared lost is killed by the survivors of its node (its host),
    /// so it can never write into their segments again.
    #[serde(default)]
    pub pid: u32,
}

/// Every rank's seat, by rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roster(pub Vec<RankNode>);

impl Roster {
    pub fn world(&self) -> usize {
        self.0.len()
    }
    pub fn node(&self, rank: usize) -> &str {
        &self.0[rank].node
    }
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        self.node(a) == self.node(b)
    }
    /// The lowest rank of `rank`'s node: it creates the node's step ring (rank 0 on its own).
    pub fn leader(&self, rank: usize) -> usize {
        (0..self.world())
            .find(|&r| self.same_node(r, rank))
            .unwrap_or(rank)
    }
    /// Kills `rank` where it runs on this rank's node (`me`'s host): a rank the group declared
    /// lost may only be stopped (SIGSTOP, a hung host call), and must never wake to write into a
    /// survivor's segment. Checked first that the pid is still an epserve process.
    pub fn fence(&self, me: usize, rank: usize) -> Option<String> {
        let pid = self.0.get(rank)?.pid;
        if pid == 0 || !self.same_node(me, rank) || pid == std::process::id() {
            return None;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmd).contains("epserve") {
            return None;
        }
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        match nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL) {
            Ok(()) => Some(format!("killed rank {rank} (pid {pid}) on this node")),
            Err(e) => Some(format!("could not kill rank {rank} (pid {pid}): {e}")),
        }
    }
    /// The ranks lost with `rank`: itself, and where it is another node's first rank than the
    /// leader's (it receives its node's step input and data), the rest of its node.
    pub fn lost_with(&self, rank: usize) -> Vec<usize> {
        match rank != 0 && self.leader(rank) == rank && !self.same_node(rank, 0) {
            true => (rank..self.world())
                .filter(|&o| self.same_node(o, rank))
                .collect(),
            false => vec![rank],
        }
    }
    /// Whether the group spans more than one node.
    pub fn spans_nodes(&self) -> bool {
        (1..self.world()).any(|r| !self.same_node(0, r))
    }
    /// Ranks on other nodes than `rank`'s.
    pub fn away_from(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.world()).filter(move |&r| !self.same_node(r, rank))
    }
    /// The nodes other than rank 0's, each as its leader and its ranks.
    pub fn other_nodes(&self) -> Vec<(usize, Vec<usize>)> {
        // In rank order, so each node's first rank is its leader.
        by_node(self.away_from(0).map(|r| (r, self.node(r))))
            .into_iter()
            .map(|(_, ranks)| (ranks[0], ranks))
            .collect()
    }
    /// Node ids in order of first rank, with their ranks (`GetModelInfo`, logs).
    pub fn nodes(&self) -> Vec<(String, Vec<usize>)> {
        by_node(self.0.iter().map(|s| s.node.as_str()).enumerate())
            .into_iter()
            .map(|(n, ranks)| (n.to_string(), ranks))
            .collect()
    }
}

/// (rank, node) pairs grouped by node, in order of each node's first rank.
pub fn by_node<'a>(seats: impl Iterator<Item = (usize, &'a str)>) -> Vec<(&'a str, Vec<usize>)> {
    let mut out: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, node) in seats {
        match out.iter_mut().find(|(n, _)| *n == node) {
            Some((_, ranks)) => ranks.push(r),
            None => out.push((node, vec![r])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roster(nodes: &[&str]) -> Roster {
        Roster(
            nodes
                .iter()
                .map(|n| RankNode {
                    node: n.to_string(),
                    data: String::new(),
                    pid: 0,
                })
                .collect(),
        )
    }

    /// Another node's first rank takes its node with it; the leader's node's ranks and a
    /// node's later ranks go alone.
    #[test]
    fn a_nodes_first_rank_is_lost_with_its_node() {
        let r = roster(&["a", "b", "a", "b", "c"]);
        assert_eq!(r.lost_with(1), vec![1, 3]);
        assert_eq!(r.lost_with(3), vec![3]);
        assert_eq!(r.lost_with(2), vec![2]);
        assert_eq!(r.lost_with(4), vec![4]);
    }

    #[test]
    fn leaders_and_other_nodes() {
        let r = roster(&["a", "b", "a", "b", "c"]);
        assert!(r.spans_nodes());
        assert_eq!(r.leader(3), 1);
        assert_eq!(r.leader(2), 0);
        assert_eq!(r.other_nodes(), vec![(1, vec![1, 3]), (4, vec![4])]);
        assert_eq!(r.away_from(1).collect::<Vec<_>>(), vec![0, 2, 4]);
        assert_eq!(r.nodes()[0], ("a".to_string(), vec![0, 2]));
        assert!(!roster(&["a", "a"]).spans_nodes());
    }
}
