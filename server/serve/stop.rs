//! What ends the leader's serving: a signal (drain) or the group breaking.

use tokio_util::sync::CancellationToken;

use crate::lifecycle::Abort;

/// Why the leader stops serving.
pub enum Stop {
    Signal(&'static str),
    Broken(String),
}

/// SIGINT, SIGTERM, another rank's signal (`asked`, --ingress all), or the group breaking.
pub async fn wait_for_stop(abort: &Abort, asked: Option<CancellationToken>) -> Stop {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return Stop::Broken("cannot install signal handlers".into());
    };
    tokio::select! {
        _ = int.recv() => Stop::Signal("SIGINT"),
        _ = term.recv() => Stop::Signal("SIGTERM"),
        r = abort.broken() => Stop::Broken(r),
        _ = async { asked.unwrap_or_default().cancelled().await }, if asked.is_some() => Stop::Signal("a rank's signal"),
    }
}
