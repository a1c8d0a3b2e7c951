//! FP8 experts as DeepSeek-V3 ships them: OCP E4M3FN values with one f32 scale per 128x128
//! weight block (`dequantized = q * scale`), and activations quantized per token per 128
//! channels (`s = amax / 448`, `q = e4m3(x / s)`, round to nearest even). The rule is written
//! once here; the CPU backend, the loader and the GPU's kernels (`kernels/fp8.cu`) follow it.
//!
//! Where the activations are bf16, as in DeepSeek-V3's own inference: an expert's input rows
//! are bf16 (they cross the exchange so), and so are the gate/up GEMM's outputs; SwiGLU runs in
//! f32 on those and is quantized as it comes (`bf16` rounds a value as those steps do).

/// Rows and columns of one weight block; channels of one activation group.
pub const BLOCK: usize = 128;
/// The largest finite E4M3FN value.
pub const MAX: f32 = 448.0;

/// OCP FP8 E4M3FN (no infinities; 0x7F/0xFF are NaN).
pub fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xF);
    let man = f32::from(b & 0x7);
    if b & 0x7F == 0x7F {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * 2f32.powi(-9)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// `x` rounded to the nearest E4M3FN value, ties to the even mantissa; beyond ±448 saturates
/// (the recipe's scales keep |x| <= 448, so only rounding of the scale itself gets there); NaN
/// stays NaN. Plain float and bit arithmetic: `powi` and `round_ties_even` were library calls
/// here (x86-64 without SSE4.1), 20 ns a weight, and a synthetic FP8 expert of Qwen3 took 97 ms.
pub fn encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7F;
    }
    if a < MIN_NORMAL {
        // Subnormals step by 2^-9; 8 steps is the smallest normal, whose code is 8 as well.
        return sign | nearest_even(a * 512.0) as u8;
    }
    if a >= MAX {
        return sign | 0x7E;
    }
    // a = 2^e * (m / 8) with m in [8, 16) (a is a normal f32 here, so e is its exponent
    // field); scaling by a power of two (3 - e in [-5, 9], built from its bits) is exact.
    let e = ((a.to_bits() >> 23) as i32 - 127).clamp(-6, 8);
    let m = nearest_even(a * f32::from_bits(((130 - e) as u32) << 23));
    let (e, m) = if m == 16 { (e + 1, 8) } else { (e, m) };
    let code = (((e + 7) as u32) << 3 | (m - 8)).min(0x7E);
    sign | code as u8
}

/// The smallest normal E4M3FN magnitude, 2^-6.
const MIN_NORMAL: f32 = 0.015625;

/// `y` (0 <= y <= 16 here) rounded to an integer, ties to even: past 2^23 an f32 has no
/// fraction bits, and the addition rounds to nearest even, as IEEE arithmetic always does.
fn nearest_even(y: f32) -> u32 {
    const TWO_23: f32 = 8_388_608.0;
    ((y + TWO_23) - TWO_23) as u32
}

/// `x` rounded to bf16 (nearest even), as the recipe's bf16 activations hold it.
pub fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// The scale of a group whose largest magnitude is `amax`: values divided by it span ±448. A
/// group of zeros, or of values too small for a normal scale, gets 0 (its values quantize to 0).
pub fn scale_of(amax: f32) -> f32 {
    let s = amax / MAX;
    if s.is_normal() {
        s
    } else {
        0.0
    }
}

/// Quantizes `x` in groups of `BLOCK` channels and writes the dequantized values (`q * s`,
/// exact in f64) to `out`: what the FP8 GEMM sees of an activation row.
pub fn quantize_row(x: &[f32], out: &mut [f64]) {
    for (g, o) in x.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
        let s = scale_of(g.iter().fold(0f32, |m, v| m.max(v.abs())));
        if s == 0.0 {
            o.fill(0.0);
            continue;
        }
        for (o, &v) in o.iter_mut().zip(g) {
            *o = f64::from(decode(encode(v / s))) * f64::from(s);
        }
    }
}

