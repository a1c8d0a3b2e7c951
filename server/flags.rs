//! The values flags take that more than one module parses: durations, sizes, on/off. A leaf: the
//! modules that own a flag's meaning (transport, upload, conn) read their values here, and
//! `config` gathers their flags, so imports point one way.

use std::time::Duration;

use clap::ValueEnum;

/// An on/off setting; each also reads as true/false, yes/no and 1/0, as booleans do.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    #[value(aliases = ["true", "yes", "1"])]
    On,
    #[value(aliases = ["false", "no", "0"])]
    Off,
}

/// `s` says off (off, false, no, 0, none) where an address or a period may be turned off.
pub fn is_off(s: &str) -> bool {
    matches!(
        s.to_ascii_lowercase().as_str(),
        "off" | "false" | "no" | "0" | "none"
    )
}

/// Compares secrets (`--group-token`) in time that does not depend on where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let diff = a
        .iter()
        .zip(b)
        .fold(a.len() ^ b.len(), |d, (x, y)| d | usize::from(x ^ y));
    diff == 0
}

pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("'{s}': {e} (write e.g. 2s, 500ms)"))
}

/// A period that can be off (`--eplb-interval`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Every(pub Option<Duration>);

pub(crate) fn off_or_duration(s: &str) -> Result<Every, String> {
    match s {
        s if is_off(s) => Ok(Every(None)),
        s => duration(s).map(|d| Every(Some(d))),
    }
}

/// A size in bytes: a number of bytes, or with a unit (256MiB, 1GiB, 64MB).
pub(crate) fn size(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("'{s}': {e} (write e.g. 256MiB, 1GiB or a number of bytes)"))
}

/// A size (as `size`) from `lo` to `hi` bytes.
pub(crate) fn size_in<T: TryFrom<u64>>(s: &str, lo: u64, hi: u64) -> Result<T, String> {
    let v = size(s)?;
    if !(lo..=hi).contains(&v) {
        return Err(format!("'{s}' is {v} bytes, not within {lo} to {hi}"));
    }
    T::try_from(v).map_err(|_| format!("'{s}' is {v} bytes, too large here"))
}
