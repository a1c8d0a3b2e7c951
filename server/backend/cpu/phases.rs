//! The cpu backend's step, phase by phase: one trait per phase over the rank's own buffers, and
//! `run_phases`, which runs and times them in order on the host.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::step::{PhaseTimes, StepDesc, StepError};

/// Moves the home slice between the step ring and the backend's buffers.
pub trait StepIo {
    fn load_home(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<(), StepError>;
    fn store_home(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<(), StepError>;
}

/// Router GEMM and top-k over the home tokens.
pub trait Gating {
    fn gate(&mut self, desc: &StepDesc, tokens: usize) -> Result<(), StepError>;
}

/// The all-to-all: counts and layout, tokens to their experts, results back home.
pub trait AllToAll {
    fn prepare(&mut self, desc: &StepDesc, tokens: usize) -> Result<(), StepError>;
    fn dispatch(&mut self, desc: &StepDesc, tokens: usize) -> Result<(), StepError>;
    fn combine(&mut self, desc: &StepDesc, tokens: usize) -> Result<(), StepError>;
}

/// SwiGLU FFN of every local expert over its contiguous block of received rows.
pub trait Experts {
    fn compute(&mut self, desc: &StepDesc) -> Result<(), StepError>;
}

/// The phases one by one, each timed on the host: the step of a backend whose phases run there.
pub fn run_phases<B>(
    b: &mut B,
    desc: &StepDesc,
    home: Range<usize>,
) -> Result<PhaseTimes, StepError>
where
    B: StepIo + Gating + AllToAll + Experts,
{
    let t0 = Instant::now();
    let n = home.len();
    let mut times = PhaseTimes {
        phased: true,
        ..PhaseTimes::default()
    };
    let mut lap = Instant::now();
    let mut mark = |d: &mut Duration| {
        let now = Instant::now();
        *d = now - lap;
        lap = now;
    };
    b.load_home(desc, home.clone())?;
    if !desc.client_routing {
        b.gate(desc, n)?;
    }
    mark(&mut times.gating);
    b.prepare(desc, n)?;
    mark(&mut times.prepare);
    b.dispatch(desc, n)?;
    mark(&mut times.dispatch);
    b.compute(desc)?;
    mark(&mut times.experts);
    b.combine(desc, n)?;
    b.store_home(desc, home)?;
    mark(&mut times.combine);
    times.total = t0.elapsed();
    Ok(times)
}
