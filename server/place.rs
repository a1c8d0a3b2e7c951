//! A rank's place in its group: which rank, of how many. One type wherever a rank says where it
//! sits (its flags' `config::Member`, the rendezvous's `group::Joiner`, a GPU's `gpu::Seat`);
//! where it runs is its node (`nodes::RankNode`), and rank 0 is the leader.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub rank: usize,
    pub world: usize,
}
