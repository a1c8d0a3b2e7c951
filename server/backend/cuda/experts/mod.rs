//! The experts' FFN on the device: their weights (`DeviceFfn`), which kernels run them, chosen
//! once per (bucket, row format) for the shape's expert dtype and kept (`Choices`), and those
//! kernels run over the rows where the exchange put them (`routed`) or over the home rows (the
//! shared expert, `shared`). The choices follow measurements: docs/benchmarks.md ("Where the
//! decode GEMM stops paying", the shared expert on cuBLAS at decode).

pub(super) mod fp8;
mod oracle;

use oracle::mean_rows;
pub use oracle::{Choices, Routed, Shared};

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError};
use half::bf16;

use crate::backend::cuda::exchange::ExpertRows;
use crate::backend::cuda::kernels::decode_gemm::Out;
use crate::backend::cuda::kernels::fp8::Fp8Weights;
use crate::backend::cuda::kernels::hopper::{Gemm, Layout, Sms};
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::{max_tiles, Alloc, Blocks, Gpu, GpuError};
use crate::model::fp8::BLOCK;
use crate::model::{ExpertDtype, Ffn, Matrix};
use fp8::Fp8Bufs;

/// A grouped SwiGLU FFN's weights on the device: gate/up `[groups][2 * inter][hidden]` and down
/// `[groups][hidden][inter]`, in bf16 or in FP8 with their 128x128 block scales.
pub enum DeviceFfn {
    Bf16 {
        gate_up: CudaSlice<bf16>,
        down: CudaSlice<bf16>,
    },
    Fp8 {
        gate_up: Fp8Weights,
        down: Fp8Weights,
    },
}

impl DeviceFfn {
    pub fn bytes(&self) -> usize {
        match self {
            DeviceFfn::Bf16 { gate_up, down } => (gate_up.len() + down.len()) * 2,
            DeviceFfn::Fp8 { gate_up, down } => gate_up.bytes() + down.bytes(),
        }
    }

