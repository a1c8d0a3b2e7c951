//! The leader's readers of the other ranks' control connections: each passes on what its rank
//! reports (offers and drains under `--ingress all`, staged placements, halts) and turns a
//! failure or a closed connection into a broken group, or, where the group goes on without a
//! lost rank, into a halt the executor recovers from.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::recover;
use super::PeerEvents;
use crate::eplb::Balance;
use crate::group::{recv, GroupError, IngressReport, Report};
use crate::lifecycle::Abort;
use crate::sched::coordinator::Offer;

/// Reads one rank's control connection after startup.
pub(super) struct Watch {
    pub(super) rank: usize,
    /// Most rows of one offer.
    pub(super) stride: usize,
    pub(super) events: Option<PeerEvents>,
    pub(super) balance: Arc<Balance>,
    /// `--on-rank-loss continue`: losses and halts go to the executor, which halts the group
    /// and goes on without the lost rank, instead of breaking it.
    pub(super) heard: Option<std::sync::mpsc::Sender<recover::Heard>>,
}

impl Watch {
    /// Reads `stream` on a thread of its own.
    pub(super) fn spawn(
        self,
        stream: &TcpStream,
        abort: Arc<Abort>,
        closing: Arc<AtomicBool>,
    ) -> Result<(), GroupError> {
        let mut r = stream.try_clone().map_err(|source| GroupError::Io {
            what: "control socket".into(),
            source,
        })?;
        std::thread::Builder::new()
            .name(format!("ctl-rank{}", self.rank))
            .spawn(move || self.run(&mut r, &abort, &closing))
            .map(drop)
            .map_err(|source| GroupError::Io {
                what: "spawning a control reader".into(),
                source,
            })
    }

    /// Passes on offers and drain messages (`--ingress all`) until the rank fails, sends
    /// something it should not, or disconnects, which breaks the group unless it is closing.
    fn run(&self, stream: &mut TcpStream, abort: &Abort, closing: &AtomicBool) {
        let rank = self.rank;
        let (reason, corrupt) = loop {
            match recv(stream) {
                Ok(Report::Ingress(report)) => {
                    if let Err(e) = self.ingress(report) {
                        break (e, false);
                    }
                }
                Ok(Report::Failed { reason, .. }) => {
                    break (format!("rank {rank} failed: {reason}"), false)
                }
                Ok(Report::Halted { epoch, .. }) => self.hear(recover::Heard::Halted(rank, epoch)),
                Ok(Report::Rejoined { of, error, .. }) => {
                    self.hear(recover::Heard::Rejoined(rank, of, error))
                }
                Ok(Report::StepFailed { reason, .. }) => {
                    let why = format!("rank {rank}: {reason}");
                    match &self.heard {
                        Some(_) => {
                            abort.halt(why.clone());
                            self.hear(recover::Heard::StepFailed(rank, why));
                        }
                        None => break (why, false),
                    }
                }
                Ok(Report::Corrupt { reason, .. }) => {
                    break (format!("rank {rank}: {reason}"), true)
                }
                Ok(Report::Staged {
                    epoch,
                    bytes,
                    error,
                    ..
                }) => self
                    .balance
                    .staged(rank, epoch, error.map_or(Ok(bytes), Err)),
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                    break (format!("rank {rank} disconnected"), false)
                }
                Err(e) => break (format!("rank {rank} control connection: {e}"), false),
            }
        };
        // A rank the group already went on without (its connection shut by the executor) says
        // nothing new by closing.
        let out = abort.is_fenced(self.rank);
        match (closing.load(Ordering::Acquire) || out, corrupt, &self.heard) {
            (true, _, _) => {}
            (false, true, _) => abort.trigger_corrupt(reason),
            // The executor halts the group and goes on without this rank.
            (false, false, Some(_)) => {
                abort.halt(reason.clone());
                self.hear(recover::Heard::Lost(rank, reason));
            }
            (false, false, None) => abort.trigger(reason),
        }
    }

    fn hear(&self, what: recover::Heard) {
        if let Some(h) = &self.heard {
            let _ = h.send(what);
        }
    }

    /// Passes on an offer or a drain (`--ingress all`); anything else is the rank's mistake.
    fn ingress(&self, report: IngressReport) -> Result<(), String> {
        let rank = self.rank;
        match (report, &self.events) {
            (IngressReport::Offer { key, tokens }, Some(ev))
                if (1..=self.stride).contains(&(tokens as usize)) =>
            {
                let offer = Offer {
                    key,
                    tokens: tokens as usize,
                };
                // The coordinator is gone only once the group stops.
                let _ = ev.offers.send((rank, offer));
            }
            (IngressReport::Drain, Some(ev)) => ev.drain.cancel(),
            (IngressReport::Drained { .. }, Some(ev)) => ev.drained.add_permits(1),
            (other, _) => return Err(format!("rank {rank} sent unexpected {other:?}")),
        }
        Ok(())
    }
}
