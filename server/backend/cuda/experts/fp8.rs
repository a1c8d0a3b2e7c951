//! FP8 experts in the step (DeepSeek-V3's recipe, `model::fp8`): weights on the device as
//! shipped (E4M3 with 128x128 block scales), and each grouped SwiGLU FFN as rows quantized per
//! 128 channels (here, or by the slot exchange as it packs them), the FP8 gate/up GEMM
//! (DeepGEMM's; decode's own for experts of few rows), SwiGLU quantized in the same pass, the
//! FP8 down GEMM, in the layouts the exchange gives (`exchange::ExpertRows`). Outputs are bf16,
//! as the bf16 path's, so combine is unchanged.

use std::borrow::Cow;

use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use half::bf16;

use crate::backend::cuda::kernels::decode_gemm::Spans;
use crate::backend::cuda::kernels::fp8::{Fp8Rows, Fp8Weights, Live};
use crate::backend::cuda::kernels::hopper::{Layout, Sms};
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::{Alloc, Gpu, GpuError};
use crate::model::fp8::{Blocks, BLOCK};
use crate::model::{Ffn, Matrix};

/// A matrix as FP8 blocks: as held, or quantized here if held as values.
fn blocks(m: &Matrix, rows: usize, cols: usize) -> Cow<'_, Blocks> {
    match m {
        Matrix::Fp8(b) => Cow::Borrowed(b),
        Matrix::F32(v) => Cow::Owned(Blocks::quantize(v, rows, cols)),
    }
}

/// `ffns`' gate/up and down weights stacked (`[groups][2 * inter][hidden]`,
/// `[groups][hidden][inter]`) with their scales, uploaded.
pub fn upload<'a>(
    a: &mut Alloc,
    ffns: impl ExactSizeIterator<Item = &'a Ffn>,
    hidden: usize,
    inter: usize,
) -> Result<(Fp8Weights, Fp8Weights), DriverError> {
    let groups = ffns.len();
    let (mut gq, mut gs, mut dq, mut ds) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for f in ffns {
        let gu = blocks(&f.gate_up, 2 * inter, hidden);
        let down = blocks(&f.down, hidden, inter);
        gq.extend_from_slice(&gu.q);
        gs.extend_from_slice(&gu.scales);
        dq.extend_from_slice(&down.q);
        ds.extend_from_slice(&down.scales);
    }
    let weights = |a: &mut Alloc, q: &[u8], sf: &[f32], n, k| -> Result<_, DriverError> {
        Ok(Fp8Weights::new(a.upload(q)?, a.upload(sf)?, groups, n, k))
    };
    Ok((
        weights(a, &gq, &gs, 2 * inter, hidden)?,
        weights(a, &dq, &ds, hidden, inter)?,
    ))
}

/// One FFN's FP8 weights and scales written over `w`'s (one group each), on `stream`.
pub fn upload_into(
    w: (&mut Fp8Weights, &mut Fp8Weights),
    f: &Ffn,
    hidden: usize,
    inter: usize,
    stream: &std::sync::Arc<CudaStream>,
) -> Result<(), DriverError> {
    for (w, m, n, k) in [
        (w.0, &f.gate_up, 2 * inter, hidden),
        (w.1, &f.down, hidden, inter),
    ] {
        let b = blocks(m, n, k);
        assert!(
            w.groups == 1 && w.q.len() == b.q.len() && w.sf.len() == b.scales.len(),
            "an FFN of another shape than the slot it is written over"
        );
        stream.memcpy_htod(&b.q, &mut w.q)?;
        stream.memcpy_htod(&b.scales, &mut w.sf)?;
    }
    Ok(())
}

/// Random FP8 weights made on the GPU (for `epserve bench`: timing, not numerics).
pub fn random(
    g: &Gpu,
    a: &mut Alloc,
    (groups, hidden, inter): (usize, usize, usize),
    seed: u64,
) -> Result<(Fp8Weights, Fp8Weights), DriverError> {
    let mut one = |n: usize, k: usize, seed: u64| -> Result<Fp8Weights, DriverError> {
        let mut q = a.zeros::<u8>(groups * n * k)?;
        let mut sf = a.zeros::<f32>(groups * (n / BLOCK) * (k / BLOCK))?;
        g.fp8.fill_random(&mut q, seed, &g.stream)?;
        g.fill_uniform_f32(&mut sf, seed + 1, (3.0 / k as f32).sqrt() / 448.0)?;
        Ok(Fp8Weights::new(q, sf, groups, n, k))
    };
    Ok((one(2 * inter, hidden, seed)?, one(hidden, inter, seed + 2)?))
}

/// The step's quantized rows: the expert rows (unless the exchange quantizes them:
/// `StepShape::fp8_dispatch`) and their activations, the shared expert's home rows and its
/// activations (`StepShape::fp8_rows`).
pub struct Fp8Bufs {
    x: Option<Fp8Rows>,
    act: Fp8Rows,
    shared_x: Fp8Rows,
    shared_act: Fp8Rows,
}

impl Fp8Bufs {
    pub fn new(a: &mut Alloc, s: &StepShape) -> Result<Self, DriverError> {
        let [x, act, sx, sa] = s.fp8_rows();
        Ok(Self {
            x: match s.fp8_dispatch() {
                true => None,
                false => Some(Fp8Rows::zeros(a, x.0, x.1)?),
            },
            act: Fp8Rows::zeros(a, act.0, act.1)?,
            shared_x: Fp8Rows::zeros(a, sx.0, sx.1)?,
            shared_act: Fp8Rows::zeros(a, sa.0, sa.1)?,
        })
    }
}