    /// `ffns` (`groups` of intermediate size `inter`) uploaded in `dtype`.
    pub fn upload<'a>(
        a: &mut Alloc,
        ffns: impl ExactSizeIterator<Item = &'a Ffn> + Clone,
        (hidden, inter): (usize, usize),
        dtype: ExpertDtype,
    ) -> Result<Self, DriverError> {
        Ok(match dtype {
            ExpertDtype::Bf16 => DeviceFfn::Bf16 {
                gate_up: a.upload(&to_bf16(ffns.clone().map(|f| &f.gate_up)))?,
                down: a.upload(&to_bf16(ffns.map(|f| &f.down)))?,
            },
            ExpertDtype::Fp8 => {
                let (gate_up, down) = fp8::upload(a, ffns, hidden, inter)?;
                DeviceFfn::Fp8 { gate_up, down }
            }
        })
    }

    /// One FFN written over this one-group FFN (a staged slot kept from an earlier placement),
    /// on `stream`.
    pub fn upload_into(
        &mut self,
        f: &Ffn,
        (hidden, inter): (usize, usize),
        stream: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        match self {
            DeviceFfn::Bf16 { gate_up, down } => {
                for (w, m) in [(gate_up, &f.gate_up), (down, &f.down)] {
                    let host = to_bf16(std::iter::once(m));
                    assert_eq!(host.len(), w.len(), "an FFN of another shape than its slot");
                    stream.memcpy_htod(&host, w)?;
                }
                Ok(())
            }
            DeviceFfn::Fp8 { gate_up, down } => {
                fp8::upload_into((gate_up, down), f, hidden, inter, stream)
            }
        }
    }

    /// Overwrites group `j` with `from`'s one group, on `stream` (a slot a new placement
    /// rewrites: the step's graphs read it where it is).
    pub fn write_group(
        &mut self,
        j: usize,
        from: &DeviceFfn,
        stream: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        group_between(from, 0, self, j, stream)
    }

    /// One group of zeros in `dtype`: the spare slot a cycle of slot copies goes through.
    pub fn one_group(
        a: &mut Alloc,
        (hidden, inter): (usize, usize),
        dtype: ExpertDtype,
    ) -> Result<Self, DriverError> {
        Ok(match dtype {
            ExpertDtype::Bf16 => DeviceFfn::Bf16 {
                gate_up: a.zeros::<bf16>(2 * inter * hidden)?,
                down: a.zeros::<bf16>(hidden * inter)?,
            },
            ExpertDtype::Fp8 => {
                let mut one = |n: usize, k: usize| -> Result<Fp8Weights, DriverError> {
                    let q = a.zeros::<u8>(n * k)?;
                    let sf = a.zeros::<f32>((n / BLOCK) * (k / BLOCK))?;
                    Ok(Fp8Weights::new(q, sf, 1, n, k))
                };
                DeviceFfn::Fp8 {
                    gate_up: one(2 * inter, hidden)?,
                    down: one(hidden, inter)?,
                }
            }
        })
    }

    /// Group `from`'s weights over group `to` of this `groups`-group FFN (a slot of a layer
    /// taking another slot's expert), on `stream`.
    pub fn copy_group(
        &mut self,
        (from, to): (usize, usize),
        groups: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        fn within<T: DeviceRepr>(
            w: &mut CudaSlice<T>,
            (from, to): (usize, usize),
            groups: usize,
            s: &Arc<CudaStream>,
        ) -> Result<(), DriverError> {
            let n = w.len() / groups;
            assert!(
                from != to && from.max(to) < groups && n * groups == w.len(),
                "groups {from} -> {to} of {groups}"
            );
            // Two views of one buffer: the later group's split from the earlier one's.
            let (mut lo, mut hi) = w.split_at_mut(from.max(to) * n);
            match from < to {
                true => s.memcpy_dtod(&lo.slice(from * n..(from + 1) * n), &mut hi.slice_mut(..n)),
                false => s.memcpy_dtod(&hi.slice(..n), &mut lo.slice_mut(to * n..(to + 1) * n)),
            }
        }
        match self {
            DeviceFfn::Bf16 { gate_up, down } => {
                within(gate_up, (from, to), groups, stream)?;
                within(down, (from, to), groups, stream)
            }
            DeviceFfn::Fp8 { gate_up, down } => {
                for w in [gate_up, down] {
                    within(&mut w.q, (from, to), groups, stream)?;
                    within(&mut w.sf, (from, to), groups, stream)?;
                }
                Ok(())
            }
        }
    }

    /// Group `j`'s weights into `into` (one group), on `stream`.
    pub fn read_group(
        &self,
        j: usize,
        into: &mut DeviceFfn,
        stream: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        group_between(self, j, into, 0, stream)
    }

    /// Random weights made on the GPU (`epserve bench`: timing, not numerics).
    pub fn random(
        g: &Gpu,
        a: &mut Alloc,
        (groups, hidden, inter): (usize, usize, usize),
        seed: u64,
        dtype: ExpertDtype,
    ) -> Result<Self, DriverError> {
        Ok(match dtype {
            ExpertDtype::Bf16 => {
                let mut gate_up = a.zeros::<bf16>(groups * 2 * inter * hidden)?;
                let mut down = a.zeros::<bf16>(groups * hidden * inter)?;
                g.fill_uniform_bf16(&mut gate_up, seed, (3.0 / hidden as f32).sqrt())?;
                g.fill_uniform_bf16(&mut down, seed + 1, (3.0 / inter as f32).sqrt())?;
                DeviceFfn::Bf16 { gate_up, down }
            }
            ExpertDtype::Fp8 => {
                let (gate_up, down) = fp8::random(g, a, (groups, hidden, inter), seed)?;
                DeviceFfn::Fp8 { gate_up, down }
            }
        })
    }
}

/// Group `sj` of `src` over group `dj` of `dst`, one of which holds one group (its size is the
/// group's), on `stream`.
fn group_between(
    src: &DeviceFfn,
    sj: usize,
    dst: &mut DeviceFfn,
    dj: usize,
    stream: &Arc<CudaStream>,
) -> Result<(), DriverError> {
    fn copy<T: DeviceRepr>(
        (src, sj): (&CudaSlice<T>, usize),
        (dst, dj): (&mut CudaSlice<T>, usize),
        s: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        let n = src.len().min(dst.len());
        assert!(
            (sj + 1) * n <= src.len() && (dj + 1) * n <= dst.len(),
            "group {sj} -> {dj} outside the weights"
        );
        s.memcpy_dtod(
            &src.slice(sj * n..(sj + 1) * n),
            &mut dst.slice_mut(dj * n..(dj + 1) * n),
        )
    }
    match (src, dst) {
        (
            DeviceFfn::Bf16 { gate_up, down },
            DeviceFfn::Bf16 {
                gate_up: g,
                down: d,
            },
        ) => {
            copy((gate_up, sj), (g, dj), stream)?;
            copy((down, sj), (d, dj), stream)
        }
        (
            DeviceFfn::Fp8 { gate_up, down },
            DeviceFfn::Fp8 {
                gate_up: g,
                down: d,
            },
        ) => {
            for (w, f) in [(gate_up, g), (down, d)] {
                copy((&w.q, sj), (&mut f.q, dj), stream)?;
                copy((&w.sf, sj), (&mut f.sf, dj), stream)?;
            }
            Ok(())
        }
        _ => panic!("a slot's weights in another dtype than the layer's"),
    }
}

