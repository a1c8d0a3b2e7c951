//! Element types on the wire and in the step ring, and the row conversions between them. Hidden
//! states stay in the dtype the client sent from its request's bytes to the ranks, and outputs
//! leave in the dtype it asked for; each side converts to and from f32 once, where it computes.

use serde::{Deserialize, Serialize};

/// The element types a request may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
    I32,
    I64,
}

pub const FLOATS: &[Dtype] = &[Dtype::Bf16, Dtype::F16, Dtype::F32];
pub const IDS: &[Dtype] = &[Dtype::I32, Dtype::I64];

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        FLOATS.contains(&self)
    }
}

/// Index of the first NaN or infinity among little-endian floats of `d` (a float dtype), read
/// from their bits without converting them.
pub fn first_non_finite(d: Dtype, data: &[u8]) -> Option<usize> {
    match d {
        Dtype::F32 => first_of::<4>(data, |b| u32::from_le_bytes(b) & 0x7f80_0000 == 0x7f80_0000),
        Dtype::Bf16 => first_of::<2>(data, |b| u16::from_le_bytes(b) & 0x7f80 == 0x7f80),
        Dtype::F16 => first_of::<2>(data, |b| u16::from_le_bytes(b) & 0x7c00 == 0x7c00),
        Dtype::I32 | Dtype::I64 => None,
    }
}

/// The first `N`-byte value that is `bad`. Each block of values is checked whole, with no early
/// exit, which the compiler vectorizes, and searched only when it holds one: a value-by-value
/// search was a fifth of the leader's CPU at 2048-token requests (~1.7 ms per 8 MB).
fn first_of<const N: usize>(data: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
    const BLOCK: usize = 256;
    let value = |b: &[u8]| -> [u8; N] { b.try_into().expect("chunks of N bytes") };
    for (i, block) in data.chunks(BLOCK * N).enumerate() {
        let any = block
            .chunks_exact(N)
            .fold(0u8, |a, b| a | u8::from(bad(value(b))));
        if any != 0 {
            let j = block.chunks_exact(N).position(|b| bad(value(b)));
            return j.map(|j| i * BLOCK + j);
        }
    }
    None
}

/// `src`, little-endian floats of `d`, widened into `dst` (as many values as `dst` holds).
pub fn to_f32(d: Dtype, src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * d.bytes(), "to_f32 lengths");
    match d {
        Dtype::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::Bf16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        Dtype::F16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Dtype::I32 | Dtype::I64 => panic!("to_f32 of {d:?}"),
    }
}

/// `src` as little-endian floats of `d` into `dst`, rounding to nearest even.
pub fn from_f32(d: Dtype, src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * d.bytes(), "from_f32 lengths");
    match d {
        Dtype::F32 => {
            for (b, v) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        Dtype::I32 | Dtype::I64 => panic!("from_f32 to {d:?}"),
    }
}

/// f32 values as a new buffer of little-endian `d`.
pub fn encode(values: &[f32], d: Dtype) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * d.bytes()];
    from_f32(d, values, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn conversions_match_the_half_crate_and_find_every_non_finite_value() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let vals: Vec<f32> = (0..4096)
            .map(|i| match i % 97 {
                0 => f32::from_bits(rng.random()), // any bit pattern, NaNs included
                _ => rng.random_range(-70000.0f32..70000.0) * rng.random::<f32>().powi(8),
            })
            .collect();
        for d in FLOATS {
            let enc = encode(&vals, *d);
            let mut back = vec![0f32; vals.len()];
            to_f32(*d, &enc, &mut back);
            for (i, (&v, &b)) in vals.iter().zip(&back).enumerate() {
                let want = match d {
                    Dtype::Bf16 => half::bf16::from_f32(v).to_f32(),
                    Dtype::F16 => half::f16::from_f32(v).to_f32(),
                    _ => v,
                };
                assert!(
                    want.to_bits() == b.to_bits() || (want.is_nan() && b.is_nan()),
                    "{d:?} value {i}: {v} -> {b}, want {want}"
                );
            }
            let first = back.iter().position(|x| !x.is_finite());
            assert_eq!(first_non_finite(*d, &enc), first, "{d:?}");
            let mut one_bad = encode(&[1.0, 2.0, 3.0], *d);
            let inf = encode(&[f32::INFINITY], *d);
            one_bad[d.bytes()..2 * d.bytes()].copy_from_slice(&inf);
            assert_eq!(first_non_finite(*d, &one_bad), Some(1), "{d:?}");
        }
    }

    /// The blockwise search against a value-by-value one: one NaN or infinity at every place
    /// around the block edges, and at random places in longer rows, with a second one behind it.
    #[test]
    fn the_first_non_finite_value_is_found_wherever_it_is() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for d in FLOATS {
            let n = 3 * 256 + 17;
            let vals: Vec<f32> = (0..n).map(|_| rng.random_range(-1e4f32..1e4)).collect();
            let clean = encode(&vals, *d);
            assert_eq!(first_non_finite(*d, &clean), None, "{d:?}");
            let mut places: Vec<usize> = (0..n)
                .filter(|i| i % 256 < 2 || i % 256 > 253 || i + 2 > n)
                .collect();
            places.extend((0..64).map(|_| rng.random_range(0..n)));
            for (k, at) in places.into_iter().enumerate() {
                let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][k % 3];
                let mut v = vals.clone();
                v[at] = bad;
                if at + 300 < n {
                    v[at + 300] = f32::NAN;
                }
                let enc = encode(&v, *d);
                let want = v.iter().position(|x| !x.is_finite());
                assert_eq!(want, Some(at));
                assert_eq!(first_non_finite(*d, &enc), want, "{d:?} at {at}: {bad}");
            }
        }
    }
}