/// A `[rows, cols]` weight matrix as FP8 bytes with one f32 scale per `BLOCK x BLOCK` block
/// (`scales` is `[rows / BLOCK][cols / BLOCK]`, rows and columns multiples of `BLOCK`).
#[derive(Clone, Debug, PartialEq)]
pub struct Blocks {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Blocks {
    /// Quantizes `v` (`[rows, cols]`, row-major) block by block: scale = block amax / 448.
    pub fn quantize(v: &[f32], rows: usize, cols: usize) -> Self {
        assert!(
            rows % BLOCK == 0 && cols % BLOCK == 0 && v.len() == rows * cols,
            "FP8 blocks need [{rows}, {cols}] in multiples of {BLOCK} and {} values",
            rows * cols
        );
        let bc = cols / BLOCK;
        let mut scales = vec![0f32; rows / BLOCK * bc];
        for (r, row) in v.chunks_exact(cols).enumerate() {
            for (b, g) in row.chunks_exact(BLOCK).enumerate() {
                let s = &mut scales[(r / BLOCK) * bc + b];
                *s = g.iter().fold(*s, |m, x| m.max(x.abs()));
            }
        }
        scales.iter_mut().for_each(|s| *s = scale_of(*s));
        let mut q = vec![0u8; v.len()];
        for (r, (row, out)) in v
            .chunks_exact(cols)
            .zip(q.chunks_exact_mut(cols))
            .enumerate()
        {
            let blocks = row.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK));
            for ((g, o), &s) in blocks.zip(&scales[(r / BLOCK) * bc..]) {
                if s != 0.0 {
                    o.iter_mut().zip(g).for_each(|(o, &x)| *o = encode(x / s));
                }
            }
        }
        Self {
            rows,
            cols,
            q,
            scales,
        }
    }

    /// `[self; other]`: rows stacked (gate over up), blocks and scales with them.
    pub fn stack(mut self, other: Blocks) -> Self {
        assert_eq!(self.cols, other.cols, "stacked FP8 blocks differ in width");
        self.rows += other.rows;
        self.q.extend_from_slice(&other.q);
        self.scales.extend_from_slice(&other.scales);
        self
    }

    pub fn scale(&self, row: usize, col: usize) -> f32 {
        self.scales[(row / BLOCK) * (self.cols / BLOCK) + col / BLOCK]
    }

    /// Rows `[BLOCK * b, BLOCK * (b + 1))` dequantized into `out` (`BLOCK * cols`), exactly.
    pub fn dequantize_block_rows(&self, b: usize, out: &mut [f64]) {
        let c = self.cols;
        let first = b * BLOCK;
        for (r, o) in out[..BLOCK * c].chunks_exact_mut(c).enumerate() {
            let row = &self.q[(first + r) * c..(first + r + 1) * c];
            let scales = &self.scales[b * (c / BLOCK)..(b + 1) * (c / BLOCK)];
            for ((o, q), &s) in o.chunks_mut(BLOCK).zip(row.chunks(BLOCK)).zip(scales) {
                for (o, &q) in o.iter_mut().zip(q) {
                    *o = f64::from(decode(q)) * f64::from(s);
                }
            }
        }
    }

    /// Every value as f32 (`q * s`), for a path that computes in another format.
    pub fn dequantize(&self) -> Vec<f32> {
        let c = self.cols;
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| decode(q) * self.scale(i / c, i % c))
            .collect()
    }

    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code, by brute force: the nearest, ties to the even code (even mantissa).
    fn nearest(x: f32) -> u8 {
        let mut best = 0u8;
        for c in 0..=0x7Eu8 {
            let (d, db) = ((decode(c) - x.abs()).abs(), (decode(best) - x.abs()).abs());
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        best | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn known_values() {
        assert_eq!(decode(0x38), 1.0); // exp 7, man 0
        assert_eq!(decode(0xB8), -1.0);
        assert_eq!(decode(0x7E), 448.0); // largest finite
        assert_eq!(decode(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(decode(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(decode(0x3C), 1.5);
        assert!(decode(0x7F).is_nan() && decode(0xFF).is_nan());
        assert_eq!(encode(1.0), 0x38);
        assert_eq!(encode(-448.0), 0xFE);
        assert_eq!(encode(1e9), 0x7E, "saturates");
        assert_eq!(encode(f32::NAN), 0x7F);
    }

    #[test]
    fn every_code_round_trips_and_encoding_is_nearest_even() {
        for c in (0..=0xFFu8).filter(|c| c & 0x7F != 0x7F) {
            assert_eq!(encode(decode(c)), c, "code {c:#04x}");
        }
        // Midpoints between neighbours (ties), and points either side of them.
        for c in 0..0x7Eu8 {
            let (a, b) = (decode(c), decode(c + 1));
            let mid = (a + b) / 2.0;
            for x in [mid, mid.next_down(), mid.next_up(), a, b] {
                for x in [x, -x] {
                    assert_eq!(encode(x), nearest(x), "x {x}");
                }
            }
        }
        let mut r = 0x1234_5678u32;
        for _ in 0..100_000 {
            r ^= r << 13;
            r ^= r >> 17;
            r ^= r << 5;
            // Exponents 2^-12 .. 2^8, any mantissa and sign.
            let x = f32::from_bits(r & 0x807F_FFFF | (115 + (r >> 23) % 21) << 23);
            if x.abs() <= MAX {
                assert_eq!(encode(x), nearest(x), "x {x}");
            }
        }
    }

    #[test]
    fn blocks_quantize_within_half_a_step_and_scale_to_448() {
        let (rows, cols) = (256, 384);
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i % 5) as f32)
            .collect();
        let b = Blocks::quantize(&v, rows, cols);
        assert_eq!(b.scales.len(), 2 * 3);
        let d = b.dequantize();
        let mut out = vec![0f64; BLOCK * cols];
        b.dequantize_block_rows(1, &mut out);
        for (i, (&x, &y)) in v.iter().zip(&d).enumerate() {
            let s = b.scale(i / cols, i % cols);
            // E4M3 has 3 mantissa bits: half a step is at most 1/16 of the value (or of the
            // smallest normal step, scaled).
            assert!(
                (x - y).abs() <= (x.abs() / 16.0).max(s * 2f32.powi(-10)) * 1.0001,
                "{i}: {x} -> {y}"
            );
            if i >= BLOCK * cols {
                // Exact in f64; the f32 value is that rounded.
                let exact = f64::from(decode(b.q[i])) * f64::from(s);
                assert_eq!(out[i - BLOCK * cols], exact);
                assert_eq!(exact as f32, y);
            }
        }
        // Each block's largest magnitude lands on 448.
        for (k, &s) in b.scales.iter().enumerate() {
            let (br, bc) = (k / 3, k % 3);
            let amax = (0..BLOCK * BLOCK)
                .map(|j| v[(br * BLOCK + j / BLOCK) * cols + bc * BLOCK + j % BLOCK].abs())
                .fold(0f32, f32::max);
            assert_eq!(s, amax / 448.0);
        }
        let zeros = Blocks::quantize(&vec![0.0; BLOCK * BLOCK], BLOCK, BLOCK);
        assert!(zeros.q.iter().all(|&q| q == 0) && zeros.scales == [0.0]);
        assert_eq!(b.bytes(), rows * cols + 24);
    }

    #[test]
    fn activation_rows_quantize_per_group_of_128() {
        let x: Vec<f32> = (0..300)
            .map(|i| if i < 128 { 0.0 } else { (i as f32).sin() * 3.0 })
            .collect();
        let mut out = vec![f64::NAN; 300];
        quantize_row(&x, &mut out);
        assert!(out[..128].iter().all(|&v| v == 0.0), "zero group");
        for g in [128..256, 256..300] {
            let amax = x[g.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 448.0;
            for i in g {
                assert_eq!(
                    out[i],
                    f64::from(decode(nearest(x[i] / s))) * f64::from(s),
                    "{i}"
                );
            }
        }
    }
}