/// The matrices' values as bf16, one after another; each matrix converted on its own thread of
/// the load pool (rayon's global one: on 2x H100 the serial loop was 12 of a synthetic
/// DeepSeek-V3 layer's 16 s to serve, docs/benchmarks.md "Load").
fn to_bf16<'a>(parts: impl Iterator<Item = &'a Matrix>) -> Vec<bf16> {
    use rayon::prelude::*;
    let parts: Vec<_> = parts.map(|m| m.values()).collect();
    let mut out = vec![bf16::ZERO; parts.iter().map(|p| p.len()).sum()];
    let mut pieces = Vec::with_capacity(parts.len());
    let mut rest = &mut out[..];
    for p in &parts {
        let (piece, tail) = rest.split_at_mut(p.len());
        pieces.push(piece);
        rest = tail;
    }
    pieces.into_par_iter().zip(&parts).for_each(|(o, p)| {
        o.iter_mut()
            .zip(p.iter())
            .for_each(|(o, &v)| *o = bf16::from_f32(v))
    });
    out
}

/// The FFN's scratch rows in the step's buffers: gate/up, activation, the WMMA kernels' tiles,
/// and the FP8 experts' quantized rows.
pub struct Scratch<'a> {
    pub gu: &'a mut CudaSlice<bf16>,
    pub act: &'a mut CudaSlice<bf16>,
    pub tiles: &'a mut CudaSlice<i32>,
    pub n_tiles: &'a mut CudaSlice<i32>,
    pub fp8: Option<&'a mut Fp8Bufs>,
}

/// The routed experts `w` over `rows`, on `kernels` and `sms`; each row's output overwrites it.
pub fn routed(
    g: &Gpu,
    s: &StepShape,
    (kernels, bucket, sms): (Routed, usize, Sms),
    w: &DeviceFfn,
    rows: ExpertRows,
    sc: Scratch,
) -> Result<(), GpuError> {
    let mean_rows = mean_rows(s, bucket);
    let format = rows.format();
    let Scratch {
        gu,
        act,
        tiles,
        n_tiles,
        fp8,
    } = sc;
    let (gate_up, down) = match (w, kernels, fp8) {
        (DeviceFfn::Fp8 { gate_up, down }, Routed::Fp8 { decode }, Some(b)) => {
            let w = (gate_up, down);
            return match rows {
                ExpertRows::Blocks {
                    x,
                    cap,
                    offsets,
                    ends,
                    weights,
                    fp8,
                    ..
                } => {
                    let at = (offsets, ends);
                    fp8::contiguous(g, w, (cap, fp8), at, (decode, sms), weights, b, gu, x)
                }
                ExpertRows::Strided {
                    x,
                    stride,
                    counts,
                    fp8,
                    ..
                } => fp8::strided(g, w, (stride, counts, fp8), (mean_rows, decode), b, gu, x),
            };
        }
        (DeviceFfn::Bf16 { gate_up, down }, k, _) if !matches!(k, Routed::Fp8 { .. }) => {
            (gate_up, down)
        }
        _ => {
            return Err(GpuError::Config(format!(
                "no {kernels:?} for these experts over {format:?} rows"
            )))
        }
    };
    let w = FfnWeights {
        gate_up,
        down,
        groups: s.local(),
        inter: s.inter,
    };
    let scratch = (tiles, n_tiles, gu, act);
    match (kernels, rows) {
        (
            Routed::Psum | Routed::BlockTiles,
            ExpertRows::Blocks {
                x,
                cap,
                offsets,
                ends,
                total,
                weights,
                fp8: None,
            },
        ) => {
            let blocks = Contiguous {
                offsets,
                ends,
                rows: total,
                weights,
            };
            let hopper = kernels == Routed::Psum;
            contiguous_ffn(g, w, blocks, (cap, hopper, sms), s.hidden, scratch, x)
        }
        (
            Routed::Decode | Routed::Masked | Routed::StrideTiles,
            ExpertRows::Strided {
                x,
                stride,
                counts,
                bounds,
                valid,
                fp8: None,
            },
        ) => {
            let rows = Strided {
                stride,
                counts,
                bounds,
                valid,
                mean_rows,
            };
            strided_ffn(g, w, rows, kernels, s.hidden, scratch, x)
        }
        _ => Err(GpuError::Config(format!(
            "no {kernels:?} for bf16 experts over {format:?} rows (or FP8 rows)"
        ))),
    }
}

