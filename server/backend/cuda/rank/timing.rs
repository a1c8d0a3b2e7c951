//! What a step's events say of it: each staging set's step records five events on the compute
//! stream, and with `--step-phase-times` its graph four more between its phases; the gaps
//! between them are the `PhaseTimes` the rank reports (docs/benchmarks.md "Load balance",
//! session 55, put #54's slow steps down to their parts with them).

use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, DriverError};

use crate::backend::cuda::step::GpuStep;
use crate::step::PhaseTimes;

/// One staging set's events: its start, its graph's turn (after a placement's copies), its
/// small copies in done, its graph done, its end.
pub(super) struct Marks {
    pub began: CudaEvent,
    pub launched: CudaEvent,
    pub copied: CudaEvent,
    pub computed: CudaEvent,
    pub ended: CudaEvent,
}

impl Marks {
    pub fn new(core: &GpuStep) -> Result<Self, DriverError> {
        let e = || core.g.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        Ok(Self {
            began: e()?,
            launched: e()?,
            copied: e()?,
            computed: e()?,
            ended: e()?,
        })
    }

    /// The step's device times, once it has completed: `inside` are the events its graph
    /// recorded between its phases (after gating, prepare, dispatch, the experts), where its
    /// replay's are still there to read. Gating counts from the small copies in, so on an idle
    /// GPU it holds the graph's launch.
    pub fn times(&self, inside: Option<&[CudaEvent; 4]>) -> PhaseTimes {
        let phases = inside.and_then(|m| {
            Some([
                between(&self.copied, &m[0])?,
                between(&m[0], &m[1])?,
                between(&m[1], &m[2])?,
                between(&m[2], &m[3])?,
                between(&m[3], &self.computed)?,
            ])
        });
        let [gating, prepare, dispatch, experts, combine] = phases.unwrap_or_default();
        PhaseTimes {
            phased: phases.is_some(),
            gating,
            prepare,
            dispatch,
            experts,
            combine,
            device: between(&self.began, &self.ended),
            device_wait: between(&self.began, &self.launched),
            device_in: between(&self.launched, &self.copied),
            device_out: between(&self.computed, &self.ended),
            ..PhaseTimes::default()
        }
    }
}

/// The time from `a` to `b`, both recorded and done (None otherwise).
fn between(a: &CudaEvent, b: &CudaEvent) -> Option<Duration> {
    (a.elapsed_ms(b).ok()).map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}
