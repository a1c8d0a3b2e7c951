//! The leader's EPLB thread: every `--eplb-interval`, one look at the routed load
//! (`eplb::Balance::look`), and on SIGHUP the `--placement` file read again and applied. A
//! placement goes to every rank over the control connections, and the thread waits (bounded)
//! until a step runs on it or it is given up.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::executor::Control;
use crate::eplb::{Balance, SlotMap};
use crate::group::Order;
use crate::lifecycle::Abort;

/// How long every rank has to stage a placement and a step to apply it: loading a layer's
/// experts again from a checkpoint can take seconds.
const STAGE_WITHIN: Duration = Duration::from_secs(120);

/// Starts the balancer thread where there is work for it (`--eplb-interval`, or `--placement`,
/// which SIGHUP applies again); it ends with `stop` or the group.
pub fn spawn(
    balance: Arc<Balance>,
    control: Control,
    placement: Option<PathBuf>,
    stop: CancellationToken,
    abort: Arc<Abort>,
) -> std::io::Result<()> {
    let every = balance.cfg.interval;
    let reload = Arc::new(AtomicBool::new(false));
    if placement.is_some() {
        signal_hook::flag::register(signal_hook::consts::SIGHUP, reload.clone())?;
    } else if every.is_none() {
        return Ok(());
    }
    std::thread::Builder::new()
        .name("eplb".into())
        .spawn(move || {
            let tell = |epoch: u32, map: &SlotMap| {
                let order = Order::Placement {
                    epoch,
                    phy2log: map.to_file().phy2log,
                    lost: map.lost().to_vec(),
                };
                control.broadcast(&order).map_err(|e| e.to_string())
            };
            let over = || stop.is_cancelled() || abort.reason().is_some();
            let mut next_look = every.map(|d| Instant::now() + d);
            loop {
                if over() {
                    return;
                }
                let r = if reload.swap(false, Ordering::AcqRel) {
                    let file = placement.as_deref().expect("SIGHUP is watched with a file");
                    let (_, map) = balance.current();
                    let layers = map.layers().len();
                    SlotMap::from_file(file, map.experts, map.world, layers)
                        .and_then(|next| next.with_lost(map.lost().to_vec()))
                        .and_then(|next| balance.propose(next, &tell, STAGE_WITHIN).map(Some))
                } else if next_look.is_some_and(|t| Instant::now() >= t) {
                    next_look = every.map(|d| Instant::now() + d);
                    balance.look(&tell, STAGE_WITHIN)
                } else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                match r {
                    Ok(_) => {}
                    Err(e) if over() => return tracing::debug!("placement dropped: {e}"),
                    Err(e) => tracing::warn!("placement not applied, the old one stays: {e}"),
                }
            }
        })
        .map(drop)
}