/// Contiguous expert-major blocks on the device: expert e's rows start at `offsets[e]` (a
/// multiple of `hopper::ALIGN`) and end at `ends[e]`; `rows` is the padded total. `weights`:
/// each row's routing weight, to scale its output by.
struct Contiguous<'a> {
    offsets: &'a CudaSlice<i32>,
    ends: &'a CudaSlice<i32>,
    rows: &'a CudaSlice<i32>,
    weights: Option<&'a CudaSlice<f32>>,
}

/// A grouped SwiGLU FFN's weights: `groups` experts of intermediate size `inter`.
struct FfnWeights<'a> {
    /// `[groups][2 * inter][hidden]`.
    gate_up: &'a CudaSlice<bf16>,
    /// `[groups][hidden][inter]`.
    down: &'a CudaSlice<bf16>,
    groups: usize,
    inter: usize,
}

/// The WMMA kernels' tile lists, then the gate/up and activation rows.
type Tiles<'a> = (
    &'a mut CudaSlice<i32>,
    &'a mut CudaSlice<i32>,
    &'a mut CudaSlice<bf16>,
    &'a mut CudaSlice<bf16>,
);

/// The FFN over contiguous blocks of at most `rows` rows, in place on `x`: gate/up, SwiGLU,
/// down, on the Hopper GEMM (`hopper`, on `sms`) or the WMMA kernels. A row's weight scales its
/// activation (the down projection is linear), or its output on the WMMA path.
fn contiguous_ffn(
    g: &Gpu,
    w: FfnWeights,
    b: Contiguous,
    (rows, hopper, sms): (usize, bool, Sms),
    h: usize,
    (tiles, n_tiles, gu, act): Tiles,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (i, groups) = (w.inter, w.groups);
    let psum = Layout::Psum;
    if hopper {
        let up = Gemm {
            x,
            rows,
            w: w.gate_up,
            groups,
            n: 2 * i,
            k: h,
            layout: psum,
            sms,
            sizes: b.ends,
        };
        g.hopper.gemm(up, gu, &g.stream)?;
        g.swiglu(gu, b.rows, rows, i, b.weights, act)?;
        let down = Gemm {
            x: act,
            rows,
            w: w.down,
            groups,
            n: h,
            k: i,
            layout: psum,
            sms,
            sizes: b.ends,
        };
        g.hopper.gemm(down, x, &g.stream)?;
        return Ok(());
    }
    let blocks = Blocks::Offsets(b.offsets);
    g.grouped_gemm(
        x,
        w.gate_up,
        blocks,
        groups,
        rows,
        2 * i,
        h,
        tiles,
        n_tiles,
        gu,
    )?;
    g.swiglu(gu, b.rows, rows, i, None, act)?;
    g.grouped_gemm(act, w.down, blocks, groups, rows, h, i, tiles, n_tiles, x)?;
    if let Some(wt) = b.weights {
        g.scale_rows(x, wt, b.rows, rows, h)?;
    }
    Ok(())
}

/// Fixed-stride expert rows: expert e's `counts[e]` rows start at `e * stride`; `bounds` are the
/// same blocks for the WMMA kernels, `valid` the most rows in all, `mean_rows` what an expert
/// gets on average. Combine weighs the outputs.
struct Strided<'a> {
    stride: usize,
    counts: &'a CudaSlice<i32>,
    bounds: &'a CudaSlice<i32>,
    valid: usize,
    mean_rows: usize,
}

