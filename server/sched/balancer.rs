//! The leader's EPLB thread: every `--eplb-interval`, one look at the routed load
//! (`eplb::Balance::look`); a placement it proposes goes to every rank over the control
//! connections, and the thread waits (bounded) until a step runs on it or it is given up.

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

/// Starts the balancer thread (with `--eplb-interval` only); it ends with `stop` or the group.
pub fn spawn(
    balance: Arc<Balance>,
    control: Control,
    stop: CancellationToken,
    abort: Arc<Abort>,
) -> std::io::Result<()> {
    let Some(every) = balance.cfg.interval else {
        return Ok(());
    };
    std::thread::Builder::new()
        .name("eplb".into())
        .spawn(move || {
            let tell = |epoch: u32, map: &SlotMap| {
                let order = Order::Placement {
                    epoch,
                    phy2log: map.to_file().phy2log,
                };
                control.broadcast(&order).map_err(|e| e.to_string())
            };
            let over = || stop.is_cancelled() || abort.reason().is_some();
            loop {
                let until = Instant::now() + every;
                while Instant::now() < until {
                    if over() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                match balance.look(&tell, STAGE_WITHIN) {
                    Ok(_) => {}
                    Err(e) if over() => return tracing::debug!("placement dropped: {e}"),
                    Err(e) => tracing::warn!("placement not applied, the old one stays: {e}"),
                }
            }
        })
        .map(drop)
}
