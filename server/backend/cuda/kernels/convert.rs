//! Launchers of convert.cuh's kernels: rows between f32, bf16 and f16, and the bench's random fills.

use cudarc::driver::{CudaSlice, DriverError, PushKernelArg};
use half::bf16;

use crate::backend::cuda::Gpu;

impl Gpu {
    pub fn f32_to_bf16(
        &self,
        x: &CudaSlice<f32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        h: usize,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let h32 = h as i32;
        let mut b = self.stream.launch_builder(&self.k.f32_to_bf16);
        b.arg(x).arg(n).arg(&h32).arg(y);
        // SAFETY: both buffers hold n_cap rows of h.
        unsafe { b.launch(Self::cfg(((n_cap * h).div_ceil(256) as u32, 1), 256, 0)) }.map(drop)
    }

    /// `x[..n * h]` from 16-bit rows `src` (bf16, or f16 when `f16`).
    pub fn widen_rows(
        &self,
        src: &CudaSlice<bf16>,
        f16: bool,
        n: usize,
        h: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        assert!(n * h <= src.len() && n * h <= x.len(), "widen_rows bounds");
        let (f, n32, h32) = (i32::from(f16), n as i32, h as i32);
        let mut b = self.stream.launch_builder(&self.k.widen_rows);
        b.arg(src).arg(&f).arg(&n32).arg(&h32).arg(x);
        // SAFETY: both buffers hold at least n rows of h (asserted); the grid-stride loop stays
        // below n * h.
        unsafe { b.launch(Self::rows_cfg(n * h)) }.map(drop)
    }

    /// 16-bit rows `out[..n * h]` (bf16, or f16 when `f16`) from `x`, rounded to nearest even.
    pub fn narrow_rows(
        &self,
        x: &CudaSlice<f32>,
        f16: bool,
        n: usize,
        h: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(n * h <= x.len() && n * h <= out.len(), "narrow_rows bounds");
        let (f, n32, h32) = (i32::from(f16), n as i32, h as i32);
        let mut b = self.stream.launch_builder(&self.k.narrow_rows);
        b.arg(x).arg(&f).arg(&n32).arg(&h32).arg(out);
        // SAFETY: as in `widen_rows`.
        unsafe { b.launch(Self::rows_cfg(n * h)) }.map(drop)
    }

    /// `out[t] = x[t] (+ shared[t])` in f32 for t < *n, over `n_cap` rows of `h`.
    pub fn widen_add(
        &self,
        x: &CudaSlice<bf16>,
        shared: Option<&CudaSlice<bf16>>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        h: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        assert!(h % 8 == 0, "widen_add takes rows of 8-column steps");
        let (h32, null) = (h as i32, 0u64);
        let mut b = self.stream.launch_builder(&self.k.widen_add);
        b.arg(x);
        match shared {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(n).arg(&h32).arg(out);
        let cols = h.div_ceil(8 * 256) as u32;
        // SAFETY: x, shared and out hold n_cap rows of h (h % 8 == 0: every 16-byte step is in
        // the row and aligned); a null `shared` is a zero pointer.
        unsafe { b.launch(Self::cfg((n_cap as u32, cols), 256, 0)) }.map(drop)
    }

    /// `x[i] = scale * U[-1, 1)` from (seed, i): benchmark weights made on the GPU.
    pub fn fill_uniform_bf16(
        &self,
        x: &mut CudaSlice<bf16>,
        seed: u64,
        scale: f32,
    ) -> Result<(), DriverError> {
        let n = x.len();
        let mut b = self.stream.launch_builder(&self.k.fill_uniform_bf16);
        b.arg(x).arg(&n).arg(&seed).arg(&scale);
        // SAFETY: a grid-stride loop over the buffer's n elements.
        unsafe { b.launch(Self::cfg((1024, 1), 256, 0)) }.map(drop)
    }

    pub fn fill_uniform_f32(
        &self,
        x: &mut CudaSlice<f32>,
        seed: u64,
        scale: f32,
    ) -> Result<(), DriverError> {
        let n = x.len();
        let mut b = self.stream.launch_builder(&self.k.fill_uniform_f32);
        b.arg(x).arg(&n).arg(&seed).arg(&scale);
        // SAFETY: as in `fill_uniform_bf16`.
        unsafe { b.launch(Self::cfg((1024, 1), 256, 0)) }.map(drop)
    }
}
