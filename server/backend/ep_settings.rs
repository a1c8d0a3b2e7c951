//! The `nccl-ep` backend's settings: which NCCL EP kernels a step uses (`--ep-mode`), resolved
//! against the graph buckets. The flags that choose them are `config`'s.

use clap::ValueEnum;

/// Which NCCL EP kernels a step uses.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EpMode {
    /// High-throughput kernels for every step.
    Ht,
    /// Low-latency kernels for every step (their receive buffer grows with the largest bucket).
    Ll,
    /// Low-latency for buckets up to --ep-ll-max-tokens home tokens per rank, else
    /// high-throughput.
    Auto,
}

impl EpMode {
    pub fn name(self) -> &'static str {
        match self {
            EpMode::Ht => "ht",
            EpMode::Ll => "ll",
            EpMode::Auto => "auto",
        }
    }
}

/// `--ep-ll-max-tokens`' default: auto mode runs buckets up to this many home tokens per rank
/// low-latency (`epserve bench`'s auto mode uses it too).
pub const EP_LL_MAX_TOKENS: usize = 128;

/// NCCL EP's LL combine kernel works in 512-element rows (32 lanes x 2 unrolls x 8 bf16).
pub const LL_HIDDEN_MULTIPLE: usize = 512;

/// The `nccl-ep` backend's settings, resolved against the buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpSettings {
    /// Buckets up to this many home tokens per rank run low-latency (0: none).
    pub ll_max: usize,
    /// Whether some bucket runs high-throughput (the largest is above `ll_max`).
    pub ht: bool,
    /// Receive rows in `ncclMemAlloc` memory registered as symmetric windows.
    pub zero_copy: bool,
}

impl EpSettings {
    /// `threshold` is `--ep-ll-max-tokens`; the LL group is sized for the largest bucket that
    /// runs LL, not for the threshold. NCCL EP's LL kernels need a hidden size that is a
    /// multiple of 512: `ll` refuses another, `auto` then runs every bucket HT (the second value
    /// says why, for the log).
    pub fn resolve(
        mode: EpMode,
        threshold: usize,
        buckets: &[usize],
        zero_copy: bool,
        hidden: usize,
    ) -> Result<(Self, Option<String>), String> {
        let largest = buckets.last().copied().unwrap_or(0);
        let ll_ok = hidden % LL_HIDDEN_MULTIPLE == 0;
        let why = format!(
            "NCCL EP's low-latency kernels need a hidden size that is a multiple of {LL_HIDDEN_MULTIPLE}; this model's is {hidden}"
        );
        let (ll_max, note) = match mode {
            EpMode::Ht => (0, None),
            EpMode::Ll if !ll_ok => return Err(format!("--ep-mode ll: {why}")),
            EpMode::Ll => (largest, None),
            EpMode::Auto if !ll_ok => (
                0,
                Some(format!("--ep-mode auto runs every bucket HT: {why}")),
            ),
            EpMode::Auto => {
                let t = buckets.iter().copied().filter(|&b| b <= threshold).max();
                (t.unwrap_or(0), None)
            }
        };
        let s = Self {
            ll_max,
            ht: largest > ll_max,
            zero_copy,
        };
        Ok((s, note))
    }

    /// "ll", "ht" or "ll+ht" (the modes the buckets use).
    pub fn modes(&self) -> &'static str {
        ep_modes(self.ll_max > 0, self.ht)
    }
}

/// The name of a set of NCCL EP modes in use: "ll", "ht" or "ll+ht".
pub fn ep_modes(ll: bool, ht: bool) -> &'static str {
    match (ll, ht) {
        (true, true) => "ll+ht",
        (true, false) => "ll",
        _ => "ht",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ep_modes_resolve_against_the_buckets() {
        let b = [8, 16, 32, 64, 100];
        let r = |mode, t, h| EpSettings::resolve(mode, t, &b, true, h);
        let (auto, note) = r(EpMode::Auto, 40, 2048).unwrap();
        assert_eq!(
            (auto.ll_max, auto.ht, auto.modes(), note),
            (32, true, "ll+ht", None)
        );
        let all_ll = r(EpMode::Auto, 128, 2048).unwrap().0;
        assert_eq!(
            (all_ll.ll_max, all_ll.ht, all_ll.modes()),
            (100, false, "ll")
        );
        let none = r(EpMode::Auto, 4, 2048).unwrap().0;
        assert_eq!((none.ll_max, none.ht, none.modes()), (0, true, "ht"));
        assert_eq!(r(EpMode::Ll, 4, 2048).unwrap().0.ll_max, 100);
        let ht = r(EpMode::Ht, 1000, 2048).unwrap().0;
        assert_eq!((ht.ll_max, ht.ht), (0, true));
        // A hidden size LL cannot take: `ll` refuses, `auto` runs HT and says why.
        let e = r(EpMode::Ll, 128, 768).unwrap_err();
        assert!(e.contains("multiple of 512; this model's is 768"), "{e}");
        let (s, note) = r(EpMode::Auto, 128, 768).unwrap();
        assert_eq!((s.ll_max, s.ht), (0, true));
        assert!(note.unwrap().contains("every bucket HT"));
    }
}