/// `x`'s first `rows` rows quantized (the `live` ones) into the step's buffer.
fn quantize<'b>(
    g: &Gpu,
    x: &CudaSlice<bf16>,
    rows: usize,
    live: Live,
    into: &'b mut Option<Fp8Rows>,
) -> Result<&'b Fp8Rows, GpuError> {
    let q = into
        .as_mut()
        .ok_or_else(|| GpuError::Config("bf16 expert rows without FP8 row buffers".into()))?;
    g.fp8.quantize(x, rows, live, q, &g.stream)?;
    Ok(q)
}

/// One FFN over `rows` quantized rows `xq` in `layout`: gate/up into `gu`, SwiGLU (times
/// `weights` where given) quantized into `aq`, down into `x`. Experts of few rows each
/// (`decode`: where their rows are) go to decode's own GEMM, as in bf16; the rest to DeepGEMM's.
#[allow(clippy::too_many_arguments)]
fn ffn(
    g: &Gpu,
    (gate_up, down): (&Fp8Weights, &Fp8Weights),
    (at, live, sizes): ((Layout, Sms), Live, &CudaSlice<i32>),
    decode: Option<Spans>,
    rows: usize,
    weights: Option<&CudaSlice<f32>>,
    (xq, aq): (&Fp8Rows, &mut Fp8Rows),
    gu: &mut CudaSlice<bf16>,
    x: &mut CudaSlice<bf16>,
) -> Result<(), DriverError> {
    let s = &g.stream;
    let gemm = |xq: &Fp8Rows, w: &Fp8Weights, y: &mut CudaSlice<bf16>| match decode {
        Some(spans) => g.decode.gemm_fp8(xq, rows, w, spans, y),
        None => g.fp8.gemm(xq, rows, w, at, sizes, y, s),
    };
    gemm(xq, gate_up, gu)?;
    g.fp8.swiglu_quantize(gu, rows, live, weights, aq, s)?;
    gemm(aq, down, x)
}

/// The routed experts over contiguous expert-major blocks (`ExpertRows::Blocks`): DeepGEMM's
/// psum layout on `sms` (or decode's own GEMM, `decode`), over the `cap` rows quantized here, or
/// as the exchange quantized them (`pre`); a row's routing weight scales its activation (the down
/// projection is linear). The quantization passes skip each block's padding rows.
#[allow(clippy::too_many_arguments)]
pub fn contiguous(
    g: &Gpu,
    w: (&Fp8Weights, &Fp8Weights),
    (cap, pre): (usize, Option<&Fp8Rows>),
    (offsets, ends): (&CudaSlice<i32>, &CudaSlice<i32>),
    (decode, sms): (bool, Sms),
    weights: Option<&CudaSlice<f32>>,
    b: &mut Fp8Bufs,
    gu: &mut CudaSlice<bf16>,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let live = Live::Psum {
        ends,
        groups: w.0.groups,
    };
    let decode = decode.then_some(Spans::Blocks { offsets, ends });
    let xq = match pre {
        Some(q) => q,
        None => quantize(g, x, cap, live, &mut b.x)?,
    };
    let at = ((Layout::Psum, sms), live, ends);
    ffn(g, w, at, decode, cap, weights, (xq, &mut b.act), gu, x)?;
    Ok(())
}

/// The routed experts over fixed strides (`ExpertRows::Strided`): DeepGEMM's masked layout (or
/// decode's own GEMM, `decode`), over the rows quantized here, or as the exchange quantized them
/// (`pre`); combine weighs.
#[allow(clippy::too_many_arguments)]
pub fn strided(
    g: &Gpu,
    w: (&Fp8Weights, &Fp8Weights),
    (stride, counts, pre): (usize, &CudaSlice<i32>, Option<&Fp8Rows>),
    (mean_rows, decode): (usize, bool),
    b: &mut Fp8Bufs,
    gu: &mut CudaSlice<bf16>,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let layout = Layout::Masked { stride, mean_rows };
    let live = Live::Masked { counts, stride };
    let decode = decode.then_some(Spans::Strided { stride, counts });
    let rows = w.0.groups * stride;
    let xq = match pre {
        Some(q) => q,
        None => quantize(g, x, rows, live, &mut b.x)?,
    };
    let at = ((layout, Sms::All), live, counts);
    ffn(g, w, at, decode, rows, None, (xq, &mut b.act), gu, x)?;
    Ok(())
}

/// The shared expert over the bucket's `n` home rows (`xb`) into `y`, on `s` and `sms`: one psum
/// block from row 0 (`ends`, `Gpu::psum_ends` from a zero offset).
#[allow(clippy::too_many_arguments)]
pub fn shared(
    g: &Gpu,
    s: &CudaStream,
    w: (&Fp8Weights, &Fp8Weights),
    (bucket, sms): (usize, Sms),
    (xb, n): (&CudaSlice<bf16>, &CudaSlice<i32>),
    ends: &CudaSlice<i32>,
    b: &mut Fp8Bufs,
    gu: &mut CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (xq, aq) = (&mut b.shared_x, &mut b.shared_act);
    let (live, psum) = (Live::Upto(n), (Layout::Psum, sms));
    g.fp8.quantize(xb, bucket, live, xq, s)?;
    g.fp8.gemm(xq, bucket, w.0, psum, ends, gu, s)?;
    g.fp8.swiglu_quantize(gu, bucket, live, None, aq, s)?;
    g.fp8.gemm(aq, bucket, w.1, psum, ends, y, s)?;
    Ok(())
}