/// The FFN over fixed-stride expert rows, in place on `x`, on `kernels`: decode's own GEMM
/// (SwiGLU in its gate/up pass), DeepGEMM's masked layout, or the WMMA kernels over the same
/// blocks.
fn strided_ffn(
    g: &Gpu,
    w: FfnWeights,
    r: Strided,
    kernels: Routed,
    h: usize,
    (tiles, n_tiles, gu, act): Tiles,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (i, groups) = (w.inter, w.groups);
    let masked = Layout::Masked {
        stride: r.stride,
        mean_rows: r.mean_rows,
    };
    let decode = kernels == Routed::Decode;
    if kernels != Routed::StrideTiles {
        let span = groups * r.stride;
        let up = Gemm {
            x,
            rows: span,
            w: w.gate_up,
            groups,
            n: 2 * i,
            k: h,
            layout: masked,
            sms: Sms::All,
            sizes: r.counts,
        };
        if decode {
            g.decode.gemm(up, Out::SwiGlu, act)?;
        } else {
            g.hopper.gemm(up, gu, &g.stream)?;
            g.swiglu_masked(gu, r.counts, groups, r.stride, i, act)?;
        }
        let down = Gemm {
            x: act,
            rows: span,
            w: w.down,
            groups,
            n: h,
            k: i,
            layout: masked,
            sms: Sms::All,
            sizes: r.counts,
        };
        match decode {
            true => g.decode.gemm(down, Out::Plain, x)?,
            false => g.hopper.gemm(down, x, &g.stream)?,
        }
        return Ok(());
    }
    let blocks = Blocks::Bounds(r.bounds);
    let (rows, tiles_cap) = (r.valid, max_tiles(r.valid, groups));
    g.grouped_gemm(
        x,
        w.gate_up,
        blocks,
        groups,
        rows,
        2 * i,
        h,
        tiles,
        n_tiles,
        gu,
    )?;
    g.swiglu_tiles(gu, tiles, n_tiles, r.bounds, groups, tiles_cap, i, act)?;
    g.grouped_gemm(act, w.down, blocks, groups, rows, h, i, tiles, n_tiles, x)?;
    Ok(())
}

/// The shared expert's rows in the step's buffers: its FP8 rows (FP8 experts), the bucket's
/// bf16 home rows `xb` (`n` of them), a zero and the psum ends made from it (one block from row
/// 0), gate/up, activation, and the output `y`.
pub struct SharedRows<'a> {
    pub fp8: Option<&'a mut Fp8Bufs>,
    pub xb: &'a CudaSlice<bf16>,
    pub n: &'a CudaSlice<i32>,
    pub zero: &'a CudaSlice<i32>,
    pub ends: &'a mut CudaSlice<i32>,
    pub gu: &'a mut CudaSlice<bf16>,
    pub act: &'a mut CudaSlice<bf16>,
    pub y: &'a mut CudaSlice<bf16>,
}

/// The shared expert `w` over the bucket's home rows into `r.y`, on `kernels` and `sms`.
pub fn shared(
    g: &Gpu,
    w: &DeviceFfn,
    r: SharedRows,
    s: &StepShape,
    (kernels, bucket, sms): (Shared, usize, Sms),
) -> Result<(), GpuError> {
    let (h, i) = (s.hidden, s.shared_inter);
    match (kernels, w, r.fp8) {
        (Shared::Fp8, DeviceFfn::Fp8 { gate_up, down }, Some(f)) => {
            g.psum_ends(r.zero, r.n, r.ends)?;
            let (w, at) = ((gate_up, down), (bucket, sms));
            fp8::shared(g, &g.stream, w, at, (r.xb, r.n), r.ends, f, r.gu, r.y)
        }
        (Shared::Dense, DeviceFfn::Bf16 { gate_up, down }, _) => {
            g.gemm_bf16(gate_up, r.xb, (bucket, 2 * i, h), r.gu)?;
            g.swiglu(r.gu, r.n, bucket, i, None, r.act)?;
            g.gemm_bf16(down, r.act, (bucket, h, i), r.y)
        }
        (Shared::Psum, DeviceFfn::Bf16 { gate_up, down }, _) => {
            g.psum_ends(r.zero, r.n, r.ends)?;
            let ends = &*r.ends;
            let gemm = |x, w, n, k| Gemm {
                x,
                rows: bucket,
                w,
                groups: 1,
                n,
                k,
                layout: Layout::Psum,
                sms,
                sizes: ends,
            };
            g.hopper
                .gemm(gemm(r.xb, gate_up, 2 * i, h), r.gu, &g.stream)?;
            g.swiglu(r.gu, r.n, bucket, i, None, r.act)?;
            g.hopper.gemm(gemm(r.act, down, h, i), r.y, &g.stream)?;
            Ok(())
        }
        _ => Err(GpuError::Config(format!(
            "no {kernels:?} for this shared expert (or its FP8 buffers)"
        ))),
    }
}
